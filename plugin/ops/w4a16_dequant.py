"""W4A16 dequant: the int4 blob of `w4a16_repack` (cublade.ops.w4a16_gemm, which documents the layout) back to a
dense weight, the prefill path of the W4A16 GEMM (dequantize once, then a dense GEMM: for large M that beats
re-reading the weights per 32-token pass).

`w4a16_dequant(packed, group_size, symmetric, size_n, size_k, dtype) -> [size_n, size_k]` in dtype: W = (u - z) * s
in fp32, rounded once to dtype (bf16 or fp16), contiguous. On a GPU with the extension
`torch.ops.cublade.w4a16_dequant` (kernel: csrc/w4a16_dequant.cu), elsewhere `w4a16_dequant_ref`; the two are
bit-identical (the product is exact in fp32).

`w4a16_dequant_fp8(packed, group_size, symmetric, size_n, size_k) -> (codes, scale)`, group size 128 or per
channel: the weight operand of a GEMM on FP8 tensor cores with 1 x 128 block scales. codes: E4M3 [size_n, size_k]
= u - z (integers in [-15, 15], exact in E4M3); scale: fp32 [size_n, size_k / 128] with strides (1, size_n)
(column-major, as cuBLAS's blockwise scaling reads it), each block's group scale (per channel: repeated).
"""
from __future__ import annotations

import torch

from cublade.ops._dispatch import register_fake, use_kernel
from cublade.numerics.fp8 import FP8_DTYPE
from cublade.ops.w4a16_gemm import repacked_parts, w4a16_dequant_repacked


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


def _check_fp8_blocks(group_size: int, size_k: int) -> None:
    if group_size not in (128, -1):
        raise NotImplementedError(f"w4a16_dequant_fp8: group_size must be 128 or -1 (per channel), got {group_size}")
    if size_k % 128:
        raise ValueError(f"w4a16_dequant_fp8: size_k={size_k} must be a multiple of 128")


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """t [R, C] with strides (1, R)."""
    return t.t().contiguous().t()


def w4a16_dequant_fp8_ref(packed: torch.Tensor, group_size: int, symmetric: bool, size_n: int,
                          size_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_fp8_blocks(group_size, size_k)
    u, z, s = repacked_parts(packed, group_size, symmetric, size_n, size_k)
    if group_size == -1:
        codes, scale = u - z, s.expand(size_n, size_k // 128)
    else:
        codes = (u.reshape(size_n, -1, group_size) - z[:, :, None]).reshape(size_n, size_k)
        scale = s
    return codes.to(FP8_DTYPE), _column_major(scale.float())


def w4a16_dequant_fp8(packed: torch.Tensor, group_size: int, symmetric: bool, size_n: int,
                      size_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_fp8_blocks(group_size, size_k)
    if use_kernel(packed, "w4a16_dequant_fp8"):
        return torch.ops.cublade.w4a16_dequant_fp8(packed, group_size, symmetric, size_n, size_k)
    return w4a16_dequant_fp8_ref(packed, group_size, symmetric, size_n, size_k)


@register_fake("cublade::w4a16_dequant_fp8")
def _w4a16_dequant_fp8_fake(packed: torch.Tensor, group_size: int, symmetric: bool, size_n: int,
                            size_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (packed.new_empty((size_n, size_k), dtype=FP8_DTYPE),
            packed.new_empty((size_k // 128, size_n), dtype=torch.float32).t())
