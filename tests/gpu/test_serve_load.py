"""`vllm serve` under load, on a GPU: each preset served compiled (vLLM's default), 64 concurrent clients for 30 s,
one request in twenty malformed. Every good request must succeed with the greedy text the same prompt gets alone,
every bad one must get a 4xx, and the server must still answer afterwards.

The FP8 presets are served with VLLM_BATCH_INVARIANT=1: without it vLLM's bf16 components vary in the last bit with the
batch and per-token FP8 can turn that into another greedy token (tests/gpu/test_batch_invariance.py).

About 2.5 minutes a preset (a compiled engine start, the prompts alone, 30 s of load); split the run with -k under the
device's 10 minutes a command, e.g. `-k "fp8"` then `-k "not fp8"`.
"""
from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from preset_models import preset_model
from test_serve import http, vllm_server

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 device)")

PRESETS = {"fp8-dynamic": True, "fp8-static": True, "w4a16": False, "mxfp8": False, "fp4-experts-fp8-dense": True}
CLIENTS, SECONDS, BAD_EVERY, TOKENS = 64, 30, 20, 24
# Malformed requests, each with the statuses vLLM's OpenAI server may answer it with (4xx only).
BAD = [
    (b'{"model": "m", "prompt": "Once upon', (400, 422)),  # truncated JSON
    (json.dumps({"model": "m", "max_tokens": 8}).encode(), (400, 422)),  # no prompt
    (json.dumps({"model": "m", "prompt": "Hi", "max_tokens": -3}).encode(), (400, 422)),
    (json.dumps({"model": "nope", "prompt": "Hi", "max_tokens": 8}).encode(), (400, 404)),
    (json.dumps({"model": "m", "prompt": "Hi", "temperature": "hot"}).encode(), (400, 422)),
    (json.dumps({"model": "m", "prompt": "Hi " * 2000, "max_tokens": 8}).encode(), (400, 413, 422)),  # too long
]


def post(url: str, data: bytes) -> tuple[int, str]:
    req = urllib.request.Request(f"{url}/v1/completions", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def good(prompt: str) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0.0}).encode()


def text_of(body: str) -> str:
    return json.loads(body)["choices"][0]["text"]


@pytest.mark.parametrize("name", list(PRESETS))
def test_serve_under_load_with_malformed_requests(name, padded_model_dir, converted, valid_text, tmp_path,
                                                  monkeypatch):
    if PRESETS[name]:
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    model = preset_model(name, padded_model_dir, converted, valid_text, tmp_path)
    lines = [ln.strip() for ln in open(valid_text) if len(ln.split()) > 8]
    prompts = [" ".join(ln.split()[: 3 + i % 9]) for i, ln in enumerate(lines[:32])]
    with vllm_server(model, tmp_path / "serve.log", "--max-num-seqs", str(CLIENTS)) as url:
        alone = []
        for p in prompts:
            status, body = post(url, good(p))
            assert status == 200, body
            alone.append(text_of(body))

        failures: list[str] = []
        counts = {"good": 0, "bad": 0}
        lock = threading.Lock()
        stop = time.time() + SECONDS

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while time.time() < stop:
                if rng.randrange(BAD_EVERY) == 0:
                    data, ok = BAD[rng.randrange(len(BAD))]
                    status, body = post(url, data)
                    with lock:
                        counts["bad"] += 1
                        if status not in ok:
                            failures.append(f"malformed {data[:60]!r}: {status} {body[:200]}")
                else:
                    i = rng.randrange(len(prompts))
                    status, body = post(url, good(prompts[i]))
                    with lock:
                        counts["good"] += 1
                        if status != 200:
                            failures.append(f"prompt {i}: {status} {body[:200]}")
                        elif text_of(body) != alone[i]:
                            failures.append(f"prompt {i}: {text_of(body)!r} under load, {alone[i]!r} alone")

        threads = [threading.Thread(target=client, args=(s,)) for s in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print("RESULT " + json.dumps({"test": "load", "model": name, **counts, "failures": len(failures)}))
        assert http(f"{url}/health", timeout=10)[0] == 200, "the server stopped answering after the load"
        status, body = post(url, good(prompts[0]))
        assert status == 200 and text_of(body) == alone[0]
    assert counts["good"] > CLIENTS and counts["bad"] > 0, counts
    assert not failures, f"{len(failures)} of {counts['good'] + counts['bad']} requests failed: " + \
        "; ".join(failures[:5])
