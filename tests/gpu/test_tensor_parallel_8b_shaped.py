"""Tensor and expert parallelism on models whose shapes shard at TP = 2 and 4: a 2-layer Llama-3-8B-shaped model and
a 1-layer Mixtral-8x7B-shaped one (random N(0, 0.02) weights, benchmarks/bench_e2e.py's make_source, with the bundled
model's tokenizer: its 512 ids fit both vocabularies). The bundled model does not serve at TP = 4 (a rank would hold
2 heads of dimension 16, which vLLM's FlashAttention 3 never returns from) and its o_proj splits a w4a16 g128 group
at TP = 2; these shapes have neither problem.

Each case serves one checkpoint at TP = 1 and at TP = N (or EP = N), each in an engine of its own, greedy, 32 tokens
for 8 prompts. Recorded: how many of the 8 continuations are identical (TP changes the order of the row-parallel
sums, so on flat random logits a pick may flip and the continuation diverge after it). Asserted, teacher-forced so
that one flip does not derail the rest: the TP = N engine's log-probabilities of the TP = 1 tokens (prompt_logprobs)
rank that token first at >= 90% of the 256 positions, and differ from TP = 1's by <= 0.05 nats on average. A shard
that splits the wrong rows, scales or zero points makes the logits unrelated (the token then ranks first almost
nowhere among 128256).

FP8 activations take other bars: TP = N rounds each row-parallel partial sum to bf16 before the all-reduce, a
difference of bf16 size in the next layer's input, and rounding to E4M3 (steps of 2^-3 relative against bf16's 2^-8)
turns some of those into whole-step differences. scripts/tp_fp8_study.py simulates the layers' numerics on CPU on
this model (cublade's FP8 math), TP = 2 against TP = 1, ranked first / mean |difference|: bf16 93.4% / 0.011,
fp8-static 86.3% / 0.063, fp8-dynamic 78.5% / 0.104; at TP = 4 94.9% / 0.012, 82.8% / 0.061, 82.0% / 0.114 (H200,
vLLM, TP = 2: bf16 96.5% / 0.011, cublade fp8-static 82.8% / 0.065, fp8-dynamic 74.2% / 0.109, vLLM's own online
FP8 71.1% / 0.122). So fp8-static (one calibrated scale, the same on every rank) is held to >= 75% / <= 0.08, and the
presets that also scale per token at run time (fp8-dynamic, fp8-kv, and the Mixtral layer's FP8 attention: a
row-parallel rank scales its tokens over its own K inputs) to vLLM's own online FP8 (per channel, per token) at the
same TP: first at >= vLLM's share - 5 points, difference <= vLLM's + 0.02 nats, vLLM's measured in the
same run on the 8B-shaped source.

Needs as many GPUs as the case's N. About 30-70 s an engine. The TP = 1 runs of every selected case go first, one
engine per GPU at a time, and each is kept for the checkpoint's other cases; then the TP = N engines, one after
another. Split the run with -k to stay under 10 minutes a command, e.g. `-k "tp4 and (bf16 or w4a16-g128)"`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import Queue

import pytest
import torch
from preset_models import REPO
from test_tensor_parallel import DENSE as BUNDLED_DENSE
from test_tensor_parallel import GPUS, TPS, failure_summary, model_for

pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs 2 or more CUDA GPUs (the device's nvidia-h100-x2 / -x4 kinds)")

# the bundled model's presets, w4a16 at g128, which these shapes shard, and w4a16 with its lm_head quantized
DENSE = {**BUNDLED_DENSE, "w4a16-g128": ("w4a16", {}), "w4a16-g128-asym": ("w4a16", {"symmetric": False}),
         "w4a16-g128-lm-head": ("w4a16", {"lm_head": True})}  # the lm_head's vocabulary split over the ranks
RANK1_MIN, MEAN_ABS_LOGPROB_MAX = 0.90, 0.05
BARS = {"fp8-static": (0.75, 0.08)}  # FP8 activations with one scale: the simulation's 82.8-86.3% / 0.061-0.063
DYNAMIC_FP8 = {"fp8-dynamic", "fp8-kv"}  # per-token activation scales: held to vLLM's own FP8 at the same TP
VLLM_FP8 = "fp8_per_channel"  # vLLM's online FP8: weights per channel, activations per token
RANK1_SLACK, MEAN_ABS_LOGPROB_SLACK = 0.05, 0.02
PROMPTS, NEW_TOKENS = 8, 32
MIXTRAL = "fp4-experts-fp8-dense (mixtral)"  # the Mixtral-shaped layer's case

# An engine in a process of its own, as a file with a main guard (vLLM may start its TP workers by spawning)
SCRIPT = textwrap.dedent('''
    import json, sys
    from vllm import LLM, SamplingParams


    def main():
        model, tp, ep = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
        prompts, ref, quantization = json.loads(sys.argv[4]), sys.argv[5], sys.argv[6]
        llm = LLM(model=model, tensor_parallel_size=tp, enable_expert_parallel=ep, enforce_eager=True, seed=0,
                  gpu_memory_utilization=0.3, max_model_len=256,
                  quantization=None if quantization == "-" else quantization)
        # token ids only: most of a random model's picks are ids the small tokenizer does not have
        greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
        # the reference run's sequences (or this run's own), scored token by token
        ref_seqs = json.loads(open(ref).read())["seqs"] if ref != "-" else seqs
        starts = [len(o.prompt_token_ids) for o in outs]
        scored = llm.generate([{"prompt_token_ids": s} for s in ref_seqs],
                              SamplingParams(max_tokens=1, prompt_logprobs=1, detokenize=False), use_tqdm=False)
        logprobs, ranks = [], []
        for o, s, start in zip(scored, ref_seqs, starts):
            lp = [o.prompt_logprobs[i][s[i]] for i in range(start, len(s))]
            logprobs.append([p.logprob for p in lp])
            ranks.append([p.rank for p in lp])
        print("RESULT " + json.dumps({"seqs": seqs, "logprobs": logprobs, "ranks": ranks}), flush=True)


    if __name__ == "__main__":
        main()
''').replace("NEW_TOKENS", str(NEW_TOKENS))


def serve(model: Path, n: int, ep: bool, prompts: list[str], ref: Path | None, log: Path,
          quantization: str | None = None, gpu: str | None = None) -> dict:
    """One engine at tensor-parallel size n: its greedy sequences (prompt + 32 tokens), and its log-probabilities and
    ranks of `ref`'s sequences (of its own without `ref`). quantization: vLLM's --quantization (None: the
    checkpoint's own); gpu: the one GPU a TP = 1 engine runs on (None: the first ones visible)."""
    script = log.with_name("engine.py")
    script.write_text(SCRIPT)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu) if gpu is not None else None
    r = subprocess.run([sys.executable, str(script), str(model), str(n), "1" if ep else "0", json.dumps(prompts),
                        str(ref) if ref else "-", quantization or "-"],
                       capture_output=True, text=True, timeout=400, check=False, env=env)
    log.write_text(r.stdout + r.stderr)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"engine at TP={n} failed ({log}): {failure_summary(r.stderr)}"
    return json.loads(lines[-1][7:])


@pytest.fixture(scope="module")
def sources(tmp_path_factory, padded_model_dir, script):
    """sources(shape) -> a random-weight source of that bench_e2e shape ("8b": 2 layers, "mixtral": 1) with the
    bundled model's tokenizer."""
    bench = script(REPO / "benchmarks" / "bench_e2e.py")
    made = {}

    def get(shape: str) -> Path:
        if shape not in made:
            out = tmp_path_factory.mktemp(f"src-{shape}") / "model"
            bench.make_source(out, {"8b": 2, "mixtral": 1}[shape], shape=shape)
            torch.cuda.empty_cache()  # the engines that follow size their memory from what is free
            for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
                shutil.copy2(padded_model_dir / f, out / f)
            made[shape] = out
        return made[shape]
    return get


@pytest.fixture(scope="module")
def prompts(valid_text) -> list[str]:
    """The openings (6 words) of the evaluation text's first sentences of more than 8 words."""
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", Path(valid_text).read_text()) if len(s.split()) > 8]
    return [" ".join(s.split()[:6]) for s in sentences[:PROMPTS]]


def checkpoint(case: str, sources, converted, valid_text) -> Path:
    """The checkpoint a case serves: a DENSE name on the 8B-shaped source, or MIXTRAL."""
    if case == MIXTRAL:
        return converted("fp4-experts-fp8-dense", src=sources("mixtral"))
    return model_for(case, sources("8b"), converted, valid_text, DENSE)


def with_vllm_fp8_bars(case: str) -> bool:
    """Whether a case is held to vLLM's own FP8 at the same TP (per-token activation scales)."""
    return case in DYNAMIC_FP8 or case == MIXTRAL


def visible_gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[:GPUS] if visible else [str(i) for i in range(GPUS)]


def run_one_per_gpu(jobs: list, run, gpus: list[str]) -> list:
    """run(job, gpu) for every job, as many at a time as there are GPUs, each on a GPU no other job holds; a job's
    exception is its result."""
    free: Queue = Queue()
    for g in gpus:
        free.put(g)

    def task(job):
        g = free.get()
        try:
            return run(job, g)
        except Exception as e:  # noqa: BLE001 - kept for the case that needs this job
            return e
        finally:
            free.put(g)

    with ThreadPoolExecutor(len(gpus)) as pool:
        return list(pool.map(task, jobs))


@pytest.fixture(scope="module")
def tp1(request, tmp_path_factory, prompts, sources, converted, valid_text):
    """tp1(model, quantization=None) -> (the TP = 1 run's result, the file holding it), one engine per checkpoint.
    The first call runs those of every selected case of this module, one engine per GPU at a time."""
    runs: dict = {}
    prefetched = []

    def run(key, gpu: str | None = None):
        model, quantization = key
        d = tmp_path_factory.mktemp("tp1")
        res = serve(model, 1, False, prompts, None, d / "engine.log", quantization, gpu)
        (d / "result.json").write_text(json.dumps(res))
        return res, d / "result.json"

    def prefetch():
        prefetched.append(True)
        keys = []
        for item in request.session.items:
            if item.module is request.module and hasattr(item, "callspec"):
                case = item.callspec.params.get("name", MIXTRAL)
                try:
                    keys.append((checkpoint(case, sources, converted, valid_text), None))
                except Exception:  # noqa: BLE001 - the case's own test meets the error again and reports it
                    continue
                if with_vllm_fp8_bars(case):
                    keys.append((sources("8b"), VLLM_FP8))
        keys = list(dict.fromkeys(keys))
        runs.update(zip(keys, run_one_per_gpu(keys, run, visible_gpus())))

    def get(model: Path, quantization: str | None = None):
        if not prefetched:
            prefetch()
        if (model, quantization) not in runs:
            runs[model, quantization] = run((model, quantization))
        got = runs[model, quantization]
        if isinstance(got, Exception):
            raise got
        return got
    return get


def against_tp1(model: Path, n: int, ep: bool, prompts, tp1, log: Path, quantization: str | None = None) -> dict:
    """The TP = N (EP = N) engine against TP = 1 on one checkpoint: identical continuations, the share of positions
    where TP = 1's token ranks first, and the mean / max |logprob difference| of TP = 1's tokens."""
    ref, ref_file = tp1(model, quantization)
    got = serve(model, n, ep, prompts, ref_file, log, quantization)
    ranks = [r for rs in got["ranks"] for r in rs]
    diffs = [abs(a - b) for la, lb in zip(ref["logprobs"], got["logprobs"]) for a, b in zip(la, lb)]
    return {"same_continuations": sum(a == b for a, b in zip(ref["seqs"], got["seqs"])), "prompts": len(prompts),
            "rank1": sum(r == 1 for r in ranks) / len(ranks), "mean_abs_logprob_diff": sum(diffs) / len(diffs),
            "max_abs_logprob_diff": max(diffs)}


@pytest.fixture(scope="module")
def vllm_fp8(sources, prompts, tp1, tmp_path_factory):
    """vllm_fp8(n) -> vLLM's own online FP8 (VLLM_FP8) at TP = n against TP = 1 on the 8B-shaped source."""
    runs = {}

    def get(n: int) -> dict:
        if n not in runs:
            log = tmp_path_factory.mktemp(f"vllm-fp8-tp{n}") / "engine.log"
            runs[n] = against_tp1(sources("8b"), n, False, prompts, tp1, log, VLLM_FP8)
            print("RESULT " + json.dumps({"test": "tp-greedy", "model": f"vLLM {VLLM_FP8}", "mode": f"TP={n}",
                                          **runs[n]}))
        return runs[n]
    return get


def compare(name: str, model: Path, n: int, ep: bool, prompts, tp1, tmp_path, reference: dict | None = None):
    """Assert the bars (BARS[name], else RANK1_MIN / MEAN_ABS_LOGPROB_MAX; or `reference`'s own scores with the
    slack)."""
    got = against_tp1(model, n, ep, prompts, tp1, tmp_path / "engine.log")
    mode = f"EP={n}" if ep else f"TP={n}"
    print("RESULT " + json.dumps({"test": "tp-greedy", "model": name, "mode": mode, **got}))
    rank1_min, mean_max = BARS.get(name, (RANK1_MIN, MEAN_ABS_LOGPROB_MAX))
    if reference is not None:
        rank1_min = min(rank1_min, reference["rank1"] - RANK1_SLACK)
        mean_max = max(mean_max, reference["mean_abs_logprob_diff"] + MEAN_ABS_LOGPROB_SLACK)
    rank1, mean_diff = got["rank1"], got["mean_abs_logprob_diff"]
    assert rank1 >= rank1_min and mean_diff <= mean_max, (
        f"{name} {mode} against TP=1: TP=1's token ranked first at {rank1:.1%} of the positions (bar "
        f"{rank1_min:.0%}), mean |logprob difference| {mean_diff:.4f} (bar {mean_max:.3f}); "
        f"{got['same_continuations']} of {len(prompts)} continuations identical")


@pytest.mark.parametrize("n", TPS, ids=lambda n: f"tp{n}")
@pytest.mark.parametrize("name", list(DENSE))
def test_llama_8b_shaped_at_tensor_parallel_size(name, n, sources, converted, valid_text, prompts, tp1, vllm_fp8,
                                                 tmp_path):
    model = checkpoint(name, sources, converted, valid_text)
    compare(name, model, n, False, prompts, tp1, tmp_path, vllm_fp8(n) if with_vllm_fp8_bars(name) else None)


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
@pytest.mark.parametrize("n", TPS, ids=lambda n: f"x{n}")
def test_mixtral_shaped_fp4_experts(n, ep, sources, converted, prompts, tp1, vllm_fp8, tmp_path):
    """fp4-experts-fp8-dense on the Mixtral-shaped layer: experts split by the intermediate size (TP) or whole experts
    per rank (EP; 8 experts over N ranks). Its attention is per-token FP8 (fp8-dynamic), so it takes the bars of the
    presets with per-token scales (vLLM's own FP8 at the same TP on the 8B-shaped source, where every linear layer
    is FP8: the larger effect)."""
    model = checkpoint(MIXTRAL, sources, converted, None)
    compare(MIXTRAL, model, n, ep, prompts, tp1, tmp_path, vllm_fp8(n))
