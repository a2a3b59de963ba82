"""Reference quantized linears: what each scheme's layer computes, from the quantized tensors themselves
(never from a dequantized copy stored anywhere). y = x @ W^T (+ bias), accumulated in fp32, returned in
x's dtype. GPU methods must agree with these within the scheme's tolerance (GEMMs are not bit-exact:
their fp32 summation order differs), and the quant steps inside them are bit-exact.
"""
from __future__ import annotations

import os

import torch

from cublade.numerics.fp4 import Fp4Format, fp4_dequant_weight
from cublade.numerics.fp8 import Fp8Activations, quantize_per_tensor, quantize_per_token
from cublade.numerics.int4 import int4_dequant_weight
from cublade.numerics.mxfp8 import mxfp8_dequantize


def _finish(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   activations: Fp8Activations | str = Fp8Activations.DYNAMIC_TOKEN,
                   input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8: activations quantized per token (dynamic) or per tensor (dynamic, or static `input_scale`),
    e4m3 x e4m3 products summed in fp32, then both scales applied (the scaled-mm epilogue)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    activations = Fp8Activations.lookup(activations, "fp8 activation mode")
    if activations is Fp8Activations.DYNAMIC_TOKEN:
        xq, xs = quantize_per_token(x2)
    elif activations is Fp8Activations.DYNAMIC_TENSOR:
        xq, xs = quantize_per_tensor(x2)
    else:
        if input_scale is None:
            raise ValueError("fp8 static-tensor activations need an input_scale")
        xq, xs = quantize_per_tensor(x2, input_scale)
    ws = weight_scale.float().reshape(1, -1)  # [1, N] or [1, 1]
    y = (xq.float() @ weight.float().t()) * xs.float() * ws
    return _finish(y, bias, x.dtype).reshape(*shape[:-1], -1)


def _dense(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.reshape(-1, x.shape[-1]).float() @ w.t()
    return _finish(y, bias, x.dtype).reshape(*x.shape[:-1], -1)


W4A16_PREFILL_ENV = "CUBLADE_W4A16_PREFILL"
W4A16_PREFILL_CHOICES = ("bf16", "fp8")
# Rows from which CUBLADE_W4A16_PREFILL=fp8 rounds a w4a16 layer's activations to E4M3 per 1 x 128 (the FP8
# tensor-core path, cublade.ops.w4a16_gemm_fp8; the measurement behind 512: docs/decisions.md).
W4A16_FP8_MIN_ROWS = 512


def w4a16_prefill_math() -> str:
    """CUBLADE_W4A16_PREFILL: "bf16" (default: bf16/fp16 activations at every batch size) or "fp8" (calls of
    W4A16_FP8_MIN_ROWS rows or more take their activations in E4M3 per 1 x 128, on FP8 tensor cores)."""
    v = os.environ.get(W4A16_PREFILL_ENV, "").strip().lower() or "bf16"
    if v not in W4A16_PREFILL_CHOICES:
        raise ValueError(f"{W4A16_PREFILL_ENV}={os.environ[W4A16_PREFILL_ENV]!r}: expected one of "
                         f"{', '.join(W4A16_PREFILL_CHOICES)}")
    return v


def fp8_activations_per_group(x2: torch.Tensor) -> torch.Tensor:
    """x [M, K] (K % 128 == 0) rounded to E4M3 per 1 x 128 group with the dynamic per-token rule per group, back in
    fp32 (q * scale, exact)."""
    M, K = x2.shape
    q, s = quantize_per_token(x2.reshape(M, K // 128, 128))
    return (q.float() * s).reshape(M, K)


def w4a16_linear_ref(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                     weight_zero_point: torch.Tensor | None, group_size: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """bf16/fp16 activations times the exact int4 weights. With CUBLADE_W4A16_PREFILL=fp8, calls of
    W4A16_FP8_MIN_ROWS rows or more at group size 128 or per channel compute what the FP8 tensor-core path does:
    activations rounded to E4M3 per 1 x 128 first."""
    w = int4_dequant_weight(weight_packed, weight_scale, weight_zero_point, group_size)
    K = x.shape[-1]
    if (group_size in (128, -1) and K % 128 == 0 and x.numel() // max(K, 1) >= W4A16_FP8_MIN_ROWS
            and w4a16_prefill_math() == "fp8"):
        y = fp8_activations_per_group(x.reshape(-1, K).float()) @ w.float().t()
        return _finish(y, bias, x.dtype).reshape(*x.shape[:-1], -1)
    return _dense(x, w, bias)


def mxfp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only MXFP8 (Hopper has no MX tensor cores): activations stay in their dtype."""
    return _dense(x, mxfp8_dequantize(weight, weight_scale), bias)


def fp4_linear_ref(x: torch.Tensor, tensors: dict[str, torch.Tensor], fmt: Fp4Format | str,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    return _dense(x, fp4_dequant_weight(tensors, fmt), bias)
