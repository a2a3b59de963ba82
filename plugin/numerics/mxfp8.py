"""MXFP8: E4M3 elements with one E8M0 scale per 32 contiguous elements along the last dim.

q = e4m3(clamp(x * 2^-e, ±448)) where 2^e is the block's scale (cublade.numerics.mx's rules). Multiplying by a
power of two is exact in fp32 (barring underflow to subnormals, which the cast then rounds), so a kernel can
agree with this bit for bit.
"""
from __future__ import annotations

import torch

from cublade.numerics.constants import F8E4M3_EMAX, F8E4M3_MAX, MX_BLOCK
from cublade.numerics.fp8 import FP8_DTYPE
from cublade.numerics.mx import DEFAULT_SCALE_RULE, ScaleRule, block_scales, e8m0_to_float


def mxfp8_quantize(x: torch.Tensor, rule: ScaleRule | str = DEFAULT_SCALE_RULE) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> (e4m3 [..., K], uint8 E8M0 [..., K/32])."""
    codes, scale = block_scales(x, MX_BLOCK, rule, F8E4M3_MAX, F8E4M3_EMAX)
    xb = x.float().reshape(*codes.shape, MX_BLOCK)
    # x / 2^e as x * 2^-e: both exact; reciprocal of a power of two is exact unless it overflows fp32
    # (e = -127 gives 2^127, still finite).
    q = (xb * torch.reciprocal(scale)).clamp(-F8E4M3_MAX, F8E4M3_MAX).to(FP8_DTYPE)
    return q.reshape(x.shape), codes


def mxfp8_dequantize(q: torch.Tensor, codes: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    K = q.shape[-1]
    qb = q.float().reshape(*q.shape[:-1], K // MX_BLOCK, MX_BLOCK)
    return (qb * e8m0_to_float(codes).unsqueeze(-1)).reshape(q.shape).to(dtype)
