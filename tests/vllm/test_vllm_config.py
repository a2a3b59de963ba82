"""Registration with vLLM and the `cublade` QuantizationConfig: discovery through the entry point, parsing and
its errors, how vLLM picks the method for a checkpoint, pickling, layer -> method mapping."""
from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from cublade.config import Fp8Scheme, W4A16Scheme, preset, to_quantization_config

DISCOVERY = textwrap.dedent("""
    import json, logging, sys
    import cublade.vllm
    light = "vllm" not in sys.modules          # importing the plugin module pulls in no vLLM
    import vllm                                  # configures logging (resets handlers of vllm.* loggers)
    records = []
    class Keep(logging.Handler):
        def emit(self, r): records.append(r.getMessage())
    logging.getLogger("vllm.cublade").addHandler(Keep())
    from vllm.plugins import load_general_plugins
    load_general_plugins()                       # vLLM's own discovery: the vllm.general_plugins entry point
    load_general_plugins()
    cublade.vllm.register()                      # and a direct second call
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    print(json.dumps({"light": light, "cls": get_quantization_config("cublade").__qualname__,
                      "listed": QUANTIZATION_METHODS.count("cublade"),
                      "custom": AttentionBackendEnum.CUSTOM.get_path(),
                      "logs": [m for m in records if "registered" in m]}))
""")


def test_entry_point_discovery_is_light_idempotent_and_logged():
    out = subprocess.run([sys.executable, "-c", DISCOVERY], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["light"] is True
    assert got["cls"] == "CubladeConfig"
    assert got["listed"] == 1
    assert got["custom"] == "cublade.vllm.kv_cache.CubladeFlashAttentionBackend"
    assert len(got["logs"]) == 1 and "registered quantization method 'cublade'" in got["logs"][0]


def config(policy_or_qc):
    from cublade.vllm.config import CubladeConfig

    qc = policy_or_qc if isinstance(policy_or_qc, dict) else to_quantization_config(policy_or_qc)
    return CubladeConfig.from_config(qc)


def test_from_config_reads_the_policy(vllm_dist):
    cfg = config(preset("w4a16", group_size=64, symmetric=False, kv_cache="fp8"))
    assert cfg.get_name() == "cublade"
    assert cfg.policy.scheme_for("model.layers.3.mlp.down_proj") == W4A16Scheme(64, False)
    assert cfg.policy.scheme_for("lm_head") is None
    assert cfg.kv_cache_scheme["type"] == "float" and cfg.kv_cache_scheme["num_bits"] == 8
    assert config(preset("fp8-dynamic")).kv_cache_scheme is None


@pytest.mark.parametrize("edit,match", [
    (lambda qc: qc.update(format_version=2), r"format_version=2 was written by a newer cublade"),
    (lambda qc: qc["schemes"]["fp8"].update(kind="fp6"), r"unknown scheme kind 'fp6'"),
    (lambda qc: qc["schemes"]["fp8"].update(activations="dynamic-block"), r"fp8: activations='dynamic-block'"),
    (lambda qc: qc.pop("schemes"), r"missing field 'schemes'"),
    (lambda qc: qc.update(quant_method="gptq"), r"quant_method='gptq'"),
])
def test_bad_quantization_config_is_refused_naming_the_field(vllm_dist, edit, match):
    qc = to_quantization_config(preset("fp8-dynamic"))
    edit(qc)
    with pytest.raises(ValueError, match=match):
        config(qc)


def test_config_pickles(vllm_dist):
    cfg = config(preset("fp8-static", kv_cache="fp8"))
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    back = pickle.loads(pickle.dumps(cfg))
    assert back.policy == cfg.policy and back.source == cfg.source
    assert back.packed_modules_mapping == cfg.packed_modules_mapping
    assert back.kv_cache_scheme == cfg.kv_cache_scheme


def test_fused_layer_shards_and_mixed_schemes(vllm_dist):
    from cublade.config import Policy, Rule

    cfg = config(preset("fp8-dynamic"))
    assert cfg.shard_names("model.layers.0.self_attn.qkv_proj") == [
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]
    assert cfg.scheme_for_layer("model.layers.0.mlp.gate_up_proj") == Fp8Scheme()
    mixed = config(Policy(preset="x", schemes=(("a", Fp8Scheme()), ("b", W4A16Scheme())),
                          rules=(Rule(r".*k_proj", "b"), Rule(r".*", "a"))))
    with pytest.raises(ValueError, match=r"fused layer model\.layers\.0\.self_attn\.qkv_proj holds modules with "
                                         r"different schemes .*k_proj: w4a16"):
        mixed.scheme_for_layer("model.layers.0.self_attn.qkv_proj")
    half_ignored = config(preset("fp8-dynamic").with_ignore(r".*\.up_proj"))
    with pytest.raises(ValueError, match=r"up_proj: unquantized"):
        half_ignored.scheme_for_layer("model.layers.0.mlp.gate_up_proj")


# ---- how vLLM picks the method for a checkpoint (ModelConfig._verify_quantization) --------------------

def write_ckpt(tmp_path, qc):
    from ckpt_utils import LLAMA_CONFIG

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "quantization_config": qc}))
    return tmp_path


def model_config(path, **kw):
    from vllm.config import ModelConfig

    return ModelConfig(model=str(path), skip_tokenizer_init=True, **kw)


CT_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
          "config_groups": {"group_0": {
              "targets": ["Linear"],
              "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
              "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                    "dynamic": True}}},
          "kv_cache_scheme": None, "quantization_status": "compressed"}


def test_vllm_selects_cublade_from_the_checkpoint_and_the_flag(vllm_dist, tmp_path):
    ours = write_ckpt(tmp_path / "ours", to_quantization_config(preset("fp8-dynamic")))
    assert model_config(ours).quantization == "cublade"  # no flag
    assert model_config(ours, quantization="cublade").quantization == "cublade"
    ct = write_ckpt(tmp_path / "ct", CT_FP8)
    assert model_config(ct, quantization="cublade").quantization == "cublade"
    assert model_config(ct).quantization == "compressed-tensors"  # without the flag vLLM keeps its own method


def test_other_methods_with_the_flag_get_a_clear_error(vllm_dist, tmp_path):
    gptq = write_ckpt(tmp_path / "gptq", {"quant_method": "gptq", "bits": 4, "group_size": 128})
    with pytest.raises(ValueError, match=r"--quantization cublade: the checkpoint is quantized with 'gptq'"):
        model_config(gptq, quantization="cublade")
    block = json.loads(json.dumps(CT_FP8))
    block["config_groups"]["group_0"]["weights"].update(strategy="block", block_structure=[128, 128])
    ct_block = write_ckpt(tmp_path / "ct_block", block)
    with pytest.raises(ValueError, match=r"not one cublade serves: .*weights\.strategy='block'"):
        model_config(ct_block, quantization="cublade")


def test_get_quant_method_per_layer(vllm_ctx):
    from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from cublade.vllm.linear import CubladeLinearMethod

    cfg = config(preset("mxfp8").with_ignore(r".*\.o_proj"))
    q = ReplicatedLinear(128, 128, bias=False, quant_config=cfg, prefix="model.layers.1.self_attn.o_proj")
    assert isinstance(q.quant_method, UnquantizedLinearMethod)
    r = ReplicatedLinear(128, 64, bias=False, quant_config=cfg, prefix="model.layers.1.mlp.extra")
    assert isinstance(r.quant_method, CubladeLinearMethod)
    assert r.weight_scale.dtype == torch.uint8 and r.weight_scale.shape == (64, 4)
    head = ParallelLMHead(512, 128, quant_config=cfg, prefix="lm_head")
    assert head.weight.dtype == torch.bfloat16
