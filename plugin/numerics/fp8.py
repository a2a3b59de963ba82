"""FP8 E4M3 quantization math: dynamic per-token, dynamic per-tensor, static per-tensor (activations) and
per-channel / per-tensor (weights, offline).

Numerics (the contract every kernel reproduces bit for bit):
  * all arithmetic in fp32; a bf16/fp16 input is widened exactly;
  * scale = max(amax / 448, FP8_MIN_SCALE) for dynamic scales (an all-zero row gives zeros, not NaN), the
    division a true fp32 division;
  * per-tensor (dynamic and static) and weights: q = e4m3(clamp(x * (1 / scale), -448, 448)), the
    reciprocal rounded once to fp32 and the cast round-to-nearest-even (vLLM's scaled_fp8_quant per-tensor
    path, static and dynamic: one multiply per element);
  * dynamic per-token: q = e4m3(clamp(x / scale, -448, 448)), a true fp32 division. vLLM's
    dynamic_per_token_scaled_fp8_quant divides here ("we don't use inverted scales so we can match FBGemm",
    csrc/quantization/w8a8/fp8/common.cu: scaled_fp8_conversion<false>), so cublade's per-token bytes equal
    vLLM's. x * RN(1/s) and RN(x / s) differ by one fp32 ulp for about half of all inputs, which changes the
    E4M3 byte when that ulp crosses a rounding point: a reciprocal here would not match vLLM.
  * NaN propagates: a NaN anywhere in a row (or tensor) makes its scale NaN and every output NaN. An Inf
    makes the scale Inf, so finite values quantize to 0 and the Inf itself to NaN (Inf / Inf, Inf * 0).

Divisions by a constant and amax go through cublade.numerics.exact, the same bits on the CPU and on CUDA.
"""
from __future__ import annotations

import torch

from cublade.numerics.choice import Choice
from cublade.numerics.constants import F8E4M3_MAX, FP8_MIN_SCALE
from cublade.numerics.exact import abs_amax, div

FP8_DTYPE = torch.float8_e4m3fn


class Fp8Activations(Choice):
    """How an FP8 W8A8 layer quantizes its activations."""
    DYNAMIC_TOKEN = "dynamic-token"  # a scale per token, from its amax, at run time
    DYNAMIC_TENSOR = "dynamic-tensor"  # one scale for the whole input, from its amax, at run time
    STATIC_TENSOR = "static-tensor"  # one calibrated scale (the checkpoint's input_scale)


def dynamic_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scale for an fp32 amax: amax / 448 (true division), floored at FP8_MIN_SCALE, NaN kept."""
    s = div(amax.float(), F8E4M3_MAX)
    # torch.clamp_min keeps NaN (max(NaN, c) = NaN), matching the kernels' NaN-propagating max.
    return torch.clamp_min(s, FP8_MIN_SCALE)


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(clamp(x * (1/scale), ±448)); `scale` broadcasts against `x` (fp32)."""
    inv = torch.reciprocal(scale.float())
    y = x.float() * inv  # a new tensor: clamped in place, so a weight's quantization holds one fp32 temporary
    return y.clamp_(-F8E4M3_MAX, F8E4M3_MAX).to(FP8_DTYPE)


def quantize_div_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(clamp(x / scale, ±448)), a true fp32 division; `scale` is a tensor broadcasting against `x`."""
    y = x.float() / scale.float()
    return y.clamp(-F8E4M3_MAX, F8E4M3_MAX).to(FP8_DTYPE)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token: [..., K] float -> (e4m3 [..., K], fp32 scale [..., 1])."""
    xf = x.float()
    scale = dynamic_scale(abs_amax(xf, dim=-1, keepdim=True))
    return quantize_div_scale(xf, scale), scale


def quantize_per_group(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per 1 x group (activations of a blockwise-scaled GEMM): [M, K] (K % group == 0) -> (e4m3 [M, K],
    fp32 scale [M, K / group]), the per-token rule applied to each group."""
    M, K = x.shape
    q, s = quantize_per_token(x.reshape(M, K // group, group))
    return q.reshape(M, K), s.reshape(M, K // group)


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic (scale=None: computed from the tensor's amax) or static (given fp32 scale, shape [1] or [])
    per-tensor quant. Returns (e4m3 tensor of x's shape, fp32 scale of shape [1])."""
    xf = x.float()
    if scale is None:
        scale = dynamic_scale(abs_amax(xf)).reshape(1)
    else:
        scale = scale.float().reshape(1)
    return quantize_with_scale(xf, scale).reshape(x.shape), scale  # reshape: a 0-dim x stays 0-dim


def fp8_quant_weight(w: torch.Tensor, per_channel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] weight -> (e4m3 [N, K], fp32 scale [N] per channel or [1] per tensor)."""
    wf = w.float()
    if per_channel:
        scale = dynamic_scale(abs_amax(wf, dim=1, keepdim=True))
        return quantize_with_scale(wf, scale), scale.reshape(-1)
    scale = dynamic_scale(abs_amax(wf)).reshape(1)
    return quantize_with_scale(wf, scale), scale


def fp8_dequant(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """q * scale, where scale is [1], [N] (per row of a 2-D q) or [M, 1]."""
    s = scale.float()
    if s.dim() == 1 and s.numel() > 1:
        s = s.unsqueeze(-1)
    return (q.float() * s).to(dtype)
