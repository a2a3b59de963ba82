"""The w4a16 and MXFP8 ops' choices per call (plugin/csrc/gemm_plan.cuh and w4a16_gemm.h's prefill switches) on the
shapes they were measured on, compiled with nvcc and run on the host (no GPU needed, so CI checks them): a rule edit
that moves one of these choices must come with new measurements (docs/decisions.md: "From 17 rows, and 9-16 rows on
large weights", "Tokens per pass", "Four warpgroups", "Stream-K", "Prefill switch", "Rounded passes"). int4 at group
size 128 (W4A16: the weights exact, as fp16 x or prefill=False run; W4A16_ROUNDED: bf16 x), 132 SMs (the H200). Each call's plan reads: the wide kernel's passes as TOKENSwWARPGROUPS:SCHEDULE (sk: stream-K, else K
splits), then "s:SPLITS" (int4) or "s" (MXFP8) for rows left to the streaming kernel, or "prefill" (dequantize +
cuBLAS)."""
from __future__ import annotations

import host_driver
import pytest

SMS = 132
# (what the measurements chose, M, K, N, the plan)
W4A16 = [
    ("8 rows stay on the streaming kernel", 8, 8192, 28672, "s:1"),
    ("9-16 rows: one 16-token wide pass on weights of 96 Mi elements or more (Llama-3-8B's gate_up)", 12, 4096, 28672,
     "16w4:1"),
    ("9-16 rows on smaller weights: the streaming kernel", 12, 4096, 14336, "s:1"),
    ("from 17 rows the wide kernel; 4 warpgroups at 32 tokens where their CTAs fill 3/4 of the SMs", 17, 8192, 28672,
     "32w4:1"),
    ("2 warpgroups from 48 tokens, stream-K on 8192x28672", 64, 8192, 28672, "64w2:sk"),
    ("one pass of 128 tokens, stream-K", 128, 8192, 28672, "128w2:sk"),
    ("passes of 128 rows from 129", 256, 8192, 28672, "128w2:sk 128w2:sk"),
    ("stream-K on 8192x10240", 128, 8192, 10240, "128w2:sk"),
    ("split-K kept on 4096x14336 (one split)", 128, 4096, 14336, "128w2:1"),
    ("split-K kept on 28672x8192 (two splits)", 128, 28672, 8192, "128w2:2"),
    ("a last pass of 44 rows runs 48 tokens", 300, 4096, 14336, "128w2:1 128w2:1 48w2:1"),
    ("a last 12 rows: a 16-token wide pass on large weights", 140, 8192, 28672, "128w2:sk 16w4:1"),
    ("the prefill path from 448 rows", 448, 4096, 4096, "prefill"),
    ("447 rows still on the wide kernel", 447, 4096, 4096, "128w2:sk 128w2:sk 128w2:sk 64w2:sk"),
    ("from 640 rows on weights of 2^27 elements or more", 640, 8192, 28672, "prefill"),
    ("639 rows there still on the wide kernel", 639, 8192, 28672, " ".join(["128w2:sk"] * 5)),
]
W4A16_ROUNDED = [
    ("159 rows: the exact passes", 159, 8192, 28672, "128w2:sk 32w4:1"),
    ("from 160 rows one rounded pass of 192 tokens, stream-K on 8192x28672", 160, 8192, 28672, "192w2:sk"),
    ("192 rows: one pass of 192 tokens", 192, 8192, 28672, "192w2:sk"),
    ("two K splits on 28672x8192 at 192 tokens", 160, 28672, 8192, "192w2:2"),
    ("stream-K on 4096x14336 at 192 tokens", 192, 4096, 14336, "192w2:sk"),
    ("from 193 rows 256 tokens", 193, 8192, 28672, "256w2:sk"),
    ("448 rows: 256, then 192 rounded", 448, 8192, 28672, "256w2:sk 192w2:sk"),
    ("256 rows in one rounded pass", 256, 8192, 28672, "256w2:sk"),
    ("stream-K on 4096x14336", 256, 4096, 14336, "256w2:sk"),
    ("two K splits on 28672x8192", 256, 28672, 8192, "256w2:2"),
    ("stream-K on 8192x10240", 256, 8192, 10240, "256w2:sk"),
    ("a rounded pass of 256, then 128 rows exact", 384, 8192, 28672, "256w2:sk 128w2:sk"),
    ("639 rows: two rounded passes, then 127 rows exact", 639, 8192, 28672, "256w2:sk 256w2:sk 128w2:sk"),
    ("1023 rows on weights of 2^27 elements or more: still the rounded passes", 1023, 8192, 28672,
     " ".join(["256w2:sk"] * 4)),
    ("the prefill path from 1024 rows there", 1024, 8192, 28672, "prefill"),
    ("1023 rows on 8192x10240 (2^26 to 2^27 elements): the rounded passes", 1023, 8192, 10240,
     " ".join(["256w2:sk"] * 4)),
    ("the prefill path from 1024 rows there", 1024, 8192, 10240, "prefill"),
    ("639 rows on 4096x14336 (2^25 to 2^26 elements): the rounded passes", 639, 4096, 14336,
     "256w2:sk 256w2:sk 128w2:1"),
    ("the prefill path from 640 rows there", 640, 4096, 14336, "prefill"),
    ("256 rows on Llama-3-8B's o (under 2^25 elements): one rounded pass", 256, 4096, 4096, "256w2:sk"),
    ("the prefill path from 257 rows there, where a second pass would start", 257, 4096, 4096, "prefill"),
]
MXFP8 = [
    ("1-16 rows on the streaming kernel", 16, 8192, 28672, "s"),
    ("from 17 rows the wide kernel, 2 warpgroups, stream-K on 8192x28672", 17, 8192, 28672, "32w2:sk"),
    ("passes of 128 up to 191 rows", 191, 8192, 28672, "128w2:sk 64w2:sk"),
    ("from 192 rows passes of 256 tokens (quarter-chunk stages), stream-K on 8192x28672", 192, 8192, 28672,
     "256w2:sk"),
    ("256 rows in one pass", 256, 8192, 28672, "256w2:sk"),
    ("two K splits on 28672x8192 at 256 tokens", 256, 28672, 8192, "256w2:2"),
    ("stream-K on 8192x10240", 128, 8192, 10240, "128w2:sk"),
    ("split-K kept on 4096x14336", 128, 4096, 14336, "128w2:1"),
    ("split-K kept on 28672x8192 (two splits)", 128, 28672, 8192, "128w2:2"),
    ("383 rows on the wide kernel: 256, then 127", 383, 4096, 14336, "256w2:sk 128w2:1"),
    ("256 rows on Llama-3-8B's o (under 2^25 elements): one pass", 256, 4096, 4096, "256w2:sk"),
    ("the prefill path from 257 rows there (int4's rounded tiers)", 257, 4096, 4096, "prefill"),
    ("639 rows on 4096x14336 (2^25 to 2^26 elements): passes of 256", 639, 4096, 14336, "256w2:sk 256w2:sk 128w2:1"),
    ("the prefill path from 640 rows there", 640, 4096, 14336, "prefill"),
    ("1023 rows on 8192x28672 (2^26 elements or more): four passes", 1023, 8192, 28672,
     "256w2:sk 256w2:sk 256w2:sk 256w2:sk"),
    ("the prefill path from 1024 rows there", 1024, 8192, 28672, "prefill"),
]

# FP4 experts (fp4_gemm.cu's rule, docs/decisions.md "FP4 tokens per pass"): the plan's K and N places hold the
# experts here and the experts the rows were routed over (0: the same); M rows = tokens x top-2; Mixtral's 8 experts
FP4 = [
    ("32 tokens: 8 rows an expert, the streaming kernel", 64, 8, 0, "s"),
    ("64 tokens: 16 rows an expert, wide passes of 32 tokens", 128, 8, 0, "32w"),
    ("128 tokens: 48", 256, 8, 0, "48w"),
    ("256 tokens: 96", 512, 8, 0, "96w"),
    ("4096 tokens: 128", 8192, 8, 0, "128w"),
    ("expert parallel, 4 of the 8 experts here, 64 tokens: 16 rows an expert, 32", 128, 4, 8, "32w"),
    ("the same rows counted over this rank's 4 experts would read 32 an expert (48)", 128, 4, 0, "48w"),
    ("expert parallel, 32 tokens: 8 rows an expert, the streaming kernel", 64, 4, 8, "s"),
]


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    exe = host_driver.build(tmp_path_factory, "gemm_plan", ("-gencode=arch=compute_90a,code=sm_90a",))
    return lambda fmt, cases: host_driver.lines(exe, [v for _, M, K, N, _ in cases for v in (fmt, M, K, N, SMS)])

@pytest.mark.parametrize("fmt,cases", [(0, W4A16), (2, W4A16_ROUNDED), (1, MXFP8), (3, FP4)],
                         ids=["w4a16", "w4a16-rounded", "mxfp8", "fp4-experts"])
def test_plan_on_measured_shapes(plan, fmt, cases):
    got = plan(fmt, cases)
    wrong = [f"{name} (M={M}, {K}, {N}): {g!r}, the measured choice is {want!r}"
             for (name, M, K, N, want), g in zip(cases, got) if g != want]
    assert not wrong, "; ".join(wrong)
