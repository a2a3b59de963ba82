"""The bundled model converted per preset for the GPU tests: the dense presets through the `converted`
fixture (fp8-static calibrated on the first 10 stories), fp4-experts-fp8-dense from the Mixtral fixture that
examples/make_moe_fixture.py builds from the bundled model."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def moe_fp4_checkpoint(workdir: Path) -> Path:
    src, out = workdir / "moe", workdir / "moe-fp4"
    for cmd in ([str(REPO / "examples" / "make_moe_fixture.py"), str(src)],
                ["-m", "cublade.cli", "convert", str(src), str(out), "--scheme", "fp4-experts-fp8-dense"]):
        subprocess.run([sys.executable, *cmd], check=True, capture_output=True)
    return out


def preset_model(name: str, padded_model_dir: Path, converted, valid_text: Path, workdir: Path) -> Path:
    """`name`: "bf16" (the bundled model itself) or a preset."""
    if name == "bf16":
        return padded_model_dir
    if name == "fp4-experts-fp8-dense":
        return moe_fp4_checkpoint(workdir)
    if name == "fp8-static":
        return converted(name, calib_text=valid_text, calib_lines=slice(0, 10))
    return converted(name)
