"""int4 group quantization for W4A16, and the packing of the checkpoint format.

Checkpoint layout (cublade.config.schemes names the tensors):
  weight_packed      int32 [N, K/8]   8 values per word along K, value j in bits [4j, 4j+4); each value is an
                                      unsigned nibble u in [0, 15]
  weight_scale       bf16  [N, K/G]   one scale per group of G consecutive K (G = K for group_size -1)
  weight_zero_point  uint8 [N, K/G]   asymmetric only; symmetric schemes store u = q + 8 (implicit zero 8)
Dequant: w = (u - z) * s with z = 8 (symmetric) or the stored zero point, in fp32.

Quant (round-to-nearest, the RTN baseline; GPTQ in cublade.calib reuses `quantize_groups` per column):
  symmetric:  s = max(amax / 7, MIN_WEIGHT_SCALE), q = clamp(round(w / s), -8, 7)
  asymmetric: s = max((max - min) / 15, MIN_WEIGHT_SCALE), z = clamp(round(-min / s), 0, 15),
              q = clamp(round(w / s) + z, 0, 15)
The scale is rounded to bf16 first and q computed with that stored scale, so dequant sees what quant used.
round() is half-to-even.
"""
from __future__ import annotations

import sys

import torch

from cublade.numerics.constants import (INT4_ASYM_QMAX, INT4_PER_INT32, INT4_SYM_OFFSET, INT4_SYM_QMAX,
                                        INT4_SYM_QMIN, MIN_WEIGHT_SCALE)
from cublade.numerics.exact import abs_amax, div

SCALE_DTYPE = torch.bfloat16


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """[..., 8] nibbles (j = 0..7, values 0..15, any int dtype) -> int32 [...] with nibble j in bits [4j, 4j+4) (two's
    complement view of the unsigned word): byte i holds nibbles 2i (low half) and 2i + 1, and the word's 4 bytes are
    read as one little-endian int32."""
    if sys.byteorder != "little":
        raise RuntimeError("pack_nibbles reads 4 bytes as a little-endian int32; this host is big-endian")
    b = u.to(torch.uint8)
    return (b[..., 0::2] | (b[..., 1::2] << 4)).contiguous().view(torch.int32).squeeze(-1)


def unpack_nibbles(w: torch.Tensor) -> torch.Tensor:
    """int32 [...] -> uint8 nibbles [..., 8] (the inverse of pack_nibbles)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w.device)
    return ((w.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)  # arithmetic shift, then mask: sign bits drop out


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """uint nibbles [N, K] (values 0..15, any int dtype) -> int32 [N, K/8]."""
    N, K = u.shape
    if K % INT4_PER_INT32:
        raise ValueError(f"pack_int4: K={K} is not a multiple of {INT4_PER_INT32}")
    if u.numel() and (u.min() < 0 or u.max() > 15):
        raise ValueError("pack_int4: values must be in [0, 15]")
    return pack_nibbles(u.reshape(N, K // INT4_PER_INT32, INT4_PER_INT32))


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [N, K/8] -> uint8 nibbles [N, K]."""
    N, W = packed.shape
    return unpack_nibbles(packed).reshape(N, W * INT4_PER_INT32)


def group_view(w: torch.Tensor, group_size: int) -> torch.Tensor:
    N, K = w.shape
    G = K if group_size == -1 else group_size
    if K % G:
        raise ValueError(f"w4a16: in_features={K} is not a multiple of group_size={group_size}")
    return w.reshape(N, K // G, G)


def group_params(w: torch.Tensor, group_size: int, symmetric: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-group (scale bf16 [N, K/G], zero uint8 [N, K/G] or None) for a [N, K] weight."""
    wg = group_view(w.float(), group_size)
    if symmetric:
        s = div(abs_amax(wg, dim=-1), INT4_SYM_QMAX).clamp_min(MIN_WEIGHT_SCALE).to(SCALE_DTYPE)
        return s, None
    lo = wg.amin(dim=-1).clamp_max(0.0)
    hi = wg.amax(dim=-1).clamp_min(0.0)
    s = div(hi - lo, INT4_ASYM_QMAX).clamp_min(MIN_WEIGHT_SCALE).to(SCALE_DTYPE)
    z = torch.round(-lo / s.float()).clamp(0, INT4_ASYM_QMAX).to(torch.uint8)
    return s, z


def quantize_groups(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int
                    ) -> torch.Tensor:
    """Unsigned nibbles u [N, K] of w under the given per-group scale/zero. In place on one fp32 temporary: the
    converter's peak memory holds one weight's temporaries (tests/test_convert_memory.py)."""
    N, K = w.shape
    q = group_view(w.float(), group_size) / scale.float().unsqueeze(-1)
    q.round_()
    if zero is None:
        q.clamp_(INT4_SYM_QMIN, INT4_SYM_QMAX).add_(INT4_SYM_OFFSET)
    else:
        q.add_(zero.float().unsqueeze(-1)).clamp_(0, INT4_ASYM_QMAX)
    return q.reshape(N, K).to(torch.uint8)


def int4_quant_weight(w: torch.Tensor, group_size: int = 128, symmetric: bool = True
                      ) -> dict[str, torch.Tensor]:
    """RTN: [N, K] float weight -> {'weight_packed', 'weight_scale'[, 'weight_zero_point']}."""
    w = w.float()  # once, for both passes
    scale, zero = group_params(w, group_size, symmetric)
    out = {"weight_packed": pack_int4(quantize_groups(w, scale, zero, group_size)), "weight_scale": scale}
    if zero is not None:
        out["weight_zero_point"] = zero
    return out


def int4_dequant_weight(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                        group_size: int, dtype=torch.float32) -> torch.Tensor:
    u = unpack_int4(packed).float()
    N, K = u.shape
    z = torch.full_like(scale, INT4_SYM_OFFSET, dtype=torch.float32) if zero is None else zero.float()
    ug = group_view(u, group_size)
    w = (ug - z.unsqueeze(-1)) * scale.float().unsqueeze(-1)
    return w.reshape(N, K).to(dtype)
