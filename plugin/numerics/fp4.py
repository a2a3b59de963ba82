"""FP4 E2M1 weights for MoE experts: MXFP4 (E8M0 scale per 32) and NVFP4 (E4M3 scale per 16 + fp32 global).

Nibble: bit 3 sign, bits 0-2 index into F4E2M1_VALUES. Two per byte along K: element 2i in the low nibble,
2i+1 in the high nibble (the OCP / vLLM / torchao order).

Rounding to E2M1 is round-to-nearest, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
2.5 -> 2, 3.5 -> 4, 5 -> 4), magnitudes above 6 saturate to 6; NaN encodes as +0 (the converter refuses NaN
weights before they get here).

MXFP4:  w ~= v * 2^e, 2^e from the block's amax (cublade.numerics.mx rules, elem max 6, emax 2).
NVFP4:  g = max(amax(W) / (6 * 448), tiny) fp32; per 16-block s = e4m3(amax_block / 6 / g);
        v = e2m1(w / (s * g)) (s * g in fp32); w ~= v * s * g.
"""
from __future__ import annotations

import torch

from cublade.numerics.choice import Choice
from cublade.numerics.constants import (F4E2M1_EMAX, F4E2M1_MAX, F4E2M1_VALUES, F8E4M3_MAX, MIN_WEIGHT_SCALE,
                                        MX_BLOCK, NVFP4_BLOCK)
from cublade.numerics.exact import abs_amax, div
from cublade.numerics.mx import DEFAULT_SCALE_RULE, ScaleRule, block_scales, e8m0_to_float


class Fp4Format(Choice):
    MXFP4 = "mxfp4"  # E8M0 scale per 32
    NVFP4 = "nvfp4"  # E4M3 scale per 16 and an fp32 global scale per tensor

    @property
    def block(self) -> int:
        return MX_BLOCK if self is Fp4Format.MXFP4 else NVFP4_BLOCK
# Midpoints between consecutive magnitudes; a tie goes to the even code (the lower one where the lower
# code is even, i.e. at midpoints with index 0, 2, 4, 6 -> round down; 1, 3, 5 -> round up).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> uint8 nibbles (0..15), RNE with ties to even, saturating."""
    a = x.float().abs()
    a = torch.nan_to_num(a, nan=0.0)
    code = torch.zeros_like(a, dtype=torch.uint8)
    for i, m in enumerate(_MIDPOINTS):
        lower_is_even = i % 2 == 0  # codes i (lower) and i+1 (upper)
        above = (a > m) if lower_is_even else (a >= m)
        code += above.to(torch.uint8)
    sign = (x.float() < 0) & (code > 0)  # -0 encodes as +0
    return code | (sign.to(torch.uint8) << 3)


def e2m1_decode(nib: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(F4E2M1_VALUES + tuple(-v for v in F4E2M1_VALUES), dtype=torch.float32,
                         device=nib.device)
    return table[nib.long()]


def pack_fp4(nib: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles [..., K] -> uint8 [..., K/2] (element 2i low, 2i+1 high)."""
    if nib.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim {nib.shape[-1]} is odd")
    n = nib.to(torch.uint8).reshape(*nib.shape[:-1], nib.shape[-1] // 2, 2)
    return n[..., 0] | (n[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def mxfp4_quant_weight(w: torch.Tensor, rule: ScaleRule | str = DEFAULT_SCALE_RULE) -> dict[str, torch.Tensor]:
    """[..., K] -> {'weight_packed' uint8 [..., K/2], 'weight_scale' uint8 E8M0 [..., K/32]}."""
    codes, scale = block_scales(w, MX_BLOCK, rule, F4E2M1_MAX, F4E2M1_EMAX)
    wb = w.float().reshape(*codes.shape, MX_BLOCK)
    nib = e2m1_encode(wb * torch.reciprocal(scale)).reshape(w.shape)
    return {"weight_packed": pack_fp4(nib), "weight_scale": codes}


def mxfp4_dequant_weight(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    v = e2m1_decode(unpack_fp4(packed))
    K = v.shape[-1]
    vb = v.reshape(*v.shape[:-1], K // MX_BLOCK, MX_BLOCK)
    return (vb * e8m0_to_float(scale).unsqueeze(-1)).reshape(v.shape).to(dtype)


def nvfp4_quant_weight(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """[..., K] -> {'weight_packed' uint8 [..., K/2], 'weight_scale' e4m3 [..., K/16],
    'weight_global_scale' fp32 [1]} (one global scale for the whole tensor, e.g. one expert's w1)."""
    K = w.shape[-1]
    if K % NVFP4_BLOCK:
        raise ValueError(f"nvfp4: last dim {K} is not a multiple of {NVFP4_BLOCK}")
    wf = w.float()
    g = div(abs_amax(wf), F4E2M1_MAX * F8E4M3_MAX).clamp_min(MIN_WEIGHT_SCALE).reshape(1)
    wb = wf.reshape(*w.shape[:-1], K // NVFP4_BLOCK, NVFP4_BLOCK)
    s = (div(abs_amax(wb, dim=-1), F4E2M1_MAX) / g).clamp(max=F8E4M3_MAX).to(torch.float8_e4m3fn)
    sg = (s.float() * g).unsqueeze(-1)
    # A block whose scale rounded to 0 is all (near-)zero: encode zeros rather than divide by 0.
    v = torch.where(sg > 0, wb / torch.where(sg > 0, sg, torch.ones_like(sg)), torch.zeros_like(wb))
    nib = e2m1_encode(v).reshape(w.shape)
    return {"weight_packed": pack_fp4(nib), "weight_scale": s, "weight_global_scale": g}


def nvfp4_dequant_weight(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                         dtype=torch.float32) -> torch.Tensor:
    v = e2m1_decode(unpack_fp4(packed))
    K = v.shape[-1]
    vb = v.reshape(*v.shape[:-1], K // NVFP4_BLOCK, NVFP4_BLOCK)
    sg = scale.float() * global_scale.float()
    return (vb * sg.unsqueeze(-1)).reshape(v.shape).to(dtype)


def fp4_quant_weight(w: torch.Tensor, fmt: Fp4Format | str, rule: ScaleRule | str = DEFAULT_SCALE_RULE
                     ) -> dict[str, torch.Tensor]:
    if Fp4Format.lookup(fmt, "FP4 format") is Fp4Format.MXFP4:
        return mxfp4_quant_weight(w, rule)
    return nvfp4_quant_weight(w)


def fp4_dequant_weight(t: dict[str, torch.Tensor], fmt: Fp4Format | str, dtype=torch.float32) -> torch.Tensor:
    if Fp4Format.lookup(fmt, "FP4 format") is Fp4Format.MXFP4:
        return mxfp4_dequant_weight(t["weight_packed"], t["weight_scale"], dtype)
    return nvfp4_dequant_weight(t["weight_packed"], t["weight_scale"], t["weight_global_scale"], dtype)
