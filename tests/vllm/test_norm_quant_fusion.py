"""cublade's fusion pass (cublade.vllm.fusion) on the CPU: which traced RMSNorm / SiLU-and-mul + FP8 quantization pairs
it replaces by cublade's fused ops, that the rewritten graph computes the same bytes (the ops' references as their
kernels; for SiLU-and-mul, the bytes of the same MLP compiled by Inductor without the pass), and when `install()` puts
it in vLLM's compile config. The probe runs in its own process (tests/vllm/norm_quant_fusion_probe.py): it defines the
cublade op schemas itself. The fused kernels against their references: tests/ops/test_rms_norm_fp8_quant.py,
tests/ops/test_silu_mul_fp8_quant.py; the pass inside a served model: the fp8 rows of benchmarks/bench_e2e.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("norm_quant_fusion_probe.py")
FUSED_ADD = "cublade.fused_add_rms_norm_fp8_quant.default"
FUSED = "cublade.rms_norm_fp8_quant.default"
FUSED_SILU = "cublade.silu_mul_fp8_quant.default"
SILU_MUL = ["aten.slice.Tensor", "prims.convert_element_type.default", "aten.neg.default", "aten.exp.default",
            "aten.add.Tensor", "aten.div.Tensor", "prims.convert_element_type.default", "aten.slice.Tensor",
            "aten.mul.Tensor"]  # vLLM's native SiluAndMul in the post-grad graph: Inductor's silu, times the up half


@pytest.fixture(scope="module")
def probe() -> dict:
    env = {**os.environ, "CUBLADE_DISABLE_KERNELS": "1"}
    env.pop("CUBLADE_FUSE_NORM_QUANT", None)
    out = subprocess.run([sys.executable, str(PROBE)], capture_output=True, text=True, timeout=600, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("PROBE ")]
    assert out.returncode == 0 and lines, f"probe failed (rc {out.returncode}):\n{out.stderr[-4000:]}"
    return json.loads(lines[-1][len("PROBE "):])


def test_a_decoder_layers_two_norms_are_fused(probe):
    """fused_add_rms_norm + per-token quant, then rms_norm + static per-tensor quant, each with its own epsilon."""
    r = probe["decoder"]
    assert r["before"] == ["vllm_ir.fused_add_rms_norm.default", "cublade.fp8_quant_per_token.default",
                           "vllm_ir.rms_norm.default", "cublade.fp8_quant_per_tensor.default"]
    assert r["after"] == [FUSED_ADD, FUSED] and r["matched"] == 2
    assert r["outputs_equal"]


@pytest.mark.parametrize("case, fused", [("plain_dynamic_fp16", FUSED), ("residual_static", FUSED_ADD)])
def test_the_other_forms_are_fused(probe, case, fused):
    r = probe[case]
    assert r["after"] == [fused] and r["matched"] == 1 and r["outputs_equal"]


@pytest.mark.parametrize("case", ["other_epsilon", "norm_used_twice", "odd_width"])
def test_pairs_the_fused_op_cannot_replace_are_left_alone(probe, case):
    r = probe[case]
    assert r["matched"] == 0 and r["after"] == r["before"] and r["outputs_equal"]


@pytest.mark.parametrize("case, quant", [("mlp_dynamic", "cublade.fp8_quant_per_token.default"),
                                         ("mlp_static_fp16", "cublade.fp8_quant_per_tensor.default"),
                                         ("mlp_dynamic_3d", "cublade.fp8_quant_per_token.default")])
def test_a_gated_mlps_activation_and_quantization_are_fused(probe, case, quant):
    """SiLU-and-mul as the post-grad graph holds it, then cublade's per-token or static per-tensor quantization."""
    r = probe[case]
    assert r["before"] == SILU_MUL + [quant]
    assert r["after"] == [FUSED_SILU] and r["matched"] == 1 and r["outputs_equal"]


@pytest.mark.parametrize("case", ["inductor_mlp_dynamic", "inductor_mlp_static"])
def test_inductor_compiles_the_fused_op_to_the_unfused_programs_bytes(probe, case):
    """Inside Inductor's own compile (CPU backend) the pass finds the pair in the real post-grad graph, and the
    program with the fused op gives the bytes of the program Inductor compiles without the pass."""
    r = probe[case]
    assert r["matched"] == 1 and r["outputs_equal"]


def test_the_fused_activation_rounds_as_inductor_does_not_as_eager(probe):
    """Inductor drops the silu's own rounding to bf16 where it fuses it with the multiply; the fused op's reference
    rounds once too, so its bytes are the compiled program's and not those of the ops run eagerly."""
    assert probe["inductor_mlp_dynamic"]["outputs_equal"] and not probe["inductor_mlp_dynamic"]["eager_equal"]


@pytest.mark.parametrize("case", ["silu_odd_width", "silu_fp32", "silu_used_twice", "quant_of_other", "other_split",
                                  "silu_dynamic_per_tensor"])
def test_silu_mul_pairs_the_fused_op_cannot_replace_are_left_alone(probe, case):
    r = probe[case]
    assert r["matched"] == 0 and r["after"] == r["before"] and r["outputs_equal"]
    assert FUSED_SILU not in r["after"]


def test_install_under_vllm_compile_only(probe):
    inst = probe["install"]
    ok, held, additional = inst["compile"]
    assert ok and held == "NormQuantFusionPass"
    assert additional == {"cublade_kernels": ["rms_norm_fp8_quant-fusion",  # part of vLLM's compile-cache key
                                              "silu_mul_fp8_quant-fusion"]}
    assert inst["eager"][:2] == [False, "NoneType"]
    assert inst["switched_off"][:2] == [False, "NoneType"]
    assert inst["no_config"] is False


def test_a_pass_already_in_the_slot_is_kept_and_named(probe):
    inst = probe["install"]
    assert inst["slot_taken"][:2] == [False, "OtherPass"]
    assert any("already holds" in m and "fusion is off" in m for m in inst["messages"])


def test_vllm_may_copy_the_pass_and_cache_by_its_uuid(probe):
    assert probe["deepcopy_is_self"]
    assert len(probe["uuid"]) == 64
