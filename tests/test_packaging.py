"""The wheel carries what a first-use build needs: every source of the CUDA extension under cublade/csrc (the
package data cublade.extension compiles from), and the doctor's op list (bindings.cpp)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_ships_the_extension_sources(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(REPO / "plugin", src / "plugin", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for f in ("setup.py", "MANIFEST.in", "README.md"):
        shutil.copy2(REPO / f, src / f)
    env = dict(os.environ, CUBLADE_BUILD_EXT="0")  # the pure-Python wheel: what `pip install .` gives
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path / "dist"), str(src)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    (whl,) = (tmp_path / "dist").glob("cublade-*.whl")
    shipped = {n.removeprefix("cublade/csrc/") for n in zipfile.ZipFile(whl).namelist()
               if n.startswith("cublade/csrc/")}
    csrc = REPO / "plugin" / "csrc"
    sources = {p.relative_to(csrc).as_posix() for p in csrc.rglob("*") if p.suffix in (".cu", ".cuh", ".cpp", ".h")}
    assert any(s.startswith("sm80/") for s in sources)  # cublade._C_sm80's sources ship too
    assert sources and shipped == sources
