"""`cublade convert --format compressed-tensors`: the bundled model converted in each preset compressed-tensors
can express, against the same conversion in cublade's format.

  * the quantization_config is one the compressed_tensors library validates;
  * every quantized weight, dequantized by the compressed_tensors library's own decompressors (in fp32), equals
    cublade's dequantization of the cublade-format checkpoint, and the codes and scales are the same numbers;
  * cublade's reading of the config (cublade.config.compressed_tensors) gives every module the scheme the
    cublade-format checkpoint gives it, and the same KV cache;
  * schemes compressed-tensors cannot express are refused by name before anything is written.
vLLM's own compressed-tensors method on these checkpoints: tests/vllm/test_vllm_compressed_tensors_output.py.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from cublade.checkpoint import load_all
from cublade.config import preset, read_policy
from cublade.config.compressed_tensors import policy_from_compressed_tensors, unpack_zero_points

# The smallest calibration cublade takes (calibration is what takes the time here).
CALIB = {"calib_lines": slice(0, 1), "calib_tokens": 128}
# (id, preset, scheme overrides, calibrated): every combination the format takes, each once.
CASES = [
    ("fp8-dynamic", "fp8-dynamic", {}, False),
    ("fp8-tensor-dynamic-tensor", "fp8-dynamic", {"weight_strategy": "tensor", "activations": "dynamic-tensor"},
     False),
    ("fp8-static", "fp8-static", {}, True),
    ("fp8-static-tensor-kv", "fp8-static", {"weight_strategy": "tensor", "kv_cache": "fp8"}, True),
    ("w4a16", "w4a16", {}, False),
    ("w4a16-g64", "w4a16", {"group_size": 64}, False),
    ("w4a16-g32-asym", "w4a16", {"group_size": 32, "symmetric": False}, False),
    ("w4a16-channel-asym", "w4a16", {"group_size": -1, "symmetric": False}, False),
    ("w4a16-channel", "w4a16", {"group_size": -1}, False),
    ("w4a16-gptq-asym", "w4a16", {"symmetric": False}, True),
]
CASE_IDS = [c[0] for c in CASES]


_CONVERTED: dict = {}


@pytest.fixture(scope="session")
def both_formats(tmp_path_factory, padded_model_dir, valid_text):
    """case id -> (cublade-format dir, compressed-tensors dir, policy), the bundled model converted once each;
    a calibrated case is calibrated once, both conversions take that result. Shared with the modules that import
    this fixture (tests/vllm), so each case is converted once per test run."""
    import cublade.calib
    from cublade.convert import convert

    cache = _CONVERTED

    def get(case_id: str):
        if case_id not in cache:
            _, name, overrides, calibrated = next(c for c in CASES if c[0] == case_id)
            policy = preset(name, **overrides)
            kw = {"calib_text": valid_text, **CALIB} if calibrated else {}
            root = tmp_path_factory.mktemp(case_id)
            with pytest.MonkeyPatch.context() as mp:
                once = []
                calibrate = cublade.calib.calibrate
                mp.setattr(cublade.calib, "calibrate", lambda *a, **k: once[0] if once else once.append(
                    calibrate(*a, **k)) or once[0])
                cache[case_id] = (convert(padded_model_dir, root / "cublade", policy, **kw),
                                  convert(padded_model_dir, root / "ct", policy, out_format="compressed-tensors",
                                          **kw), policy)
            assert len(once) == int(calibrated)
        return cache[case_id]

    return get


def quantization_config(ckpt: Path) -> dict:
    return json.loads((ckpt / "config.json").read_text())["quantization_config"]


def linear_modules(ckpt: Path) -> list[str]:
    tensors = load_all(ckpt)
    return sorted({n.rsplit(".", 1)[0] for n, t in tensors.items()
                   if n.endswith((".weight", ".weight_packed")) and t.ndim == 2})


def module_tensors(tensors: dict[str, torch.Tensor], module: str) -> dict[str, torch.Tensor]:
    return {n[len(module) + 1:]: t for n, t in tensors.items() if n.rsplit(".", 1)[0] == module}


@pytest.mark.parametrize("case", CASE_IDS)
def test_config_is_compressed_tensors(both_formats, case):
    ct_lib = pytest.importorskip("compressed_tensors.quantization", reason="the compressed_tensors library "
                                 "(installed with vLLM) validates the config")
    _, ct, policy = both_formats(case)
    qc = quantization_config(ct)
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    parsed = ct_lib.QuantizationConfig.model_validate(qc)
    (group,) = parsed.config_groups.values()
    assert group.targets == ["Linear"]
    (scheme,) = dict(policy.schemes).values()
    assert qc["format"] == ("float-quantized" if scheme.kind == "fp8" else "pack-quantized")
    assert (parsed.kv_cache_scheme is not None) == (policy.kv_cache is not None)


@pytest.mark.parametrize("case", CASE_IDS)
def test_dequantized_weights_equal_the_cublade_format(both_formats, case):
    """compressed_tensors' decompressor on the compressed-tensors output (fp32 scales, so the product is exact)
    against cublade's dequantization of the cublade-format output: equal for every quantized module; the weight
    codes are the same words and the scales the same numbers; every other tensor is the same."""
    ct_lib = pytest.importorskip("compressed_tensors", reason="the compressed_tensors library (installed with "
                                 "vLLM) is the reference decompressor")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    ours_dir, ct_dir, policy = both_formats(case)
    qc = QuantizationConfig.model_validate(quantization_config(ct_dir))
    (ct_scheme,) = qc.config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(qc.format)
    ours, theirs = load_all(ours_dir), load_all(ct_dir)
    n_quantized = 0
    for module in linear_modules(ours_dir):
        scheme = policy.scheme_for(module)
        a, b = module_tensors(ours, module), module_tensors(theirs, module)
        if scheme is None:
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), module
            continue
        n_quantized += 1
        N, K = (b["weight_shape"].tolist() if "weight_shape" in b else b["weight"].shape)
        expect = {"weight_scale", "input_scale", "weight_zero_point"} & set(a) | (
            {"weight", } if "weight" in a else {"weight_packed", "weight_shape"})
        assert set(b) == expect, (module, sorted(b))
        for name in ("weight", "weight_packed"):
            if name in a:
                assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), f"{module}.{name}"
        assert torch.equal(a["weight_scale"].float().reshape(-1), b["weight_scale"].float().reshape(-1))
        if "input_scale" in a:
            assert torch.equal(a["input_scale"], b["input_scale"])
        if "weight_zero_point" in a:
            assert torch.equal(unpack_zero_points(b["weight_zero_point"], N), a["weight_zero_point"])
        state = {**b, "weight_scale": b["weight_scale"].float()}
        got = compressor.decompress(state, ct_scheme)["weight"]
        assert got.dtype == torch.float32 and got.shape == (N, K)
        assert torch.equal(got, scheme.dequantize(a)), module
    assert n_quantized == 5 * 7
    kv = sorted(n for n in ours if n.endswith(("k_scale", "v_scale")))
    assert kv == sorted(n for n in theirs if n.endswith(("k_scale", "v_scale")))
    assert all(torch.equal(ours[n], theirs[n]) for n in kv)
    assert bool(kv) == (policy.kv_cache is not None)


@pytest.mark.parametrize("case", CASE_IDS)
def test_cublade_reads_the_same_schemes(both_formats, case):
    ours_dir, ct_dir, _ = both_formats(case)
    ours = read_policy(ours_dir)
    theirs = policy_from_compressed_tensors(quantization_config(ct_dir))
    modules = linear_modules(ours_dir)
    assert any(ours.scheme_for(m) for m in modules)
    for m in modules:
        assert theirs.scheme_for(m) == ours.scheme_for(m), m
    assert theirs.kv_cache == ours.kv_cache


def test_unquantized_linears_are_named_in_ignore(tmp_path, padded_model_dir):
    """A policy that leaves some linears out (here one --ignore'd layer and every MLP by its rule): the written
    config names them, so the 'Linear' target does not quantize them."""
    from cublade.config import Policy, Rule, W4A16Scheme
    from cublade.convert import convert

    policy = Policy(preset="custom", schemes=(("w4", W4A16Scheme()),), rules=(Rule(r".*self_attn.*", "w4"),))
    policy = policy.with_ignore(r"model\.layers\.0\.self_attn\.o_proj")
    out = convert(padded_model_dir, tmp_path / "ct", policy, out_format="compressed-tensors")
    qc = quantization_config(out)
    assert "model.layers.1.mlp.down_proj" in qc["ignore"]
    assert r"re:model\.layers\.0\.self_attn\.o_proj$" in qc["ignore"]
    back = policy_from_compressed_tensors(qc)
    for m in linear_modules(out):
        assert back.scheme_for(m) == policy.scheme_for(m), m


def test_several_schemes_get_a_group_each(tmp_path, padded_model_dir):
    from cublade.config import Fp8Scheme, Policy, Rule, W4A16Scheme
    from cublade.convert import convert

    policy = Policy(preset="custom", schemes=(("w4", W4A16Scheme(64)), ("fp8", Fp8Scheme())),
                    rules=(Rule(r".*mlp.*", "w4"), Rule(r".*", "fp8")))
    out = convert(padded_model_dir, tmp_path / "ct", policy, out_format="compressed-tensors")
    qc = quantization_config(out)
    assert qc["format"] == "mixed-precision"
    formats = {g["format"]: g["targets"] for g in qc["config_groups"].values()}
    assert "model.layers.4.mlp.up_proj" in formats["pack-quantized"]
    assert "model.layers.4.self_attn.k_proj" in formats["float-quantized"]
    back = policy_from_compressed_tensors(qc)
    for m in linear_modules(out):
        assert back.scheme_for(m) == policy.scheme_for(m), m


@pytest.mark.parametrize("args,match", [
    (["--scheme", "mxfp8"], r"scheme 'mxfp8' \(mxfp8\(scale_rule=rceil\)\) cannot be written in this format: "
                            r"compressed-tensors' MXFP8 quantizes activations"),
    (["--scheme", "fp4-experts-fp8-dense"], r"scheme 'fp4' \(fp4\(format=mxfp4, scale_rule=rceil\)\) cannot be "
                                            r"written"),
    (["--scheme", "fp8-dynamic", "--kv-cache", "fp8", "--kv-rounding", "query-aware", "--calib-text", "T"],
     r"--kv-rounding query-aware cannot be written in this format"),
])
def test_inexpressible_schemes_are_refused_by_name(tmp_path, padded_model_dir, capsys, args, match):
    from cublade.cli import main

    out = tmp_path / "out"
    assert main(["convert", str(padded_model_dir), str(out), *args, "--format", "compressed-tensors"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("cublade convert: error: --format compressed-tensors: "), err
    assert re.search(match, err), err
    assert not list(tmp_path.iterdir())


def test_routed_experts_are_refused(tmp_path):
    from test_convert_memory import synthetic_llama_shards

    from cublade.convert import convert

    src = synthetic_llama_shards(tmp_path / "moe", hidden=64, intermediate=64, n_layers=1, n_shards=1, experts=2,
                                 kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.block_sparse_moe\.experts\.0\.w1 is a routed MoE "
                                         r"expert; cublade writes experts in its own format only"):
        convert(src, tmp_path / "out", preset("fp8-dynamic"), out_format="compressed-tensors")
    assert not (tmp_path / "out").exists()
    ignore = preset("fp8-dynamic").with_ignore(r".*\.experts(\.\d+)?\..*")
    convert(src, tmp_path / "out", ignore, out_format="compressed-tensors")  # the dense layers alone: written


def test_asymmetric_int4_needs_out_features_in_eights(tmp_path):
    from cublade.config import W4A16Scheme
    from cublade.config.compressed_tensors import check_shape

    with pytest.raises(NotImplementedError, match=r"x: not supported by scheme w4a16 because out_features=12 is not "
                                                  r"a multiple of 8 \(compressed-tensors packs zero points"):
        check_shape(W4A16Scheme(32, False), "x", 12, 64)
    check_shape(W4A16Scheme(32, True), "x", 12, 64)
