"""Numerical comparisons shared by the tests."""
from __future__ import annotations

import torch


def rel_err(c: torch.Tensor, ref: torch.Tensor) -> float:
    """mean |c - ref| / mean |ref|, in fp32 (the accuracy measure of the GEMM and layer tests)."""
    return ((c.float() - ref.float()).abs().mean() / ref.float().abs().mean()).item()


def assert_one_rounding(y: torch.Tensor, ref: torch.Tensor, bar: float = 2e-3) -> None:
    """y (a GEMM's bf16/fp16 output, 2-D) is the fp32 reference `ref` rounded once, up to fp32 summation order:
    |y - ref| <= 2^-8 |ref| (bf16's half ulp) + 1e-4 mean|ref|, and, on 4096 outputs or more, mean|y - ref| /
    mean|ref| <= bar (the final bf16 rounding alone is ~1.4e-3 on this measure)."""
    y = y.float()
    torch.testing.assert_close(y, ref, rtol=2.0 ** -8, atol=1e-4 * ref.abs().mean().item())
    if y.numel() >= 4096:
        err = rel_err(y, ref)
        assert err <= bar, f"mean|C-ref|/mean|ref| = {err:.2e} > {bar}"
