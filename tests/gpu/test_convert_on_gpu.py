"""`cublade convert --quant-device cuda` against the CPU: every quantized tensor of every scheme the same bytes,
on the bundled model (its untied copy with the lm_head quantized too) and the MoE fixture (FP4 experts, both
formats). The quantization functions are plain torch ops (cublade.numerics), so a difference would come from an op
that rounds differently on the GPU."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from preset_models import REPO

from cublade.checkpoint import load_all

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (--quant-device cuda)")

DEVICES = ("cpu", "cuda")
CASES = {  # name -> (source fixture, convert arguments)
    "fp8-dynamic": ("padded", ["--scheme", "fp8-dynamic"]),
    "fp8-per-tensor": ("padded", ["--scheme", "fp8-dynamic", "--weight-strategy", "tensor"]),
    "w4a16": ("padded", ["--scheme", "w4a16"]),
    "w4a16-asym-g32": ("padded", ["--scheme", "w4a16", "--group-size", "32", "--asymmetric"]),
    "w4a16-channel": ("padded", ["--scheme", "w4a16", "--group-size", "-1"]),
    "mxfp8": ("padded", ["--scheme", "mxfp8"]),
    "mxfp8-floor": ("padded", ["--scheme", "mxfp8", "--scale-rule", "floor"]),
    "w4a16-lm-head": ("untied", ["--scheme", "w4a16", "--quantize-lm-head"]),
    "fp4-experts-mxfp4": ("moe", ["--scheme", "fp4-experts-fp8-dense"]),
    "fp4-experts-nvfp4": ("moe", ["--scheme", "fp4-experts-fp8-dense", "--fp4-format", "nvfp4"]),
}


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "src"
    subprocess.run([sys.executable, str(REPO / "examples" / "make_moe_fixture.py"), str(out)], check=True,
                   capture_output=True)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_quantization_writes_the_cpu_bytes(name, tmp_path, padded_model_dir, untied_model_dir, moe_source):
    src = {"padded": padded_model_dir, "untied": untied_model_dir, "moe": moe_source}[CASES[name][0]]
    outs = []
    for device in DEVICES:
        outs.append(tmp_path / f"on-{device}-{len(outs)}")
        r = subprocess.run([sys.executable, "-m", "cublade.cli", "convert", str(src), str(outs[-1]),
                            *CASES[name][1], "--quant-device", device], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    cpu, gpu = map(load_all, outs)
    assert cpu.keys() == gpu.keys()
    differ = [k for k in cpu if cpu[k].dtype != gpu[k].dtype or not torch.equal(cpu[k].view(torch.uint8),
                                                                                 gpu[k].view(torch.uint8))]
    assert not differ, f"{name}: {len(differ)} of {len(cpu)} tensors differ, e.g. {differ[:3]}"
