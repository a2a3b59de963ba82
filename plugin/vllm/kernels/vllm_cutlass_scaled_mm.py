"""FP8 W8A8 on vLLM's CUTLASS scaled-mm, with activations quantized by cublade's op."""
from __future__ import annotations

from typing import Callable

import torch

from cublade.config import Fp8Scheme
from cublade.numerics.fp8 import Fp8Activations
from cublade.ops.fp8_quant_per_tensor import fp8_quant_per_tensor_ref
from cublade.ops.fp8_quant_per_token import fp8_quant_per_token_ref
from cublade.vllm.kernels.base import LinearKernel, cublade_op, gpu_half


def _fp8_input_quant(scheme: Fp8Scheme, device: torch.device) -> tuple[Callable, str]:
    """(x2d, input_scale) -> (e4m3, fp32 scale [M, 1] or [1]), bound to cublade's op or its reference."""
    if scheme.activations is Fp8Activations.DYNAMIC_TOKEN:
        fn, how = cublade_op("fp8_quant_per_token", device, fp8_quant_per_token_ref)
        return (lambda x, s: fn(x)), how
    fn, how = cublade_op("fp8_quant_per_tensor", device, fp8_quant_per_tensor_ref)
    if scheme.activations is Fp8Activations.DYNAMIC_TENSOR:
        return (lambda x, s: fn(x, None)), how
    return (lambda x, s: fn(x, s.float())), how  # the op takes an fp32 scale


class VllmCutlassScaledMM(LinearKernel):
    """vLLM's CUTLASS scaled-mm (a fallback: cublade has no FP8 GEMM of its own). Activations are quantized
    by cublade's op; the epilogue applies the activation scale (per token or per tensor) and the weight
    scale (per channel or per tensor)."""
    name = "vllm-cutlass-scaled-mm"
    own = False

    @classmethod
    def can_implement(cls, layer):
        cap, why = gpu_half(layer, layer.weight.device)
        if cap is None:
            return False, why
        try:
            from vllm import _custom_ops as ops

            supported = ops.cutlass_scaled_mm_supports_fp8(cap)
        except (AttributeError, RuntimeError) as e:
            return False, f"vLLM's _C has no cutlass_scaled_mm ({e})"
        if not supported:
            return False, f"vLLM's CUTLASS FP8 GEMM does not run on sm_{cap}"
        N, K = layer.output_size_per_partition, layer.input_size_per_partition
        if N % 16 or K % 16:
            return False, f"N={N}, K={K} are not multiples of 16"
        return True, f"FP8 tensor cores on sm_{cap}"

    def __init__(self, layer):
        super().__init__(layer)
        self.quant_input, self.quant_how = _fp8_input_quant(self.scheme, layer.weight.device)

    def apply(self, layer, x, bias):
        from vllm import _custom_ops as ops

        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = self.quant_input(x2, getattr(layer, "input_scale", None))
        # CUTLASS takes B column-major: the [N, K] row-major weight transposed is exactly that (no copy).
        y = ops.cutlass_scaled_mm(xq, layer.weight.t(), scale_a=xs, scale_b=layer.weight_scale,
                                  out_dtype=x.dtype, bias=bias)
        return y.reshape(*x.shape[:-1], -1)
