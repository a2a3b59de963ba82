"""W4A16 dequant: the int4 blob of `w4a16_repack` (cublade.ops.w4a16_gemm, which documents the layout) back to a
dense weight, the prefill path of the W4A16 GEMM (dequantize once, then a dense GEMM: for large M that beats
re-reading the weights per 32-token pass).

`w4a16_dequant(packed, group_size, symmetric, size_n, size_k, dtype) -> [size_n, size_k]` in dtype: W = (u - z) * s
in fp32, rounded once to dtype (bf16 or fp16), contiguous. On a GPU with the extension
`torch.ops.cublade.w4a16_dequant` (kernel: csrc/w4a16_dequant.cu), elsewhere `w4a16_dequant_ref`; the two are
bit-identical (the product is exact in fp32).
"""
from __future__ import annotations

import torch

from cublade.ops._dispatch import register_fake, use_kernel
from cublade.ops.w4a16_gemm import w4a16_dequant_repacked


def w4a16_dequant_ref(packed: torch.Tensor, group_size: int, symmetric: bool, size_n: int, size_k: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """The blob -> the dense weight [size_n, size_k] in dtype: the fp32 weight rounded once (nearest even)."""
    return w4a16_dequant_repacked(packed, group_size, symmetric, size_n, size_k).to(dtype)


def w4a16_dequant(packed: torch.Tensor, group_size: int, symmetric: bool, size_n: int, size_k: int,
                  dtype: torch.dtype) -> torch.Tensor:
    if dtype not in (torch.bfloat16, torch.float16):  # here too: the CPU path refuses what the kernel refuses
        raise NotImplementedError(f"w4a16_dequant: dtype must be bfloat16 or float16, got {dtype}")
    if use_kernel(packed, "w4a16_dequant"):
        return torch.ops.cublade.w4a16_dequant(packed, group_size, symmetric, size_n, size_k, dtype)
    return w4a16_dequant_ref(packed, group_size, symmetric, size_n, size_k, dtype)


@register_fake("cublade::w4a16_dequant")
def _w4a16_dequant_fake(packed: torch.Tensor, group_size: int, symmetric: bool, size_n: int, size_k: int,
                        dtype: torch.dtype) -> torch.Tensor:
    return packed.new_empty((size_n, size_k), dtype=dtype)
