"""The W4A16 streaming kernel's K-split rule (`lowbit::pick_split`, plugin/csrc/w4a16_gemm.cuh) on the shapes it
was measured on, compiled with nvcc and run on the host (no GPU needed, so CI checks it): a rule edit that moves
one of these shapes' splits must come with new measurements. Llama-3-8B's layers from the sweep that allows 4-chunk
splits on small grids (as the int4 op asks up to 16 rows), and Llama-70B-like shapes, whose splits that allowance
leaves unchanged (docs/kernels.md, w4a16_gemm)."""
from __future__ import annotations

import host_driver
import pytest

SMS = 132  # the H200
# (name, K, N, few_ctas_chunks, splits chosen from the measurements; 8B down_proj: 4 won at 1-4 rows, lost at 16):
# tile groups = N / 64, chunks = K / 512
CASES = [
    ("8B o_proj", 4096, 4096, 4, 2), ("8B qkv_proj", 4096, 6144, 4, 2), ("8B down_proj", 14336, 4096, 4, 2),
    ("8B gate_up_proj", 4096, 28672, 4, 1),
    ("8B o_proj, 8-chunk rule (MXFP8, FP4, int4 above 16 rows)", 4096, 4096, 8, 1),
    ("70B 28672x8192", 28672, 8192, 4, 2), ("70B 8192x10240", 8192, 10240, 4, 2),
    ("70B 4096x14336", 4096, 14336, 4, 1), ("70B 8192x28672", 8192, 28672, 4, 1),
    ("70B 28672x8192, 8-chunk rule", 28672, 8192, 8, 2), ("70B 8192x10240, 8-chunk rule", 8192, 10240, 8, 2),
    ("K = 2048 keeps one split (4 chunks)", 2048, 4096, 4, 1),
]


@pytest.fixture(scope="module")
def pick_split(tmp_path_factory):
    exe = host_driver.build(tmp_path_factory, "pick_split", ("-gencode=arch=compute_90a,code=sm_90a",))
    return lambda cases: host_driver.run(exe, [v for _, K, N, few, _ in cases for v in (N // 64, K // 512, SMS, few)])


def test_pick_split_on_measured_shapes(pick_split):
    got = pick_split(CASES)
    wrong = [f"{name}: {g} splits, the measured choice is {want}"
             for (name, *_, want), g in zip(CASES, got) if g != want]
    assert not wrong, "; ".join(wrong)
