"""FP8 E4M3 dynamic quantization per 1 x 128 group of activations: `fp8_quant_per_group(x [M, K]) -> (e4m3 [M, K],
fp32 scale [M, K/128])`, the scale column-major (strides (1, M)) as cuBLAS's blockwise-scaled FP8 GEMM reads it.
Each group of 128 consecutive elements of a row gets the dynamic per-token rule: scale = max(amax / 448,
1/(448*512)), q = e4m3(clamp(x / scale, ±448)) with a true fp32 division. The kernel:
csrc/fp8_quant_per_group.cu."""
from __future__ import annotations

import torch

from cublade.numerics.fp8 import FP8_DTYPE, quantize_per_group
from cublade.ops._dispatch import register_fake, use_kernel

GROUP = 128


def _check(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] % GROUP or x.shape[1] == 0:
        raise ValueError(f"fp8_quant_per_group: x must be [M, K] with K a positive multiple of {GROUP}, "
                         f"got shape {tuple(x.shape)}")


def fp8_quant_per_group_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x)
    q, s = quantize_per_group(x, GROUP)
    return q, s.t().contiguous().t()  # column-major, as the kernel writes it


def fp8_quant_per_group(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x)
    if use_kernel(x, "fp8_quant_per_group") and x.dtype in (torch.bfloat16, torch.float16):
        return torch.ops.cublade.fp8_quant_per_group(x)
    return fp8_quant_per_group_ref(x)


@register_fake("cublade::fp8_quant_per_group")
def _fp8_quant_per_group_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x.shape
    return (torch.empty((M, K), dtype=FP8_DTYPE, device=x.device),
            torch.empty((K // GROUP, M), dtype=torch.float32, device=x.device).t())
