"""Numerical comparisons shared by the tests."""
from __future__ import annotations

import torch


def rel_err(c: torch.Tensor, ref: torch.Tensor) -> float:
    """mean |c - ref| / mean |ref|, in fp32 (the accuracy measure of the GEMM and layer tests)."""
    return ((c.float() - ref.float()).abs().mean() / ref.float().abs().mean()).item()
