"""The import tiers: the checkpoint format (cublade.config) and the format math (cublade.numerics) import no op
module and load no extension, so `cublade presets`, the policy and the converter's planning never touch CUDA. Each
check runs in a fresh interpreter (this one has long imported everything)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import importlib, json, pkgutil, sys
{imports}
print(json.dumps(sorted(m for m in sys.modules if m in ("cublade._C", "cublade.ops") or m.startswith("cublade.ops."))))
"""


def every_module(package: str) -> str:
    return (f"import {package}\n"
            f"for m in pkgutil.iter_modules({package}.__path__): importlib.import_module('{package}.' + m.name)")


def loaded_ops(imports: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("imports", ["import cublade.config", every_module("cublade.config"),
                                     every_module("cublade.numerics"),
                                     "import cublade.cli; cublade.cli.main(['presets'])"],
                         ids=["config", "config-all", "numerics-all", "cli-presets"])
def test_format_tiers_load_no_op_and_no_extension(imports):
    assert loaded_ops(imports) == []


def test_the_probe_sees_the_ops():
    assert "cublade.ops._dispatch" in loaded_ops("import cublade.ops")


def test_vllm_layer_methods_do_not_import_the_vllm_config():
    """Data flows config -> method: CubladeConfig hands each layer method its scheme, the methods import nothing of
    cublade.vllm.config."""
    pytest.importorskip("vllm.model_executor", reason="vLLM is not installed")
    code = ("import json, sys, cublade.vllm.linear, cublade.vllm.moe, cublade.vllm.kv_cache\n"
            "print(json.dumps('cublade.vllm.config' in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) is False
