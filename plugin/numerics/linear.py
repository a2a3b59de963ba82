"""Reference quantized linears: what each scheme's layer computes, from the quantized tensors themselves
(never from a dequantized copy stored anywhere). y = x @ W^T (+ bias), accumulated in fp32, returned in
x's dtype. GPU methods must agree with these within the scheme's tolerance (GEMMs are not bit-exact:
their fp32 summation order differs), and the quant steps inside them are bit-exact.
"""
from __future__ import annotations

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


def w4a16_linear_ref(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                     weight_zero_point: torch.Tensor | None, group_size: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    return _dense(x, int4_dequant_weight(weight_packed, weight_scale, weight_zero_point, group_size), bias)


def mxfp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only MXFP8 (Hopper has no MX tensor cores): activations stay in their dtype."""
    return _dense(x, mxfp8_dequantize(weight, weight_scale), bias)


def fp4_linear_ref(x: torch.Tensor, tensors: dict[str, torch.Tensor], fmt: Fp4Format | str,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    return _dense(x, fp4_dequant_weight(tensors, fmt), bias)
