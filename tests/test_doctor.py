"""`cublade doctor` on a CPU machine: every section with this machine's facts; the extension's states through
mocks (built into the cache, cannot be built)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

import cublade.ops
from cublade import doctor
from cublade.config import PRESETS, preset
from cublade import extension
from cublade.ops import _dispatch

REPO = Path(__file__).resolve().parents[1]


def test_doctor_prints_versions_gpu_extension_ops_and_kernels():
    r = subprocess.run([sys.executable, "-m", "cublade.cli", "doctor"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for section in ("versions", "GPU", "CUDA extension", "ops", "kernel per scheme on CPU"):
        assert f"\n{section}" in "\n" + out, section
    assert f"torch    {torch.__version__}" in out and "vLLM" in out and "Python" in out
    assert "GPU  none" in out and re.search(r"\n  extension +not installed", out)
    assert re.search(r"\n  sm_80 kernels +cublade._C_sm80 not installed", out)
    for op in ("fp8_quant_per_token", "w4a16_gemm", "mxfp8_gemm", "fp4_gemm", "silu_mul"):
        assert f"  {op} " in out and "PyTorch reference (no GPU)" in out
    rows = [line for line in out.splitlines() if " linear " in line or " MoE experts " in line]
    schemes = {s.describe() for name in PRESETS for _, s in preset(name).schemes}
    assert len(rows) == len(schemes) and all(any(s in row for row in rows) for s in schemes)
    assert all("  reference: " in row for row in rows)  # no GPU: the reference kernel, the others passed over
    assert ("cublade-w4a16-fp8-prefill: runs when asked for (CUBLADE_W4A16_PREFILL=fp8); cublade-w4a16-measured: runs "
            "when asked for (CUBLADE_W4A16_PREFILL=machete, humming or machete,humming); cublade-w4a16-gemm: CPU") in out


def test_op_names_are_the_extensions_schemas():
    names = doctor.op_names()
    assert len(names) == len(set(names)) >= 13 and "mxfp8_dequant_packed" in names


def test_extension_built_into_the_cache_is_reported_as_such(monkeypatch, tmp_path):
    monkeypatch.setenv("CUBLADE_EXT_CACHE", str(tmp_path))
    monkeypatch.setattr(_dispatch, "_LOADED", True)
    monkeypatch.setattr(_dispatch, "_LOADED_FROM", str(tmp_path / "key" / "_C.so"))
    monkeypatch.setattr(_dispatch, "_SM80_FROM", str(tmp_path / "_C_sm80.so"))
    row, sm80 = doctor.extension()
    assert row == ("extension", f"loaded, built on first use into the cache: {tmp_path / 'key' / '_C.so'}")
    assert sm80 == ("sm_80 kernels", f"loaded: {tmp_path / '_C_sm80.so'}")


def test_extension_that_cannot_be_built_is_reported_with_the_fix(monkeypatch):
    monkeypatch.setattr(extension, "kernels_target_this_gpu", lambda: True)
    monkeypatch.setattr(extension, "_toolchain_problem", lambda: "nvcc not found")
    monkeypatch.setenv("CUBLADE_EXT_CACHE", "/nonexistent/cache")
    monkeypatch.delenv("CUBLADE_DISABLE_KERNELS", raising=False)
    monkeypatch.setitem(sys.modules, "cublade._C", None)
    monkeypatch.delitem(sys.modules, "cublade.ops._dispatch")  # imported afresh: the load runs again
    monkeypatch.delattr(cublade.ops, "_dispatch")
    (row,) = doctor.extension()
    assert row[1].startswith("missing: cublade: this GPU (sm_90) runs cublade's CUDA kernels") and "Fix:" in row[1]
