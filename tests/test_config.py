"""Schemes, policies, presets and the quantization_config format: validation, resolution, round trips."""
import copy
import pickle

import pytest

from cublade.config import (FORMAT_VERSION, PRESETS, FP4Scheme, Fp8Scheme, MXFP8Scheme, W4A16Scheme,
                            parse_quantization_config, preset, scheme_from_dict, to_quantization_config)
from cublade.config.schemes import UnsupportedShape


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_round_trips_through_quantization_config(name):
    policy = preset(name)
    qc = to_quantization_config(policy)
    assert qc["quant_method"] == "cublade" and qc["format_version"] == FORMAT_VERSION
    back = parse_quantization_config(copy.deepcopy(qc))
    assert back == policy
    assert pickle.loads(pickle.dumps(back)) == policy  # vLLM sends the config to the engine process


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError) as e:
        preset("fp9")
    for name in PRESETS:
        assert name in str(e.value)


def test_preset_overrides_and_bad_override():
    assert preset("w4a16", group_size=64, symmetric=False).scheme_map["w4a16"] == W4A16Scheme(64, False)
    assert preset("mxfp8", scale_rule="floor").scheme_map["mxfp8"] == MXFP8Scheme("floor")
    assert preset("fp4-experts-fp8-dense", format="nvfp4").scheme_map["fp4"].format == "nvfp4"
    with pytest.raises(ValueError, match="group_size"):
        preset("fp8-dynamic", group_size=64)


@pytest.mark.parametrize("bad", [lambda: W4A16Scheme(group_size=100), lambda: Fp8Scheme(activations="static"),
                                 lambda: MXFP8Scheme(scale_rule="ceil"), lambda: FP4Scheme(format="fp4")])
def test_scheme_fields_are_checked(bad):
    with pytest.raises(ValueError):
        bad()


def test_policy_resolution_ignores_embeddings_head_and_router():
    p = preset("fp4-experts-fp8-dense")
    assert p.scheme_for("model.embed_tokens") is None
    assert p.scheme_for("lm_head") is None
    assert p.scheme_for("model.layers.0.block_sparse_moe.gate") is None  # Mixtral router
    assert p.scheme_for("model.layers.0.mlp.gate_proj").kind == "fp8"  # not the router
    assert p.scheme_for("model.layers.0.block_sparse_moe.experts.3.w1").kind == "fp4"
    assert p.scheme_for("model.layers.0.mlp.experts.gate_up_proj").kind == "fp4"
    assert p.scheme_for("model.layers.0.self_attn.q_proj").kind == "fp8"


@pytest.mark.parametrize("field,value,match", [
    ("format_version", FORMAT_VERSION + 1, "newer cublade"),
    ("format_version", "1", "integer"),
    ("quant_method", "fp8", "quant_method"),
])
def test_bad_quantization_config_fields_are_named(field, value, match):
    qc = to_quantization_config(preset("fp8-dynamic"))
    qc[field] = value
    with pytest.raises(ValueError, match=match):
        parse_quantization_config(qc)


def test_unknown_scheme_kind_and_field_are_named():
    qc = to_quantization_config(preset("fp8-dynamic"))
    qc["schemes"]["fp8"]["kind"] = "int3"
    with pytest.raises(ValueError, match="unknown scheme kind 'int3'"):
        parse_quantization_config(qc)
    with pytest.raises(ValueError, match="unknown field.*bits"):
        scheme_from_dict({"kind": "w4a16", "bits": 3})
    qc = to_quantization_config(preset("fp8-dynamic"))
    qc["rules"][0]["scheme"] = "nope"
    with pytest.raises(ValueError, match="names scheme 'nope'"):
        parse_quantization_config(qc)


@pytest.mark.parametrize("scheme,N,K,why", [
    (Fp8Scheme(), 172, 64, "out_features=172 is not a multiple of 16"),
    (W4A16Scheme(128), 64, 64, "in_features=64 is not a multiple of group_size=128"),
    (MXFP8Scheme(), 64, 172, "not a multiple of the MX block size 32"),
    (FP4Scheme("nvfp4"), 64, 40, "nvfp4 block size 16"),
])
def test_unsupported_shapes_say_why(scheme, N, K, why):
    with pytest.raises(UnsupportedShape, match=why) as e:
        scheme.check_shape("model.layers.0.mlp.up_proj", N, K)
    assert f"not supported by scheme {scheme.kind} because" in str(e.value)
    assert "model.layers.0.mlp.up_proj" in str(e.value)


def test_kv_cache_rounding_round_trips_and_defaults_to_nearest():
    from cublade.config import KVCacheScheme, Policy

    qa = preset("fp8-dynamic", kv_cache="fp8", kv_rounding="query-aware")
    assert qa.kv_cache == KVCacheScheme("fp8", "query-aware")
    assert Policy.from_dict(qa.to_dict()) == qa
    assert preset("fp8-dynamic", kv_cache="fp8").kv_cache.rounding == "nearest"
    old = preset("fp8-dynamic", kv_cache="fp8").to_dict()
    old["kv_cache"] = {"dtype": "fp8"}  # written before the field existed
    assert Policy.from_dict(old).kv_cache.rounding == "nearest"
    with pytest.raises(ValueError, match="rounding='stochastic' is not one of 'nearest', 'query-aware'"):
        KVCacheScheme("fp8", "stochastic")
    with pytest.raises(ValueError, match="kv_rounding='query-aware' needs an FP8 KV cache"):
        preset("fp8-dynamic", kv_rounding="query-aware")


def test_calibration_needs_are_reported():
    assert preset("fp8-dynamic").needs_calibration() == []
    assert "static FP8" in preset("fp8-static").needs_calibration()[0]
    assert any("KV" in n for n in preset("fp8-dynamic", kv_cache="fp8").needs_calibration())
