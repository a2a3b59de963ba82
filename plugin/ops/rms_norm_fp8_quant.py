"""RMSNorm, optionally after a residual add, and FP8 E4M3 quantization of its output in one op:

    rms_norm_fp8_quant(x, weight, eps, scale=None) -> (e4m3 of x's shape, fp32 scale)
    fused_add_rms_norm_fp8_quant(x, residual, weight, eps, scale=None) -> (e4m3, fp32 scale, new residual)

The norm is vLLM's native `rms_norm` / `fused_add_rms_norm` (vllm.ir.ops.layernorm: fp32 math, the normalized value
rounded to x's dtype before the weight multiplies it; the new residual is x + residual rounded to x's dtype), the
quantization cublade's: per token (`scale=None`: fp8_quant_per_token's rule, scale [..., 1]) or per tensor with a
static fp32 scale (fp8_quant_per_tensor's rule; the scale returned as [1]). These are what cublade's compile pass
(cublade.vllm.fusion) puts in place of a norm followed by an fp8 layer's quantization. The kernel
(csrc/rms_norm_fp8_quant.cu) reproduces the reference's bytes except where mean(h^2)'s fp32 summation order moves a
value across a rounding boundary."""
from __future__ import annotations

import torch

from cublade.numerics.fp8 import FP8_DTYPE, quantize_per_tensor, quantize_per_token
from cublade.ops._dispatch import register_fake, use_kernel

MAX_K = 16384  # the kernel's widest row (kRmsNormFp8QuantMaxK)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """vLLM's native RMSNorm: (the normalized x in x's dtype, the new residual or None)."""
    h = x.float()
    new_residual = None
    if residual is not None:
        h = h + residual.float()
        new_residual = h.to(x.dtype)
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (h.to(weight.dtype) * weight).to(x.dtype), new_residual


def _quantize(y: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_per_token(y) if scale is None else quantize_per_tensor(y, scale)


def rms_norm_fp8_quant_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize(rms_norm_ref(x, weight, eps)[0], scale)


def fused_add_rms_norm_fp8_quant_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                     scale: torch.Tensor | None = None
                                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, new_residual = rms_norm_ref(x, weight, eps, residual)
    return (*_quantize(y, scale), new_residual)


def kernel_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the CUDA kernel runs these shapes and dtypes (else the reference does)."""
    K = x.shape[-1]
    return (x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and K % 8 == 0
            and 8 <= K <= MAX_K)


def rms_norm_fp8_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    if use_kernel(x, "rms_norm_fp8_quant") and kernel_takes(x, weight):
        return torch.ops.cublade.rms_norm_fp8_quant(x, weight, eps, scale)
    return rms_norm_fp8_quant_ref(x, weight, eps, scale)


def fused_add_rms_norm_fp8_quant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                 scale: torch.Tensor | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_kernel(x, "fused_add_rms_norm_fp8_quant") and kernel_takes(x, weight):
        return torch.ops.cublade.fused_add_rms_norm_fp8_quant(x, residual, weight, eps, scale)
    return fused_add_rms_norm_fp8_quant_ref(x, residual, weight, eps, scale)


def _outputs(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    s_shape = (1,) if scale is not None else (*x.shape[:-1], 1)
    return (torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device),
            torch.empty(s_shape, dtype=torch.float32, device=x.device))


@register_fake("cublade::rms_norm_fp8_quant")
def _rms_norm_fp8_quant_fake(x, weight, eps, scale=None):
    return _outputs(x, scale)


@register_fake("cublade::fused_add_rms_norm_fp8_quant")
def _fused_add_rms_norm_fp8_quant_fake(x, residual, weight, eps, scale=None):
    return (*_outputs(x, scale), torch.empty_like(x))
