"""FP8 E4M3 per-tensor quantization of activations, dynamic (`scale=None`: from the tensor's amax) or static (a
calibrated fp32 scale): `fp8_quant_per_tensor(x, scale=None) -> (e4m3 of x's shape, fp32 scale [1])`,
q = e4m3(clamp(x * (1 / scale), ±448)) (vLLM's scaled_fp8_quant bytes). The numerics: cublade.numerics.fp8; the
kernel: csrc/fp8_quant_per_tensor.cu."""
from __future__ import annotations

import torch

from cublade.numerics.fp8 import FP8_DTYPE, quantize_per_tensor
from cublade.ops._dispatch import register_fake, use_kernel

# The reference (the CPU path, and the bytes the kernel reproduces bit for bit).
fp8_quant_per_tensor_ref = quantize_per_tensor


def fp8_quant_per_tensor(x: torch.Tensor, scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel returns its own copy of a static scale (shape [1], fp32); the reference a view of it."""
    if use_kernel(x, "fp8_quant_per_tensor"):
        return torch.ops.cublade.fp8_quant_per_tensor(x, None if scale is None else scale.float())
    return fp8_quant_per_tensor_ref(x, scale)


@register_fake("cublade::fp8_quant_per_tensor")
def _fp8_quant_per_tensor_fake(x: torch.Tensor, scale: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device),
            torch.empty((1,), dtype=torch.float32, device=x.device))
