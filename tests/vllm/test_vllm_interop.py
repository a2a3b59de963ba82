"""compressed-tensors checkpoints served by cublade's methods (`--quantization cublade`): the config translates
to the equivalent cublade Policy, and tensors in compressed-tensors' layout (built here with the
compressed_tensors library's own packing) load into vLLM layers and compute exactly what cublade's reference
computes on the same numbers (torch.equal)."""
from __future__ import annotations

import copy

import pytest
import torch
from vllm_layers import KINDS, load, random_weights, reference

from cublade.config import Fp8Scheme, KVCacheScheme, W4A16Scheme
from cublade.numerics.int4 import unpack_int4

FP8_DYNAMIC = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
    "quantization_status": "compressed", "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None,
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                              "dynamic": True}}}}


def w4a16_config(group_size, symmetric):
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "quantization_status": "compressed", "kv_cache_scheme": None,
            "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": None, "output_activations": None,
                "weights": {"num_bits": 4, "type": "int", "symmetric": symmetric, "dynamic": False,
                            "strategy": "channel" if group_size == -1 else "group",
                            "group_size": None if group_size == -1 else group_size, "actorder": None}}}}


def ct_config(qc):
    from cublade.vllm.config import CubladeConfig

    return CubladeConfig.from_config(qc)


def test_config_translation(vllm_dist):
    cfg = ct_config(FP8_DYNAMIC)
    assert cfg.source == "compressed-tensors"
    assert cfg.policy.scheme_for("model.layers.0.mlp.down_proj") == Fp8Scheme("channel", "dynamic-token")
    assert cfg.policy.scheme_for("lm_head") is None
    assert ct_config(w4a16_config(64, False)).policy.scheme_for("model.layers.0.mlp.up_proj") == W4A16Scheme(64, False)
    assert ct_config(w4a16_config(-1, True)).policy.scheme_for("x.q_proj") == W4A16Scheme(-1, True)
    static = copy.deepcopy(FP8_DYNAMIC)
    static["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    static["config_groups"]["group_0"]["input_activations"].update(strategy="tensor", dynamic=False)
    static["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                 "symmetric": True}
    cfg = ct_config(static)
    assert cfg.policy.scheme_for("a.o_proj") == Fp8Scheme("tensor", "static-tensor")
    assert cfg.policy.kv_cache == KVCacheScheme("fp8") and cfg.kv_cache_scheme is not None


def test_targets_and_ignore_patterns(vllm_dist):
    qc = copy.deepcopy(FP8_DYNAMIC)
    qc["ignore"] = ["lm_head", "re:.*mlp.down_proj$"]
    qc["format"] = "mixed-precision"  # each group says its own format
    qc["config_groups"]["group_0"]["format"] = "float-quantized"
    w4 = w4a16_config(128, True)["config_groups"]["group_0"]
    qc["config_groups"]["group_1"] = {**w4, "format": "pack-quantized", "targets": ["re:.*self_attn\\.o_proj"]}
    policy = ct_config(qc).policy
    assert policy.scheme_for("model.layers.2.mlp.down_proj") is None
    assert policy.scheme_for("model.layers.2.self_attn.o_proj") == W4A16Scheme(128, True)  # specific group wins
    assert policy.scheme_for("model.layers.2.self_attn.q_proj") == Fp8Scheme()


@pytest.mark.parametrize("edit,match", [
    (lambda g: g["weights"].update(strategy="block"), r"weights\.strategy='block'"),
    (lambda g: g.update(input_activations=None), r"input_activations is null \(FP8 weight-only"),
    (lambda g: g["weights"].update(type="int"), r"type='int' num_bits=8 is not a cublade scheme"),
    (lambda g: g["input_activations"].update(strategy="group"), r"strategy='group' dynamic=True"),
    (lambda g: g.update(targets=["Embedding"]), r"targets 'Embedding'"),
])
def test_unsupported_compressed_tensors_configs_are_named(vllm_dist, edit, match):
    qc = copy.deepcopy(FP8_DYNAMIC)
    edit(qc["config_groups"]["group_0"])
    with pytest.raises((ValueError, NotImplementedError), match=match):
        ct_config(qc)


def test_w4a16_group_actorder_is_refused(vllm_dist):
    qc = w4a16_config(128, True)
    qc["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    with pytest.raises(NotImplementedError, match=r"actorder='group'"):
        ct_config(qc)


# ---- tensors in compressed-tensors' layout ------------------------------------------------------------

@pytest.mark.parametrize("kind", list(KINDS.values()), ids=list(KINDS))
def test_fp8_channel_scales_as_compressed_tensors_writes_them(vllm_ctx, kind):
    scheme = Fp8Scheme()
    ours = {m: scheme.quantize(w) for m, w in random_weights(kind).items()}
    # compressed-tensors: weight_scale [N, 1] in the model dtype
    ct = {m: {"weight": t["weight"], "weight_scale": t["weight_scale"].to(torch.bfloat16).reshape(-1, 1)}
          for m, t in ours.items()}
    layer = kind.build(ct_config(FP8_DYNAMIC))
    load(layer, kind, ct)
    layer.quant_method.process_weights_after_loading(layer)
    same = {m: {"weight": t["weight"], "weight_scale": t["weight_scale"].float().reshape(-1)} for m, t in ct.items()}
    x = torch.randn(4, kind.K, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(layer(x)[0], reference(scheme, kind, same, x))


def to_compressed_tensors_w4a16(t: dict[str, torch.Tensor], rows: int, K: int) -> dict[str, torch.Tensor]:
    """cublade's int4 tensors re-packed with compressed_tensors' own pack_to_int32 (signed int8 values)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = unpack_int4(t["weight_packed"]).to(torch.int16) - 8  # signed q in [-8, 7]
    out = {"weight_packed": pack_to_int32(q.to(torch.int8), 4),
           "weight_scale": t["weight_scale"].to(torch.bfloat16),
           "weight_shape": torch.tensor([rows, K])}
    if "weight_zero_point" in t:
        zp = t["weight_zero_point"].to(torch.int16) - 8
        out["weight_zero_point"] = pack_to_int32(zp.to(torch.int8), 4, packed_dim=0)
    return out


@pytest.mark.parametrize("group_size,symmetric", [(128, True), (64, False), (32, False), (-1, False)])
@pytest.mark.parametrize("kind", list(KINDS.values()), ids=list(KINDS))
def test_w4a16_pack_quantized_layout(vllm_ctx, kind, group_size, symmetric):
    scheme = W4A16Scheme(group_size, symmetric)
    ours = {m: scheme.quantize(w) for m, w in random_weights(kind).items()}
    ct = {m: to_compressed_tensors_w4a16(ours[m], rows, kind.K) for _, m, rows in kind.shards}
    for m in ours:  # the weight words are the same in both formats
        assert torch.equal(ct[m]["weight_packed"], ours[m]["weight_packed"])
    layer = kind.build(ct_config(w4a16_config(group_size, symmetric)))
    assert hasattr(layer, "weight_shape")
    load(layer, kind, ct)
    layer.quant_method.process_weights_after_loading(layer)
    assert not hasattr(layer, "weight_shape")
    if not symmetric:  # zero points back in cublade's layout, uint8 [N, groups]
        assert torch.equal(layer.weight_zero_point, torch.cat([ours[m]["weight_zero_point"] for m in ours]))
    x = torch.randn(3, kind.K, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(layer(x)[0], reference(scheme, kind, ours, x))
