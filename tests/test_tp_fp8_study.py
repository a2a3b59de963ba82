"""scripts/tp_fp8_study.py's simulated layer (the numbers in tests/gpu/test_tensor_parallel_8b_shaped.py come from
it): a row-parallel layer at TP = N adds N bf16-rounded partial sums, a column-parallel one is unchanged, static FP8
uses one scale on every rank and dynamic FP8 a scale per rank's part of K."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def study(script):
    return script(REPO / "scripts" / "tp_fp8_study.py")


def test_row_parallel_adds_bf16_partial_sums(study):
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(64, 256, generator=g), torch.randn(4, 256, generator=g)
    sim = study.SimLinear(w, "bf16", row_parallel=True)
    one = sim(x)
    sim.tp = 2
    halves = [(x[:, s] @ w[:, s].T).to(torch.bfloat16).float() for s in (slice(0, 128), slice(128, None))]
    assert torch.equal(sim(x), (halves[0] + halves[1]).to(torch.bfloat16))
    assert torch.equal(one, (x @ w.T).to(torch.bfloat16))
    assert not torch.equal(sim(x), one)  # the partial sums' rounding: what TP changes
    column = study.SimLinear(w, "bf16", row_parallel=False)
    ref = column(x)
    column.tp = 4
    assert torch.equal(column(x), ref)


def test_fp8_scales_per_rank(study):
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(64, 256, generator=g), torch.randn(4, 256, generator=g)
    x[:, :128] *= 8  # one rank's part of K much larger than the other's
    static = study.SimLinear(w, "fp8-static", row_parallel=True)
    static.calibrating = True
    static(x)
    static.calibrating = False
    q = static.quant(x)
    assert torch.equal(static.quant(x[:, 128:]), q[:, 128:])  # one scale, whatever the rank holds
    dynamic = study.SimLinear(w, "fp8-dynamic", row_parallel=True)
    assert not torch.equal(dynamic.quant(x[:, 128:]), dynamic.quant(x)[:, 128:])  # a rank's own per-token scale
