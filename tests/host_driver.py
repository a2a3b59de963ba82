"""Host-only drivers of the kernels' launch rules (tests/ops/*_main.cu): compiled with nvcc and run without a GPU, so
CI checks a rule against the shapes it was measured on."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def build(tmp_path_factory, name: str, flags: tuple[str, ...] = ()) -> Path:
    """tests/ops/<name>_main.cu built into a temporary executable; the test skips without nvcc."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("needs nvcc (the CUDA toolkit) to build the host driver")
    exe = tmp_path_factory.mktemp(name) / name
    src = REPO / "tests" / "ops" / f"{name}_main.cu"
    subprocess.run([nvcc, "-std=c++17", "-O1", *flags, f"-I{REPO / 'plugin' / 'csrc'}", str(src), "-o", str(exe)],
                   check=True, capture_output=True)
    return exe


def lines(exe: Path, args: list) -> list[str]:
    """The driver's output lines for these arguments, stripped."""
    out = subprocess.run([str(exe), *map(str, args)], check=True, capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines()]


def run(exe: Path, args: list) -> list[int]:
    """The driver's output for these arguments: one integer per line."""
    return [int(line) for line in lines(exe, args)]
