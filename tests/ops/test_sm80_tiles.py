"""The sm_80 kernel's tiles-per-CTA rule (`sm80_tiles_per_cta`, plugin/csrc/sm80/lowbit_gemm_sm80.h) on the shapes it
was measured on (bench_sm80.py --tiles-sweep, an H200 through the compute_80 PTX), compiled with nvcc and run on the
host (no GPU needed, so CI checks it): a rule edit that moves one of these picks must come with new measurements
(docs/decisions.md, "Tiles per CTA of the sm_80 kernel"; the cases below, and the misses it names)."""
from __future__ import annotations

import host_driver
import pytest

SMS = 132  # the H200
# (name, N, the most tiles two stages fit, the tiles the sweep found fastest or within 2% of it)
CASES = [
    ("int4 4096x14336, 1-48 rows", 14336, 4, 4),
    ("int4 8192x28672, 8-48 rows", 28672, 4, 4),
    ("fp8 / mxfp8 4096x14336, 1-8 rows", 14336, 4, 4),
    ("fp8 / mxfp8 4096x14336 from 16 rows (two stages of 4 tiles do not fit)", 14336, 2, 2),
    ("fp8 / mxfp8 8192x28672 from 16 rows", 28672, 2, 2),
    ("fp8 / mxfp8 14336x4096, every row count", 4096, 4, 1),
    ("int4 14336x4096, 1-8 rows", 4096, 4, 1),
]


@pytest.fixture(scope="module")
def tiles_per_cta(tmp_path_factory):
    exe = host_driver.build(tmp_path_factory, "sm80_tiles")
    return lambda cases: host_driver.run(exe, [v for _, N, fits, _ in cases for v in (N, fits, SMS)])


def test_tiles_per_cta_on_measured_shapes(tiles_per_cta):
    got = tiles_per_cta(CASES)
    wrong = [f"{name}: {g} tiles, the measured choice is {want}" for (name, *_, want), g in zip(CASES, got) if g != want]
    assert not wrong, "; ".join(wrong)


def test_tiles_per_cta_never_exceeds_what_fits(tiles_per_cta):
    cases = [(f"N={N}, fits {fits}", N, fits, None) for N in (16, 4096, 1 << 20) for fits in (1, 2, 4)]
    got = tiles_per_cta(cases)
    assert all(1 <= g <= fits for (_, _, fits, _), g in zip(cases, got)), got
