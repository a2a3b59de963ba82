"""MXFP8 quant/dequant: E4M3 elements with one E8M0 scale per 32 contiguous elements along the last dim.

q = e4m3(clamp(x * 2^-e, ±448)) where 2^e is the block's scale (mx.py's rules). Multiplying by a power of
two is exact in fp32 (barring underflow to subnormals, which the cast then rounds), so the kernel and
this reference agree bit for bit.
"""
from __future__ import annotations

import torch

from cublade.constants import F8E4M3_EMAX, F8E4M3_MAX, MX_BLOCK
from cublade.ops._dispatch import register_fake, use_kernel
from cublade.ops.fp8_quant import FP8_DTYPE
from cublade.ops.mx import DEFAULT_SCALE_RULE, SCALE_RULES, block_scales, e8m0_to_float


def mxfp8_quant_ref(x: torch.Tensor, rule: str = DEFAULT_SCALE_RULE) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> (e4m3 [..., K], uint8 E8M0 [..., K/32])."""
    codes, scale = block_scales(x, MX_BLOCK, rule, F8E4M3_MAX, F8E4M3_EMAX)
    xb = x.float().reshape(*codes.shape, MX_BLOCK)
    # x / 2^e as x * 2^-e: both exact; reciprocal of a power of two is exact unless it overflows fp32
    # (e = -127 gives 2^127, still finite).
    q = (xb * torch.reciprocal(scale)).clamp(-F8E4M3_MAX, F8E4M3_MAX).to(FP8_DTYPE)
    return q.reshape(x.shape), codes


def mxfp8_dequant_ref(q: torch.Tensor, codes: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    K = q.shape[-1]
    qb = q.float().reshape(*q.shape[:-1], K // MX_BLOCK, MX_BLOCK)
    return (qb * e8m0_to_float(codes).unsqueeze(-1)).reshape(q.shape).to(dtype)


def mxfp8_quant(x: torch.Tensor, rule: str = DEFAULT_SCALE_RULE) -> tuple[torch.Tensor, torch.Tensor]:
    if rule not in SCALE_RULES:  # checked here: the kernel only takes rceil=True/False
        raise ValueError(f"mxfp8_quant: unknown MX scale rule {rule!r}; valid: {', '.join(SCALE_RULES)}")
    if use_kernel(x, "mxfp8_quant"):
        return torch.ops.cublade.mxfp8_quant(x, rule == "rceil")
    return mxfp8_quant_ref(x, rule)


def mxfp8_dequant(q: torch.Tensor, codes: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    if use_kernel(q, "mxfp8_dequant"):
        return torch.ops.cublade.mxfp8_dequant(q, codes, dtype)
    return mxfp8_dequant_ref(q, codes, dtype)


@register_fake("cublade::mxfp8_quant")
def _mxfp8_quant_fake(x: torch.Tensor, rceil: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device),
            torch.empty((*x.shape[:-1], x.shape[-1] // MX_BLOCK), dtype=torch.uint8, device=x.device))


@register_fake("cublade::mxfp8_dequant")
def _mxfp8_dequant_fake(q: torch.Tensor, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(q.shape, dtype=dtype, device=q.device)
