"""Shared E8M0 block-scale arithmetic of the OCP MX formats (MXFP8, MXFP4).

Two rules pick a block's power-of-two scale from its amax (both exact, from the fp32 exponent bits):
  * "floor" (OCP MX v1.0): e = floor(log2 amax) - emax_elem; elements above the format max saturate.
  * "rceil" (NVIDIA's kernels, the cublade default): e = ceil(log2(amax / max_elem)); never saturates.
The exponent is clamped to E8M0's range [-127, 127]; an all-zero block takes e = -127 (code 0), and a
block holding NaN gets the NaN code 255 (and NaN outputs).
"""
from __future__ import annotations

import torch

from cublade.numerics.choice import Choice
from cublade.numerics.constants import E8M0_BIAS, E8M0_MAX_EXP, E8M0_MIN_EXP, E8M0_NAN
from cublade.numerics.exact import abs_amax, div


class ScaleRule(Choice):
    """How a block's power-of-two scale follows from its amax (module docstring)."""
    RCEIL = "rceil"
    FLOOR = "floor"


DEFAULT_SCALE_RULE = ScaleRule.RCEIL


def _floor_log2(v: torch.Tensor) -> torch.Tensor:
    """floor(log2 v) for positive finite fp32 v, exact (frexp: v = m * 2^e with m in [0.5, 1))."""
    _, e = torch.frexp(v)
    return e - 1


def _ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """ceil(log2 v) for positive finite fp32 v, exact: a power of two keeps its exponent."""
    m, e = torch.frexp(v)
    return torch.where(m == 0.5, e - 1, e)


def e8m0_exponent(amax: torch.Tensor, rule: ScaleRule | str, max_elem: float, emax_elem: int) -> torch.Tensor:
    """int32 unbiased exponent of each block's scale (NaN blocks are handled by the caller)."""
    rule = ScaleRule.lookup(rule, "MX scale rule")
    a = amax.float()
    finite_pos = torch.isfinite(a) & (a > 0)
    safe = torch.where(finite_pos, a, torch.ones_like(a))
    if rule is ScaleRule.FLOOR:
        e = _floor_log2(safe) - emax_elem
    else:
        # A true fp32 division (by a tensor: CUDA turns division by a Python float into a multiply by its
        # reciprocal), rounded once, as the kernels do. Below 448 * 2^-150 it underflows to 0: such a block
        # takes the smallest exponent, like an all-zero one.
        v = div(safe, max_elem)
        finite_pos &= v > 0
        e = _ceil_log2(torch.where(v > 0, v, torch.ones_like(v)))
    e = torch.where(finite_pos, e, torch.where(torch.isinf(a), E8M0_MAX_EXP, E8M0_MIN_EXP))
    return e.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP).to(torch.int32)


def block_scales(x: torch.Tensor, block: int, rule: ScaleRule | str, max_elem: float, emax_elem: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """For x [..., K] (K % block == 0): (uint8 E8M0 codes [..., K/block], fp32 scale 2^e [..., K/block, 1])."""
    K = x.shape[-1]
    if K % block:
        raise ValueError(f"MX quant: last dim {K} is not a multiple of the block size {block}")
    xb = x.float().reshape(*x.shape[:-1], K // block, block)
    amax = abs_amax(xb, dim=-1)  # NaN-propagating
    e = e8m0_exponent(amax, rule, max_elem, emax_elem)
    codes = (e + E8M0_BIAS).to(torch.uint8)
    codes = torch.where(torch.isnan(amax), torch.full_like(codes, E8M0_NAN), codes)
    return codes, e8m0_to_float(codes).unsqueeze(-1)


def e8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 codes -> fp32 2^(code-127); 255 -> NaN. 2^-127 is an fp32 subnormal, still exact."""
    c = codes.to(torch.int32)
    v = torch.ldexp(torch.ones_like(c, dtype=torch.float32), (c - E8M0_BIAS).float())
    return torch.where(c == E8M0_NAN, torch.full_like(v, float("nan")), v)
