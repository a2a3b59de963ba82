"""MXFP8 quant/dequant: E4M3 elements with one E8M0 scale per 32 contiguous elements along the last dim.

`mxfp8_quant(x [..., K], rule) -> (e4m3 [..., K], uint8 E8M0 [..., K/32])` and `mxfp8_dequant(q, codes, dtype)`;
the numerics (cublade.numerics.mxfp8) are exact power-of-two scalings, so the kernel (csrc/mxfp8_quant.cu) and
the reference agree bit for bit.
"""
from __future__ import annotations

import torch

from cublade.numerics.constants import MX_BLOCK
from cublade.numerics.fp8 import FP8_DTYPE
from cublade.numerics.mx import DEFAULT_SCALE_RULE, ScaleRule
from cublade.numerics.mxfp8 import mxfp8_dequantize, mxfp8_quantize
from cublade.ops._dispatch import register_fake, use_kernel

# The references (the CPU path, and the bytes the kernels reproduce bit for bit).
mxfp8_quant_ref = mxfp8_quantize
mxfp8_dequant_ref = mxfp8_dequantize


# Plain strings, built at import: the entry below runs inside torch.compile graphs (fullgraph), and Dynamo in
# torch 2.11 cannot iterate an Enum class, which ScaleRule.lookup does.
_RULES = ScaleRule.values()
_RCEIL = ScaleRule.RCEIL.value


def mxfp8_quant(x: torch.Tensor, rule: ScaleRule | str = DEFAULT_SCALE_RULE) -> tuple[torch.Tensor, torch.Tensor]:
    rule = rule.value if isinstance(rule, ScaleRule) else rule
    if rule not in _RULES:
        raise ValueError(f"mxfp8_quant: unknown MX scale rule {rule!r}; valid: {', '.join(_RULES)}")
    if use_kernel(x, "mxfp8_quant"):
        return torch.ops.cublade.mxfp8_quant(x, rule == _RCEIL)
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
