"""The `cublade` command's options that a vLLM / llm-compressor user reaches for: --version, convert --ignore and
--device, ppl's vLLM options; each wrong use is one line naming the option."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cublade
from cublade.checkpoint import load_all
from cublade.config import parse_quantization_config

REPO = Path(__file__).resolve().parents[1]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "cublade.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO)


def _one_line_error(r, command: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"cublade {command}: error: "), r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


def test_version():
    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"cublade {cublade.__version__}"


def test_ignore_leaves_the_named_modules_unquantized(tmp_path, padded_model_dir):
    r = _cli("convert", padded_model_dir, tmp_path / "out", "--scheme", "fp8-dynamic",
             "--ignore", "model.layers.0.mlp.down_proj", "--ignore", r"re:.*layers\.1\.self_attn\..*")
    assert r.returncode == 0, r.stderr
    t = load_all(tmp_path / "out")
    assert t["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32
    assert "model.layers.0.mlp.down_proj.weight_scale" not in t
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert t[f"model.layers.1.self_attn.{proj}.weight"].dtype == torch.float32
    assert t["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn  # the rest as the preset says
    assert t["model.layers.1.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    policy = parse_quantization_config(qc)
    assert policy.scheme_for("model.layers.0.mlp.down_proj") is None
    assert policy.scheme_for("model.layers.1.self_attn.o_proj") is None
    assert policy.scheme_for("model.layers.2.self_attn.o_proj") is not None


@pytest.mark.parametrize("pattern, says", [
    ("(", "not a valid regular expression"),
    ("model.layers.0.mlp", "matches no module"),  # a prefix, not a whole name
    (r"re:model\.layers\.9\..*", "matches no module"),
])
def test_ignore_refuses_patterns_that_match_nothing(tmp_path, padded_model_dir, pattern, says):
    line = _one_line_error(_cli("convert", padded_model_dir, tmp_path / "out", "--scheme", "w4a16",
                                "--ignore", pattern), "convert")
    assert "--ignore" in line and says in line
    assert not (tmp_path / "out").exists()


def test_device_needs_calibration(tmp_path, padded_model_dir):
    line = _one_line_error(_cli("convert", padded_model_dir, tmp_path / "out", "--scheme", "fp8-dynamic",
                                "--device", "cpu"), "convert")
    assert "--device" in line and "--calib-text" in line


def test_device_runs_calibration_there(tmp_path, padded_model_dir, valid_text):
    r = _cli("convert", padded_model_dir, tmp_path / "out", "--scheme", "fp8-static", "--calib-text", valid_text,
             "--calib-lines", ":2", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["calibration"]["device"] == "cpu"


def test_quant_device_cpu_writes_the_default_bytes(tmp_path, padded_model_dir):
    """--quant-device cpu writes what the default (auto) does; on a GPU machine auto quantizes there, whose bytes
    equal the CPU's: tests/gpu/test_convert_on_gpu.py."""
    for out, extra in (("default", []), ("cpu", ["--quant-device", "cpu"])):
        r = _cli("convert", padded_model_dir, tmp_path / out, "--scheme", "w4a16", *extra)
        assert r.returncode == 0, r.stderr
    a, b = load_all(tmp_path / "default"), load_all(tmp_path / "cpu")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_quant_device_auto_is_the_gpu_where_torch_sees_one(monkeypatch):
    from cublade.convert import quant_device_checked

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert quant_device_checked("auto") is None and quant_device_checked(None) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert quant_device_checked("auto") == torch.device("cuda", 1)


def test_a_weight_that_does_not_fit_the_gpu_is_quantized_on_the_cpu(tmp_path, padded_model_dir, monkeypatch, capsys):
    """Out of GPU memory on a weight, the converter quantizes that weight on the CPU, says so once, and writes the
    same bytes. (The out-of-memory stood in for: the quantization of two weights on the quantization device raises
    it; the device is the CPU here.)"""
    from cublade import convert as convert_mod
    from cublade.config import preset

    convert_mod.convert(padded_model_dir, tmp_path / "plain", preset("w4a16"))
    real, failed = convert_mod._quantized, []

    def quantized(module, w, scheme, calib):  # the first try of the first two weights fails
        if len(failed) < 2 and module not in failed:
            failed.append(module)
            raise torch.cuda.OutOfMemoryError("stand-in")
        return real(module, w, scheme, calib)

    monkeypatch.setattr(convert_mod, "_quantized", quantized)
    convert_mod.convert(padded_model_dir, tmp_path / "fell-back", preset("w4a16"), quant_device="cpu")
    err = capsys.readouterr().err
    assert len(failed) == 2 and err.count("does not fit the free memory of cpu") == 1, err
    assert failed[0] in err
    a, b = load_all(tmp_path / "plain"), load_all(tmp_path / "fell-back")
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


@pytest.mark.parametrize("device,says", [("cuda:7" if torch.cuda.is_available() else "cuda", "CUDA"),
                                         ("tpu-ish", "not a device name")])
def test_quant_device_that_cannot_run_is_one_line(tmp_path, padded_model_dir, device, says):
    line = _one_line_error(_cli("convert", padded_model_dir, tmp_path / "out", "--scheme", "fp8-dynamic",
                                "--quant-device", device), "convert")
    assert f"--quant-device {device}" in line.replace("'", "") and says in line
    assert not (tmp_path / "out").exists()


def test_ppl_vllm_options(tmp_path, padded_model_dir, valid_text):
    line = _one_line_error(_cli("ppl", padded_model_dir, "--text", valid_text, "--max-model-len", "600",
                                "--tensor-parallel-size", "2"), "ppl")
    assert "--max-model-len and --tensor-parallel-size are for --backend vllm" in line
    help_text = _cli("ppl", "--help").stdout
    assert "--tensor-parallel-size" in help_text and "--max-model-len" in help_text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_ppl_vllm_without_a_gpu_is_one_line(padded_model_dir, valid_text):
    line = _one_line_error(_cli("ppl", padded_model_dir, "--text", valid_text, "--backend", "vllm"), "ppl")
    assert "needs a CUDA GPU" in line and "--backend reference" in line


@pytest.mark.parametrize("argv,needle", [
    (["convert", "a", "b", "--scheme", "bogus"], "argument --scheme: invalid choice: 'bogus'"),
    (["convert", "a", "b", "--scheme", "w4a16", "--group-size", "7"], "argument --group-size: invalid choice: 7"),
    (["ppl"], "the following arguments are required: MODEL, --text"),
])
def test_option_errors_are_one_line(argv, needle, capsys):
    from cublade.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "--help` lists the options" in err, err


def test_quantize_lm_head(tmp_path, untied_model_dir):
    r = _cli("convert", untied_model_dir, tmp_path / "out", "--scheme", "w4a16", "--quantize-lm-head")
    assert r.returncode == 0, r.stderr
    t = load_all(tmp_path / "out")
    assert "lm_head.weight" not in t and t["lm_head.weight_packed"].dtype == torch.int32
    assert t["model.embed_tokens.weight"].dtype == torch.float32  # the embeddings stay as they are
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert parse_quantization_config(qc).scheme_for("lm_head") is not None
    r = _cli("convert", untied_model_dir, tmp_path / "plain", "--scheme", "w4a16")  # the presets' default
    assert r.returncode == 0 and "lm_head.weight" in load_all(tmp_path / "plain")
