"""End to end on a GPU: `vllm serve` of converted stories260K checkpoints (quant_method read from
config.json), greedy text against the unquantized model, and `cublade ppl --backend vllm` against the CPU
reference backend.

Runs on the H200 device machine after `source .device-stage/env.sh` (vLLM in /tmp/site) and installing
cublade there (`python3 -m pip install --no-deps --no-build-isolation --target /tmp/site .`, which registers
the vllm.general_plugins entry point). Every server is started, queried and stopped inside this pytest
process (its own process group, killed on the way out), with its log under pytest's tmp dir (the path is
printed, and the log's tail is in every failure message). Timeouts: server start 300 s, a request 60 s, a
ppl run 600 s.

About 16 vLLM engine starts in all (~25 s each with --enforce-eager, longer compiled); to stay under the
device's 10 minutes per command, split the run with -k, e.g.
    pytest tests/gpu/test_serve.py -k "serve or greedy"      # servers: base, 5 presets, compiled, kv, interop
    pytest tests/gpu/test_serve.py -k ppl                    # LLM prompt logprobs: base + 5 presets
Results (texts, losses) are also written as JSON lines to $CUBLADE_GPU_RESULTS when set (e.g. under $OUT).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 device)")

PRESETS = ["fp8-dynamic", "fp8-static", "w4a16", "mxfp8", "fp4-experts-fp8-dense"]
PROMPT = "Once upon a time"
GREEDY_TOKENS = 20
START_TIMEOUT, REQUEST_TIMEOUT, PPL_TIMEOUT = 300, 60, 600
# The kernel each preset's layers must run on with bf16 activations on sm_90 (never the fp32 reference).
EXPECTED_KERNEL = {"fp8-dynamic": "vllm-cutlass-scaled-mm", "fp8-static": "vllm-cutlass-scaled-mm",
                   "w4a16": "(cublade-w4a16-gemm|vllm-machete|vllm-marlin)",
                   "mxfp8": "cublade-mxfp8-gemm", "fp4-experts-fp8-dense": "vllm-cutlass-scaled-mm"}
# Accuracy bars (those of tests/test_ppl.py): d loss vs the unquantized model.
BARS = {"fp8-dynamic": 0.013, "mxfp8": 0.012}
PPL_REL = 0.005  # vllm vs reference perplexity of the same checkpoint
NEAR_TIE = 0.25  # nats: a greedy divergence is allowed where the unquantized model's top-2 are this close


def record(**row) -> None:
    path = os.environ.get("CUBLADE_GPU_RESULTS")
    print("RESULT", json.dumps(row))
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def http(url: str, body: dict | None = None, timeout: float = REQUEST_TIMEOUT):
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


@contextlib.contextmanager
def vllm_server(model_dir: Path, log: Path, *args: str):
    """`vllm serve model_dir` on a free port; yields the base URL once /health answers; always stopped."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir), "--port", str(port),
           "--host", "127.0.0.1", "--served-model-name", "m", "--dtype", "bfloat16", "--max-model-len", "512",
           "--gpu-memory-utilization", "0.25", "--max-num-seqs", "16", *args]
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"\n$ {' '.join(cmd)}\n  log: {log}")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + START_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode} before answering; log {log}:\n{tail(log)}")
            try:
                if http(f"{url}/health", timeout=5)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.time() > deadline:
                pytest.fail(f"vllm serve did not answer /health within {START_TIMEOUT} s; log {log}:\n{tail(log)}")
            time.sleep(2)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def greedy(url: str) -> dict:
    status, body = http(f"{url}/v1/completions", {"model": "m", "prompt": PROMPT, "max_tokens": GREEDY_TOKENS,
                                                  "temperature": 0.0, "logprobs": 2})
    assert status == 200, body
    choice = json.loads(body)["choices"][0]
    # top: per generated token, the model's two most likely tokens -> logprob
    return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"], "top": choice["logprobs"]["top_logprobs"]}


# ---- fixtures --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plugin_installed():
    from importlib.metadata import entry_points

    names = [e.value for e in entry_points(group="vllm.general_plugins")]
    if "cublade.vllm:register" not in names:
        pytest.fail(f"cublade's vllm.general_plugins entry point is not installed (found {names}); install "
                    f"cublade where vLLM is: python3 -m pip install --no-deps --no-build-isolation --target "
                    f"/tmp/site .")


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="module")
def checkpoint(converted, valid_text):
    """preset -> converted padded model (fp8-static calibrated on the first 10 stories of the text)."""
    def get(name: str, **overrides) -> Path:
        if name == "fp8-static" or overrides.get("kv_cache"):
            overrides = {"calib_text": valid_text, "calib_lines": slice(0, 10), **overrides}
        return converted(name, **overrides)
    return get


@pytest.fixture(scope="module")
def served(plugin_installed, padded_model_dir, checkpoint, logs):
    """name -> (greedy completion, server log text), each checkpoint served once (eager)."""
    cache: dict = {}

    def get(name: str) -> tuple[dict, str]:
        if name not in cache:
            model = padded_model_dir if name == "unquantized" else checkpoint(name)
            log = logs / f"serve-{name}.log"
            with vllm_server(model, log, "--enforce-eager") as url:
                out = greedy(url)
            cache[name] = (out, log.read_text(errors="replace"))
            record(test="greedy", model=name, **out)
        return cache[name]
    return get


# ---- serving ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", PRESETS)
def test_serve_answers_completions(served, name, logs):
    out, log = served(name)
    assert out["text"].strip(), f"empty completion; log {logs}/serve-{name}.log"
    assert len(out["tokens"]) == GREEDY_TOKENS
    assert "quantization=cublade" in log, "vLLM did not pick cublade from config.json"
    choices = re.findall(r"cublade: (\S+\(.*?\)) layers like .*? run on ([\w-]+)", log)
    assert choices, f"no kernel choice logged; log tail:\n{log[-3000:]}"
    for scheme, kernel in choices:  # every quantized layer on a GPU kernel, not the fp32 reference
        assert re.fullmatch(EXPECTED_KERNEL[name], kernel), (scheme, kernel)


def test_serve_unquantized_baseline(served):
    out, _ = served("unquantized")
    assert out["text"].startswith(", there was a little girl named Lily"), out["text"]


@pytest.mark.parametrize("name", ["fp8-dynamic", "mxfp8"])
def test_greedy_matches_unquantized(served, name):
    """The first 20 greedy tokens equal the unquantized model's, except that the quantized model may take the
    unquantized model's second choice where that model itself is at a near-tie (top-2 logprobs within NEAR_TIE
    nats); the text is then compared no further. On this model token 16 is such a tie: after "She loved to
    play", " with" and " outside" are 0.133 nats apart in fp32 and tie exactly in bf16 (CPU, transformers);
    vLLM's bf16 model says " with", the fp32 model and the published output " outside"."""
    base, _ = served("unquantized")
    got, _ = served(name)
    i = next((i for i, (a, b) in enumerate(zip(base["tokens"], got["tokens"])) if a != b), None)
    if i is None:
        return
    top = base["top"][i]
    gap = top[base["tokens"][i]] - top.get(got["tokens"][i], float("-inf"))
    record(test="greedy-divergence", model=name, token=i, base=base["tokens"][i], got=got["tokens"][i], gap=gap)
    assert gap <= NEAR_TIE, (f"{name} diverges from the unquantized model at token {i}, not at a near-tie "
                             f"(unquantized top-2 {top}; gap {gap:.3f} nats > {NEAR_TIE}): "
                             f"{''.join(base['tokens'][:i])!r} then {base['tokens'][i]!r} vs {got['tokens'][i]!r}"
                             f"\n  unquantized: {base['text']!r}\n  {name}: {got['text']!r}")


@pytest.mark.parametrize("name", ["fp8-dynamic", "mxfp8"])
def test_serve_compiled_matches_eager(served, checkpoint, logs, name):
    """Without --enforce-eager vLLM compiles the model (torch.compile, fullgraph) and captures CUDA graphs:
    cublade's apply paths must trace, and give the eager greedy text up to token 16. Token 17 is a near-tie
    on this model in bf16 (on an H200 the fp32 model continues "play outside", the bf16 one "play
    with her toy"; fp8-dynamic compiled said "outside", eager "with"), which kernel fusion may flip."""
    eager, _ = served(name)
    with vllm_server(checkpoint(name), logs / f"serve-{name}-compiled.log") as url:
        out = greedy(url)
    record(test="compiled", model=name, **out)
    assert out["tokens"][:16] == eager["tokens"][:16], (out["text"], eager["text"])


def test_compiled_model_cache_follows_the_kernel_choice(served, checkpoint, logs, monkeypatch):
    """vLLM keeps compiled models across runs (VLLM_USE_AOT_COMPILE) under a key that must see cublade's kernel
    choice (cublade.vllm.kernels.add_to_compile_key): the mxfp8 checkpoint compiled on cublade-mxfp8-gemm, then served
    with that kernel disabled, must compile anew on vllm-marlin-mxfp8 and answer the eager text. (Before the key held
    the choice, the second engine loaded the first run's graph and failed at start: mxfp8_gemm on Marlin's weights.)"""
    eager, _ = served("mxfp8")
    for disabled, kernel in (("", "cublade-mxfp8-gemm"), ("cublade-mxfp8-gemm", "vllm-marlin-mxfp8"),
                             ("cublade-mxfp8-gemm,vllm-marlin-mxfp8", "cublade-mxfp8-gemm-sm80")):
        monkeypatch.setenv("CUBLADE_DISABLED_KERNELS", disabled)
        log = logs / f"serve-mxfp8-compiled-{kernel}.log"
        with vllm_server(checkpoint("mxfp8"), log) as url:
            out = greedy(url)
        assert re.search(rf"mxfp8\(scale_rule=rceil\) layers like .* run on {kernel}", log.read_text()), kernel
        assert out["tokens"][:16] == eager["tokens"][:16], (kernel, out["text"], eager["text"])


def assert_same_text_or_near_tie(base: dict, got: dict, what: str) -> None:
    """`got`'s greedy tokens equal the default kernel's (`base`), or first differ where the default run's top two
    logprobs were within NEAR_TIE nats."""
    i = next((i for i, (a, b) in enumerate(zip(base["tokens"], got["tokens"])) if a != b), None)
    if i is None:
        return
    top = base["top"][i]
    gap = top[base["tokens"][i]] - top.get(got["tokens"][i], float("-inf"))
    assert gap <= NEAR_TIE, (f"{what} diverges from the default kernel at token {i}, not at a near-tie "
                             f"(gap {gap:.3f} nats): {base['text']!r} vs {got['text']!r}")


@pytest.mark.parametrize("name,disabled,kernel", [
    ("w4a16", "cublade-w4a16-gemm,vllm-machete,vllm-marlin", "cublade-w4a16-gemm-sm80"),
    ("fp8-dynamic", "vllm-cutlass-scaled-mm,vllm-marlin-fp8", "cublade-fp8-w8a16"),
    ("mxfp8", "cublade-mxfp8-gemm,vllm-marlin-mxfp8", "cublade-mxfp8-gemm-sm80")])
def test_sm80_kernels_serve_the_default_text(served, checkpoint, logs, monkeypatch, name, disabled, kernel):
    """The kernels cublade runs on Ampere / Ada (cublade._C_sm80), served here through their compute_80 PTX by
    disabling the kernels ahead of them on this GPU: the log names the sm_80 kernel and the greedy text equals the
    default kernel's, except at a near-tie of the default run (fp8 as W8A16 leaves the activations unquantized, so
    its logits differ from W8A8's by more than summation order)."""
    base, _ = served(name)
    monkeypatch.setenv("CUBLADE_DISABLED_KERNELS", disabled)
    log = logs / f"serve-{name}-{kernel}.log"
    with vllm_server(checkpoint(name), log, "--enforce-eager") as url:
        got = greedy(url)
    record(test="sm80-kernel", model=name, kernel=kernel, **got)
    assert re.search(rf"layers like .* run on {kernel}", log.read_text()), f"{kernel} not chosen; log {log}"
    assert_same_text_or_near_tie(base, got, f"{name} on {kernel}")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp8_gemm_serves_the_default_text(served, checkpoint, logs, monkeypatch, compiled):
    """CUBLADE_FP8_GEMM=1: fp8-dynamic's layers on cublade-fp8-gemm (cublade's FP8 decode GEMM up to 16 tokens, vLLM's
    CUTLASS above), eager and compiled with CUDA graphs: the log names the kernel and the greedy text equals CUTLASS's
    (both W8A8 on the same bytes, the sums in another fp32 order), except at a near-tie of the default run."""
    base, _ = served("fp8-dynamic")
    monkeypatch.setenv("CUBLADE_FP8_GEMM", "1")
    log = logs / f"serve-fp8-dynamic-fp8-gemm-{'compiled' if compiled else 'eager'}.log"
    with vllm_server(checkpoint("fp8-dynamic"), log, *(() if compiled else ("--enforce-eager",))) as url:
        got = greedy(url)
    record(test="fp8-gemm", compiled=compiled, **got)
    assert re.search(r"layers like .* run on cublade-fp8-gemm", log.read_text()), f"not chosen; log {log}"
    assert_same_text_or_near_tie(base, got, "fp8-dynamic on cublade-fp8-gemm")


def test_kv_cache_fp8_with_cublade_cache_write(plugin_installed, checkpoint, logs):
    """A kv_cache fp8 checkpoint: the cache dtype follows the checkpoint, and with --attention-backend CUSTOM
    the cache write is cublade's op (its CUDA kernel when the extension has it)."""
    from cublade.ops._dispatch import use_kernel

    ckpt = checkpoint("fp8-dynamic", kv_cache="fp8")
    log = logs / "serve-fp8-kv.log"
    with vllm_server(ckpt, log, "--enforce-eager", "--attention-backend", "CUSTOM") as url:
        out = greedy(url)
    text = log.read_text(errors="replace")
    record(test="kv-fp8-custom", model="fp8-dynamic+kv", **out)
    assert out["text"].strip()
    # The line is logged by the first FP8 cache write: the cache is fp8 (from the checkpoint, no flag) and
    # written by cublade's op.
    kernel = use_kernel(torch.empty(0, device="cuda"), "fp8_kv_cache_write")
    expect = ("cublade's CUDA op fp8_kv_cache_write" if kernel
              else "vLLM's reshape_and_cache_flash (cublade's CUDA extension has no fp8_kv_cache_write)")
    assert f"FP8 KV-cache write runs {expect}" in text, tail(log)


def test_kv_cache_query_aware_compiled_matches_eager(plugin_installed, checkpoint, logs):
    """A query-aware FP8 KV checkpoint under --attention-backend CUSTOM: the backend writes the cache in its
    forward, which CUDA graphs capture when vLLM compiles (the slot mapping is then padded with -1, which the
    write skips). Compiled, it must give the eager greedy text up to token 16, both written query-aware."""
    ckpt = checkpoint("fp8-dynamic", kv_cache="fp8", kv_rounding="query-aware")
    outs, texts = {}, {}
    for mode, extra in (("eager", ("--enforce-eager",)), ("compiled", ())):
        log = logs / f"serve-fp8-kv-query-aware-{mode}.log"
        with vllm_server(ckpt, log, *extra, "--attention-backend", "CUSTOM") as url:
            outs[mode] = greedy(url)
        texts[mode] = log.read_text(errors="replace")
        record(test="kv-query-aware-custom", model=f"fp8-dynamic+kv-qa-{mode}", **outs[mode])
        assert "K rounded query-aware" in texts[mode], tail(log)
    assert "Capturing CUDA graphs" in texts["compiled"] or "Graph capturing finished" in texts["compiled"], \
        tail(logs / "serve-fp8-kv-query-aware-compiled.log")
    assert outs["compiled"]["tokens"][:16] == outs["eager"]["tokens"][:16], (outs["compiled"]["text"],
                                                                               outs["eager"]["text"])


def test_compressed_tensors_checkpoint_with_quantization_flag(plugin_installed, checkpoint, logs, tmp_path, served):
    """The fp8-dynamic checkpoint rewritten in compressed-tensors' FP8_DYNAMIC layout, served with
    --quantization cublade, gives the same greedy text as cublade's own checkpoint."""
    from safetensors.torch import load_file, save_file

    src = checkpoint("fp8-dynamic")
    dst = tmp_path / "ct-fp8"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "quantization_status": "compressed", "kv_cache_scheme": None,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                  "dynamic": True}}}}
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in dst.glob("*.safetensors"):
        t = load_file(str(f))
        t = {k: (v.reshape(-1, 1) if k.endswith(".weight_scale") else v) for k, v in t.items()}
        save_file(t, str(f), metadata={"format": "pt"})
    log = logs / "serve-ct-fp8.log"
    with vllm_server(dst, log, "--enforce-eager", "--quantization", "cublade") as url:
        out = greedy(url)
    record(test="compressed-tensors", model="fp8-dynamic-ct", **out)
    assert out["tokens"] == served("fp8-dynamic")[0]["tokens"]


# ---- perplexity: vLLM vs the reference backend -----------------------------------------------------------

def ppl_vllm(model: Path, text: Path, logs: Path, name: str, *extra) -> float:
    """`cublade ppl --backend vllm` (its default dtype, bfloat16); returns the loss it prints."""
    cmd = [sys.executable, "-m", "cublade.cli", "ppl", "--backend", "vllm", str(model), "--text", str(text), *extra]
    log = logs / f"ppl-{name}.log"
    with open(log, "w") as out:
        r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=PPL_TIMEOUT)
    assert r.returncode == 0, f"{' '.join(cmd)} failed ({r.returncode}); log {log}:\n{tail(log)}"
    m = re.search(r": loss (\d+\.\d+)\s+ppl", log.read_text())
    assert m, tail(log)
    return float(m.group(1))


def test_kv_cache_query_aware_in_vllm(plugin_installed, converted, valid_text, logs):
    """The FP8 KV split (calibrate on stories 0-5, score 6-18) through vLLM: the FP8 KV cache's cost over fp8-dynamic
    with K rounded to nearest (vLLM's own cache write) and query-aware (cublade's, which `cublade ppl` picks for
    such a checkpoint: --attention-backend CUSTOM). vLLM's FlashAttention 3 also rounds the queries to FP8, which
    the reference backend does not, so the costs are not the reference's (+0.0383 / +0.0047)."""
    calib = {"calib_text": valid_text, "calib_lines": slice(0, 6)}
    losses = {}
    for name, kw in (("fp8-dynamic", {}), ("kv-nearest", {"kv_cache": "fp8", **calib}),
                     ("kv-query-aware", {"kv_cache": "fp8", "kv_rounding": "query-aware", **calib})):
        losses[name] = ppl_vllm(converted("fp8-dynamic", **kw), valid_text, logs, f"split-{name}", "--lines", "6:")
    log = (logs / "ppl-split-kv-query-aware.log").read_text(errors="replace")
    assert "K rounded query-aware" in log, log[-3000:]
    nearest, query_aware = (losses[k] - losses["fp8-dynamic"] for k in ("kv-nearest", "kv-query-aware"))
    record(test="ppl-kv-split", **losses, nearest_cost=nearest, query_aware_cost=query_aware)
    print(f"\nvLLM, stories 6-18: fp8-dynamic {losses['fp8-dynamic']:.4f}, + FP8 KV (K nearest) {nearest:+.4f}, "
          f"+ FP8 KV (K query-aware) {query_aware:+.4f}")
    assert query_aware < nearest - 0.01


@pytest.fixture(scope="module")
def ppl(plugin_installed, padded_model_dir, checkpoint, valid_text, logs):
    """name -> (vllm loss, reference loss) on the whole validation text."""
    from cublade.ppl import evaluate

    cache: dict = {}

    def get(name: str) -> tuple[float, float]:
        if name not in cache:
            model = padded_model_dir if name == "unquantized" else checkpoint(name)
            v = ppl_vllm(model, valid_text, logs, name)
            r = evaluate(model, valid_text, backend="reference").loss
            cache[name] = (v, r)
            record(test="ppl", model=name, vllm_loss=v, reference_loss=r)
        return cache[name]
    return get


@pytest.mark.parametrize("name", ["unquantized", *PRESETS])
def test_ppl_vllm_within_half_percent_of_reference(ppl, name):
    import math

    v, r = ppl(name)
    ratio = math.exp(v) / math.exp(r)
    assert abs(ratio - 1) <= PPL_REL, f"{name}: vllm ppl {math.exp(v):.4f} vs reference {math.exp(r):.4f} ({ratio:.4f})"


@pytest.mark.parametrize("name", list(BARS))
def test_ppl_vllm_within_accuracy_bars(ppl, name):
    """The bar on d loss vs the unquantized model, each measured with the same backend (vLLM, bf16)."""
    v, _ = ppl(name)
    base, _ = ppl("unquantized")
    assert v - base <= BARS[name], f"{name}: vllm loss {v:.4f} vs unquantized {base:.4f}: d {v - base:+.4f}"


@pytest.mark.parametrize("name", ["w4a16", "fp8-dynamic", "mxfp8"])
def test_ppl_vllm_with_quantized_lm_head(plugin_installed, untied_model_dir, converted, valid_text, logs, name):
    """`cublade convert --quantize-lm-head` (on the bundled model with its lm_head untied): vLLM's ParallelLMHead
    runs the scheme's GPU kernel, within PPL_REL of the reference backend on the same checkpoint. On CPU the same
    path matches the reference (tests/vllm/test_vllm_model.py; the layer bit for bit:
    tests/vllm/test_vllm_linear.py)."""
    import math

    from cublade.ppl import evaluate

    ckpt = converted(name, src=untied_model_dir, lm_head=True)
    v = ppl_vllm(ckpt, valid_text, logs, f"{name}-lm-head")
    r = evaluate(ckpt, valid_text, backend="reference").loss
    record(test="ppl-lm-head", model=name, vllm_loss=v, reference_loss=r)
    ratio = math.exp(v) / math.exp(r)
    assert abs(ratio - 1) <= PPL_REL, f"{name}: vllm ppl {math.exp(v):.4f} vs reference {math.exp(r):.4f} ({ratio:.4f})"
