"""Bad input to `cublade convert` / `cublade ppl`, by class: each case exits non-zero with one line naming the file,
tensor or option and the rule, no traceback, nothing half-written beside OUT, nothing of the user's lost. Runs the
command in-process (cublade.cli.main) on copies of the bundled model; OS failures that a root-run CI cannot
provoke (permission, read-only, disk full) are injected with mocks."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import cublade.checkpoint
import cublade.convert
from ckpt_utils import synthetic_llama
from cublade.checkpoint import INDEX_NAME, CheckpointError, load_all
from cublade.cli import main
from cublade.convert_checks import check_layers_complete, check_values, output_lock

REPO = Path(__file__).resolve().parents[1]


def _run(capsys, *args) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = main([str(a) for a in args])
    return rc, capsys.readouterr().err.strip().splitlines()


def _one_line(capsys, *args) -> str:
    rc, err = _run(capsys, *args)
    assert rc == 2 and len(err) == 1, (rc, err)
    assert err[0].startswith(f"cublade {args[0]}: error: ") and "Traceback" not in err[0]
    return err[0]


def _nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}*")), list(out.parent.glob(f".{out.name}*"))


@pytest.fixture
def src(tmp_path, padded_model_dir) -> Path:
    return Path(shutil.copytree(padded_model_dir, tmp_path / "src"))


def _edit(src: Path, fn) -> None:
    f = src / "model.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f))


def _shard(src: Path, n: int) -> dict[str, str]:
    """Split src's one file into n shards with an index; returns the weight map."""
    t = load_file(str(src / "model.safetensors"))
    (src / "model.safetensors").unlink()
    keys, weight_map = sorted(t), {}
    for i in range(n):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: t[k] for k in keys[i::n]}, str(src / name))
        weight_map.update({k: name for k in keys[i::n]})
    (src / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def _convert(capsys, src, out, *opts):
    return _one_line(capsys, "convert", src, out, "--scheme", "fp8-dynamic", *opts)


# ---- incomplete sources -----------------------------------------------------------------------------------------

def test_shards_without_their_index_must_all_be_there(capsys, src, tmp_path):
    _shard(src, 3)
    (src / INDEX_NAME).unlink()
    all_three = load_all(src)
    out = tmp_path / "out"
    assert _run(capsys, "convert", src, out, "--scheme", "fp8-dynamic")[0] == 0  # all shards: the set is their union
    assert set(load_all(out)) >= {k for k in all_three if "layers" not in k or "norm" in k}
    (src / "model-00002-of-00003.safetensors").unlink()
    line = _convert(capsys, src, tmp_path / "o2")
    assert "2 of the 3 shards" in line and "missing model-00002-of-00003.safetensors" in line and INDEX_NAME in line
    _nothing_written(tmp_path / "o2")


def test_index_entries_no_shard_holds(capsys, src, tmp_path):
    weight_map = _shard(src, 2)
    index = json.loads((src / INDEX_NAME).read_text())
    index["weight_map"]["model.layers.7.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors"
    (src / INDEX_NAME).write_text(json.dumps(index))
    line = _convert(capsys, src, tmp_path / "out")
    assert "model.layers.7.mlp.up_proj.weight: model.safetensors.index.json puts it in " \
           "model-00001-of-00002.safetensors, which does not hold it" in line
    _nothing_written(tmp_path / "out")
    name, shard = next(iter(weight_map.items()))
    other = next(s for s in set(weight_map.values()) if s != shard)
    index["weight_map"] = {**weight_map, name: other}
    (src / INDEX_NAME).write_text(json.dumps(index))
    assert f"{name}: {INDEX_NAME} puts it in {other}, but {shard} holds it" in _convert(capsys, src, tmp_path / "out")


def test_a_failed_conversion_leaves_no_parent_directories_it_created(capsys, src, tmp_path):
    _edit(src, lambda t: t["model.norm.weight"].__setitem__(0, float("nan")))
    assert "model.norm.weight: 1 NaN/Inf" in _convert(capsys, src, tmp_path / "new" / "dirs" / "out")
    assert not (tmp_path / "new").exists()


def test_a_tensor_in_two_shards(capsys, src, tmp_path):
    weight_map = _shard(src, 2)
    name = next(k for k, v in weight_map.items() if v.startswith("model-00001"))
    second = src / "model-00002-of-00002.safetensors"
    t = load_file(str(second))
    t[name] = torch.zeros(3)
    save_file(t, str(second))
    assert f"{name}: in both model-00001-of-00002.safetensors and model-00002-of-00002.safetensors" in \
        _convert(capsys, src, tmp_path / "out")


def test_a_layer_missing_a_tensor_the_others_have(capsys, src, tmp_path):
    _edit(src, lambda t: t.pop("model.layers.3.mlp.down_proj.weight"))
    line = _convert(capsys, src, tmp_path / "out")
    assert "model.layers.3.mlp.down_proj.weight: missing from the checkpoint (every other layer has it)" in line
    _nothing_written(tmp_path / "out")


def test_layers_of_several_kinds_and_missing_layers():
    dense = {"mlp.up_proj.weight", "mlp.down_proj.weight", "self_attn.q_proj.weight"}
    moe = {"mlp.experts.0.w1.weight", "mlp.gate.weight", "self_attn.q_proj.weight"}
    names = [f"model.layers.{i}.{s}" for i in range(4) for s in (dense if i < 2 else moe)]
    check_layers_complete(names, {"num_hidden_layers": 4})  # dense and MoE layers: not one set, no check
    with pytest.raises(CheckpointError, match=r"model.layers.4: no tensors in the checkpoint.*num_hidden_layers=6"):
        check_layers_complete(names + [f"model.layers.5.{s}" for s in moe], {"num_hidden_layers": 6})


# ---- non-finite values ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, index, value, scheme", [
    ("model.layers.1.input_layernorm.weight", (3,), float("nan"), "fp8-dynamic"),  # kept unquantized
    ("model.embed_tokens.weight", (2, 5), float("inf"), "w4a16"),                 # kept unquantized
    ("model.layers.2.self_attn.o_proj.weight", (4, 1), float("-inf"), "mxfp8"),   # quantized
])
def test_non_finite_values_in_any_kept_tensor(capsys, src, tmp_path, name, index, value, scheme):
    _edit(src, lambda t: t[name].__setitem__(index, value))
    line = _one_line(capsys, "convert", src, tmp_path / "out", "--scheme", scheme)
    assert f"{name}: 1 NaN/Inf value(s) (first at index {list(index)})" in line
    _nothing_written(tmp_path / "out")


def test_values_that_overflow_the_output_dtype(capsys, src, tmp_path):
    _edit(src, lambda t: t["model.norm.weight"].__setitem__(7, 1e6))
    line = _convert(capsys, src, tmp_path / "out", "--dtype", "float16")
    assert "model.norm.weight: value 1e+06 at index [7] is outside float16's range" in line and "--dtype" in line
    _nothing_written(tmp_path / "out")
    assert _run(capsys, "convert", src, tmp_path / "out", "--scheme", "fp8-dynamic", "--dtype", "bfloat16")[0] == 0


def test_source_values_are_checked_before_calibration(capsys, src, tmp_path, valid_text, monkeypatch):
    import cublade.calib

    def calibrate(*a, **k):
        raise AssertionError("calibration ran before the source's values were checked")

    monkeypatch.setattr(cublade.calib, "calibrate", calibrate)
    _edit(src, lambda t: t["model.layers.4.mlp.down_proj.weight"].__setitem__((0, 9), float("nan")))
    line = _one_line(capsys, "convert", src, tmp_path / "out", "--scheme", "w4a16", "--calib-text", valid_text)
    assert "model.layers.4.mlp.down_proj.weight: 1 NaN/Inf value(s) (first at index [0, 9])" in line
    _nothing_written(tmp_path / "out")


def test_check_values_across_chunks(monkeypatch):
    monkeypatch.setattr("cublade.convert_checks.CHUNK", 7)
    t = torch.zeros(5, 6)
    t[3, 4] = t[4, 5] = float("nan")
    with pytest.raises(CheckpointError, match=r"w: 2 NaN/Inf value\(s\) \(first at index \[3, 4\]\)"):
        check_values("w", t)
    check_values("w", torch.zeros(5, 6, dtype=torch.int8))
    check_values("w", torch.full((5, 6), 1e6), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("values", [[float("nan")], [float("inf")], [-float("inf")], [float("inf"), -float("inf")],
                                    [float("nan"), float("inf")]])
def test_check_finite_finds_each_kind_of_non_finite_value(dtype, values):
    """A weight about to be quantized: NaN, +Inf, -Inf alone or together, counted, the first one's index named."""
    from cublade.convert import check_finite

    t = torch.randn(6, 9, generator=torch.Generator().manual_seed(0)).to(dtype)
    check_finite("w", t)
    check_finite("w", t[:0])
    for i, v in enumerate(values):
        t[2 + i, 7 - i] = v
    with pytest.raises(CheckpointError, match=rf"w: {len(values)} NaN/Inf value\(s\) \(first at index \[2, 7\]\)"):
        check_finite("w", t)


# ---- options that quantize nothing or make no sense ----------------------------------------------------------------

@pytest.mark.parametrize("opts, says", [
    (["--scheme", "fp8-dynamic", "--max-shard-size", "0"], "--max-shard-size must be positive"),
    (["--scheme", "fp8-dynamic", "--calib-tokens", "500"], "--calib-tokens sets how calibration runs; it needs "
                                                            "--calib-text"),
    (["--scheme", "fp8-dynamic", "--calib-lines", ":5"], "--calib-lines sets how calibration runs"),
    (["--scheme", "fp8-dynamic", "--ignore", "re:.*"], "fp8-dynamic would quantize none of the 36 linear layers: "
                                                        "36 ignored"),
    (["--scheme", "fp8-dynamic", "--scale-rule", "floor"], "preset 'fp8-dynamic' has no scheme with option(s) "
                                                            "--scale-rule"),
    (["--scheme", "mxfp8", "--group-size", "64"], "has no scheme with option(s) --group-size"),
    (["--scheme", "fp8-dynamic", "--kv-rounding", "query-aware"], "--kv-rounding query-aware sets how the FP8 KV "
                                                                   "cache is written; it needs --kv-cache fp8"),
    (["--scheme", "w4a16", "--quantize-lm-head", "--format", "compressed-tensors"], "--format compressed-tensors: a "
     "quantized lm_head cannot be written in this format"),
    (["--scheme", "w4a16", "--quantize-lm-head"], "lm_head: tied to the input embeddings (tie_word_embeddings in "
                                                   "config.json), so it cannot be quantized on its own"),
])
def test_convert_options_that_make_no_sense(capsys, padded_model_dir, tmp_path, opts, says):
    line = _one_line(capsys, "convert", padded_model_dir, tmp_path / "out", *opts)
    assert says in line
    assert not any(f in line for f in ("scale_rule", "group_size", "kv_rounding", "kv_cache"))  # field names
    _nothing_written(tmp_path / "out")


def test_skip_unsupported_that_leaves_nothing_to_quantize(capsys, original_model_dir, tmp_path):
    line = _one_line(capsys, "convert", original_model_dir, tmp_path / "out", "--scheme", "w4a16",
                     "--skip-unsupported")
    assert "w4a16 would quantize none of the 36 linear layers" in line and "--skip-unsupported" in line
    _nothing_written(tmp_path / "out")


def test_policies_that_quantize_nothing_or_are_malformed(capsys, padded_model_dir, tmp_path):
    pol = tmp_path / "p.json"
    pol.write_text(json.dumps({"schemes": {"fp8": {"kind": "fp8"}}, "rules": [{"pattern": "nothing.*",
                                                                              "scheme": "fp8"}]}))
    line = _one_line(capsys, "convert", padded_model_dir, tmp_path / "out", "--policy", pol)
    assert "would quantize none of the 36 linear layers" in line
    pol.write_text(json.dumps({"schemes": {"fp8": {"kind": "fp8"}}, "rules": [["nothing.*", "fp8"]]}))
    line = _one_line(capsys, "convert", padded_model_dir, tmp_path / "out", "--policy", pol)
    assert f"--policy {pol}: not a valid policy" in line
    pol.write_text("[1, 2]")
    assert f"--policy {pol}: a policy is a JSON object" in _one_line(capsys, "convert", padded_model_dir,
                                                                     tmp_path / "out", "--policy", pol)
    _nothing_written(tmp_path / "out")


@pytest.mark.parametrize("opts, says", [
    (["--window", "0"], "--window 0: a window needs at least 2 tokens"),
    (["--window", "4096"], "--window 4096 is longer than"),
    (["--backend", "vllm", "--max-model-len", "0"], "--max-model-len 0: must be at least 2"),
])
def test_ppl_options_that_make_no_sense(capsys, padded_model_dir, valid_text, opts, says):
    line = _one_line(capsys, "ppl", padded_model_dir, "--text", valid_text, *opts)
    assert says in line
    if "4096" in says:
        assert "512 positions (max_position_embeddings in config.json); use --window 512 or less" in line


# ---- the file system ------------------------------------------------------------------------------------------------

def test_paths_of_the_wrong_kind(capsys, src, tmp_path, valid_text):
    line = _convert(capsys, src / "model.safetensors", tmp_path / "out")
    assert f"{src / 'model.safetensors'} is a file; the checkpoint is its directory ({src})" in line
    (tmp_path / "f").write_text("x")
    line = _convert(capsys, src, tmp_path / "f" / "o")
    assert f"{tmp_path / 'f'} is a file; OUT's parent must be a directory" in line
    assert f"{tmp_path / 'f'} already exists (a file)" in _convert(capsys, src, tmp_path / "f")
    line = _one_line(capsys, "convert", src, tmp_path / "out", "--scheme", "w4a16", "--calib-text", tmp_path)
    assert f"{tmp_path} is a directory; a text file (one sample per line) is needed" in line
    line = _one_line(capsys, "ppl", src, "--text", src)
    assert f"{src} is a directory" in line
    _nothing_written(tmp_path / "out")


def test_text_that_is_not_utf8(capsys, src, tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("Once upon a time\nun caf\xe9\n".encode("latin-1"))
    says = f"{bad}: not UTF-8 text (byte 0xe9 at line 2, byte offset 23); save it as UTF-8"
    assert says in _one_line(capsys, "ppl", src, "--text", bad)
    assert says in _one_line(capsys, "convert", src, tmp_path / "out", "--scheme", "w4a16", "--calib-text", bad)
    (src / "config.json").write_bytes(b'{"model_type": "llama\xe9"}')
    assert f"{src / 'config.json'}: not a JSON text" in _convert(capsys, src, tmp_path / "out")
    (src / "config.json").write_text('{"model_type": ')
    assert f"{src / 'config.json'}: not a JSON text (Expecting value" in _convert(capsys, src, tmp_path / "out")
    _nothing_written(tmp_path / "out")


def test_unreadable_source_names_the_file_and_reason(capsys, src, tmp_path, monkeypatch):
    shard = src / "model.safetensors"

    def deny(path, *a, **k):
        if Path(path) == shard:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return open(path, *a, **k)

    monkeypatch.setattr(cublade.checkpoint, "open", deny, raising=False)
    assert f"cannot read {shard}: Permission denied" in _convert(capsys, src, tmp_path / "out")
    _nothing_written(tmp_path / "out")


def test_read_only_output_names_the_path_and_reason(capsys, src, tmp_path, monkeypatch):
    real_open = os.open

    def read_only(path, flags, *a, **k):
        if flags & (os.O_WRONLY | os.O_RDWR) and Path(path).parent == tmp_path:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", read_only)
    line = _convert(capsys, src, tmp_path / "out")
    assert line.endswith(f"{tmp_path / '.out.cublade-lock'}: Read-only file system [EROFS]")
    _nothing_written(tmp_path / "out")


def test_disk_full_names_the_output_and_removes_it(capsys, src, tmp_path, monkeypatch):
    real_pwrite = os.pwrite

    def full(fd, data, offset):
        if len(memoryview(data)) > 4096:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full)
    line = _convert(capsys, src, tmp_path / "out")
    assert ".out.cublade-tmp-" in line and line.endswith("No space left on device [ENOSPC]")
    _nothing_written(tmp_path / "out")


# `cublade convert` in a child process that holds once its first output shard is written, until `release` exists:
# whatever the machine's load, the test's signal or second process then finds it mid-conversion.
_HOLDING_CONVERT = """
import os, runpy, signal, sys, time
import cublade.convert
# A terminal's Ctrl-C, whatever the test runner's own SIGINT disposition and mask (a child inherits both).
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
held, release, add = sys.argv.pop(1), sys.argv.pop(1), cublade.convert.ShardWriter.add
def holding_add(self, name, t):
    add(self, name, t)
    if self.left[0] == 0 and not getattr(self, "held", False):
        self.held = True
        open(held, "w").close()
        deadline = time.time() + 120
        while not os.path.exists(release) and time.time() < deadline:
            time.sleep(0.02)
cublade.convert.ShardWriter.add = holding_add
runpy.run_module("cublade.cli", run_name="__main__")
"""


def _popen_convert(src, out, held: Path, release: Path):
    """`cublade convert src out` in a child that, once its first output shard is complete, creates `held` and
    waits (at most 120 s) for `release` to exist before converting the rest."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.Popen([sys.executable, "-c", _HOLDING_CONVERT, str(held), str(release), "convert", str(src),
                             str(out), "--scheme", "fp8-dynamic", "--max-shard-size", "1MB"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, p) -> None:
    deadline = time.time() + 120
    while time.time() < deadline and not path.exists():
        assert p.poll() is None, p.communicate()
        time.sleep(0.02)
    assert path.exists(), "the conversion did not reach its first shard's end in 120 s"


def _communicate(p, timeout: float = 60) -> str:
    try:
        return p.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError(f"the conversion was still running {timeout:.0f} s later; stderr: {p.communicate()[1]}")


def test_ctrl_c_is_one_line_and_removes_the_temporary_directory(tmp_path):
    # Interrupted while it holds after its first output shard, the rest of the source still to convert.
    src = synthetic_llama(tmp_path / "src", n_shards=4, layers_per_shard=3, hidden=512)
    out = tmp_path / "out"
    held = tmp_path / "held"
    p = _popen_convert(src, out, held, tmp_path / "never")
    _wait_for(held, p)
    p.send_signal(signal.SIGINT)
    err = _communicate(p)
    assert p.returncode == 130, err
    assert err.strip().splitlines() == ["cublade convert: interrupted; the temporary output was removed and OUT is "
                                        "unchanged"]
    _nothing_written(out)


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_killed_runs_leftovers_are_removed_and_reported(capsys, src, tmp_path):
    pid = _dead_pid()
    out = tmp_path / "out"
    left = tmp_path / f".out.cublade-tmp-{pid}"
    left.mkdir()
    (left / "part-00001.safetensors").write_bytes(b"x" * 100)
    rc, err = _run(capsys, "convert", src, out, "--scheme", "fp8-dynamic")
    assert rc == 0 and err == [f"cublade convert: removed {left}, left by a killed run (pid {pid})"]
    assert not left.exists() and (out / "config.json").is_file()


def test_a_killed_overwrite_puts_the_previous_output_back(capsys, src, tmp_path):
    out = tmp_path / "out"
    assert _run(capsys, "convert", src, out, "--scheme", "fp8-dynamic")[0] == 0
    before = (out / "model.safetensors").read_bytes()
    pid = _dead_pid()
    aside = tmp_path / f".out.cublade-old-{pid}"
    out.rename(aside)  # as a run killed between its two renames leaves it
    rc, err = _run(capsys, "convert", src, out, "--scheme", "fp8-dynamic")
    assert rc == 2 and err[0] == f"cublade convert: put back {out} from {aside.name}, moved aside by a killed " \
                                 f"--overwrite run (pid {pid})"
    assert "already exists" in err[1] and (out / "model.safetensors").read_bytes() == before and not aside.exists()


# ---- one OUT, several conversions; --overwrite -----------------------------------------------------------------------

def test_a_second_conversion_to_the_same_out_fails_at_once(capsys, src, tmp_path):
    out = tmp_path / "out"
    with output_lock(out):
        line = _convert(capsys, src, out)
    assert f"another cublade convert (pid {os.getpid()}) is writing {out}" in line
    assert not out.exists() and not list(tmp_path.glob(".out.cublade-tmp-*"))
    assert _run(capsys, "convert", src, out, "--scheme", "fp8-dynamic")[0] == 0  # released: the next one runs
    assert not (tmp_path / ".out.cublade-lock").exists()


def test_two_processes_one_wins(capsys, tmp_path):
    # The first conversion holds after its first shard while the second starts, then finishes.
    src = synthetic_llama(tmp_path / "src", n_shards=4, layers_per_shard=3, hidden=512)
    out, held, release = tmp_path / "out", tmp_path / "held", tmp_path / "release"
    first = _popen_convert(src, out, held, release)
    _wait_for(held, first)
    line = _one_line(capsys, "convert", src, out, "--scheme", "fp8-dynamic", "--overwrite")
    assert f"another cublade convert (pid {first.pid}) is writing {out}" in line
    release.touch()
    err = _communicate(first, timeout=300)
    assert first.returncode == 0, err
    assert (out / INDEX_NAME).is_file()


def test_out_appearing_during_a_conversion_is_left_alone(capsys, src, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real = cublade.convert._write_config

    def and_someone_creates_out(*a, **k):
        out.mkdir()
        (out / "mine.txt").write_text("the user's")
        return real(*a, **k)

    monkeypatch.setattr(cublade.convert, "_write_config", and_someone_creates_out)
    assert f"{out} appeared while converting; it is left as it is" in _convert(capsys, src, out)
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    assert not list(tmp_path.glob(".out.cublade-*"))


def test_overwrite_replaces_only_a_cublade_output(capsys, src, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    line = _convert(capsys, src, mine, "--overwrite")
    assert f"--overwrite replaces only a directory cublade convert wrote, and {mine} is not one (it has no " \
           f"config.json)" in line
    assert (mine / "notes.txt").read_text() == "keep"
    line = _convert(capsys, src, src, "--overwrite")  # an unquantized checkpoint is no cublade output either
    assert "its config.json has no quantization_config with quant_method 'cublade'" in line
    (tmp_path / "f").write_text("keep")
    assert "(it is a file)" in _convert(capsys, src, tmp_path / "f", "--overwrite")
    inner = tmp_path / "outer" / "model"
    shutil.copytree(src, inner)
    line = _convert(capsys, inner, tmp_path / "outer", "--overwrite")
    assert "is not one" in line and (inner / "model.safetensors").is_file()
    out = tmp_path / "out"
    assert _run(capsys, "convert", src, out, "--scheme", "fp8-dynamic")[0] == 0
    assert _run(capsys, "convert", src, out, "--scheme", "mxfp8", "--overwrite")[0] == 0  # a cublade output: replaced
    assert json.loads((out / "config.json").read_text())["quantization_config"]["schemes"]["mxfp8"]
