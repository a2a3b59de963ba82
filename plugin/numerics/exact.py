"""Reductions and divisions that give the same bits on the CPU and on CUDA, for the quantization rules that the
converter runs on either (`cublade convert --quant-device`) and the kernels reproduce.

PyTorch's CUDA kernels compute `tensor / python_scalar` as `tensor * (1 / scalar)` (one more rounding), so a
division by a constant is written as a division by a 0-dim tensor. max |x| is taken as |max(max x, -min x)|: the
same value as |x|.amax(), +0 for zeros, without a copy of |x|; NaN propagates (torch.amax / amin / maximum do,
unlike CUDA's fmaxf).
"""
from __future__ import annotations

import torch


def div(x: torch.Tensor, c: float) -> torch.Tensor:
    """x / c as a true division in x's dtype, on any device."""
    return x / torch.full((), c, dtype=x.dtype, device=x.device)


def abs_amax(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """max |x| over `dim` (all of x when None)."""
    if dim is None:
        lo, hi = torch.aminmax(x)
    else:
        lo, hi = x.amin(dim=dim, keepdim=keepdim), x.amax(dim=dim, keepdim=keepdim)
    return torch.maximum(hi, lo.neg()).abs()  # abs of the reduced values only: -0 (an all-zero block) -> +0
