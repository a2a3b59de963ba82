"""A stand-in for a vLLM linear layer after loading, for the GPU tests of cublade.vllm.kernels' classes: what
cublade.vllm.linear leaves for a kernel class (the scheme's tensors as Parameters, the sizes per rank, the activation
dtype, the scheme)."""
from __future__ import annotations

import torch


def stand_in_layer(scheme, tensors: dict[str, torch.Tensor], N: int, K: int, dtype=torch.bfloat16,
                   device: str = "cuda") -> torch.nn.Module:
    layer = torch.nn.Module()
    for name, t in tensors.items():
        layer.register_parameter(name, torch.nn.Parameter(t.to(device), requires_grad=False))
    layer.output_size_per_partition, layer.input_size_per_partition = N, K
    layer.params_dtype, layer.cublade_scheme, layer.bias = dtype, scheme, None
    return layer


def vllm_stand_in_layer(scheme, tensors: dict[str, torch.Tensor], N: int, K: int, prefix: str) -> torch.nn.Module:
    """stand_in_layer of copies of `tensors`, with what vLLM's own kernels read from a linear layer besides (full
    sizes: one rank; no bias) and vLLM's layer prefix."""
    layer = stand_in_layer(scheme, {k: v.clone() for k, v in tensors.items()}, N, K)
    layer.input_size, layer.output_size = K, N
    layer.output_partition_sizes, layer.logical_widths, layer.has_bias = [N], [N], False
    layer.prefix = prefix
    return layer
