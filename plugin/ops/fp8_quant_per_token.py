"""FP8 E4M3 dynamic per-token quantization of activations: `fp8_quant_per_token(x [..., K]) -> (e4m3 [..., K],
fp32 scale [..., 1])`, one scale per row, q = e4m3(clamp(x / scale, ±448)) with a true fp32 division (vLLM's
per-token bytes). `fp8_quant_per_token_bf16(x bf16)` / `fp8_quant_per_token_f16(x bf16)`: the same E4M3 values
written as bf16 / fp16 (exact in both), the activations of `fp8_gemm`. The numerics: cublade.numerics.fp8; the
kernel: csrc/fp8_quant_per_token.cu."""
from __future__ import annotations

import torch

from cublade.numerics.fp8 import FP8_DTYPE, quantize_per_token
from cublade.ops._dispatch import register_fake, use_kernel

# The reference (the CPU path, and the bytes the kernel reproduces bit for bit).
fp8_quant_per_token_ref = quantize_per_token


def fp8_quant_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if use_kernel(x, "fp8_quant_per_token"):
        return torch.ops.cublade.fp8_quant_per_token(x)
    return fp8_quant_per_token_ref(x)


def _outputs(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The ops' outputs for x, unfilled: the quantized values in `dtype`, one fp32 scale per row."""
    return (torch.empty(x.shape, dtype=dtype, device=x.device),
            torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device))


@register_fake("cublade::fp8_quant_per_token")
def _fp8_quant_per_token_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _outputs(x, FP8_DTYPE)


def _values_ref(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = quantize_per_token(x)
    return q.to(dtype), s


def fp8_quant_per_token_bf16_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same quantization with the E4M3 values returned as bf16 (exact): fp8_gemm's activations."""
    return _values_ref(x, torch.bfloat16)


def fp8_quant_per_token_f16_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same with the values as fp16 (exact: E4M3's range and 3 mantissa bits fit fp16's)."""
    return _values_ref(x, torch.float16)


def fp8_quant_per_token_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if use_kernel(x, "fp8_quant_per_token_bf16"):
        return torch.ops.cublade.fp8_quant_per_token_bf16(x)
    return fp8_quant_per_token_bf16_ref(x)


@register_fake("cublade::fp8_quant_per_token_bf16")
def _fp8_quant_per_token_bf16_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _outputs(x, torch.bfloat16)


def fp8_quant_per_token_f16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if use_kernel(x, "fp8_quant_per_token_f16"):
        return torch.ops.cublade.fp8_quant_per_token_f16(x)
    return fp8_quant_per_token_f16_ref(x)


@register_fake("cublade::fp8_quant_per_token_f16")
def _fp8_quant_per_token_f16_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _outputs(x, torch.float16)
