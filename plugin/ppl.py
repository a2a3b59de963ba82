"""Perplexity over a text file, the same tokens and windows for every backend.

Tokens and windows: cublade.text (each non-empty line BOS + its tokens, all lines concatenated, cut into
non-overlapping windows); the model scores each window on its own; loss = mean NLL over every predicted token
(a window of n tokens predicts n - 1).
  reference: transformers on CPU (cublade.reference: quantized layers through the reference ops)
  vllm:      vLLM prompt logprobs (a GPU machine with vLLM; cublade's plugin serves the checkpoint)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from cublade.config.schemes import KVRounding
from cublade.numerics.choice import Choice
from cublade.text import tokenize, windows


class Backend(Choice):
    REFERENCE = "reference"  # transformers on CPU through cublade's reference ops
    VLLM = "vllm"  # vLLM prompt logprobs (GPU)


@dataclass(frozen=True)
class PplResult:
    model: str
    backend: Backend
    loss: float
    n_tokens: int  # predicted tokens

    @property
    def ppl(self) -> float:
        return math.exp(self.loss)


def _reference_nll(model_dir, wins: list[list[int]], dtype: torch.dtype, batch: int = 8) -> float:
    from cublade.reference import load_reference_model

    model, _ = load_reference_model(model_dir, dtype=dtype)
    total = 0.0
    with torch.inference_mode():
        for length in sorted({len(w) for w in wins}):  # batch windows of equal length (all but the last)
            same = [w for w in wins if len(w) == length]
            for i in range(0, len(same), batch):
                x = torch.tensor(same[i:i + batch])
                logits = model(x).logits[:, :-1].float()
                total += torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
    return total


def _kv_rounding(model_dir) -> KVRounding | None:
    """The K rounding of a cublade checkpoint's FP8 KV cache (None: no such cache, or not a cublade checkpoint)."""
    import json

    from cublade.config import QUANT_METHOD, parse_quantization_config

    qc = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config") or {}
    kv = parse_quantization_config(qc).kv_cache if qc.get("quant_method") == QUANT_METHOD else None
    return kv.rounding if kv is not None else None


def _vllm_nll(model_dir, wins: list[list[int]], dtype: str, **llm_kwargs) -> float:
    import os

    # vLLM samples at least one token after each prompt, so a full window needs window + 1 positions; the
    # model's config allows exactly `window` (stories260K: 512). The extra position is never scored.
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    if dtype == "float32":
        # fp32 scoring asks for cublade's reference kernels (no tensor-core kernel takes fp32 activations); on a GPU
        # they run only when asked for (docs/kernel-selection.md#environment).
        os.environ.setdefault("CUBLADE_ALLOW_REFERENCE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    need = max(len(w) for w in wins) + 1
    max_len = llm_kwargs.pop("max_model_len", None) or need
    if max_len < need:
        raise ValueError(f"--max-model-len {max_len}: a window of {need - 1} tokens needs {need} positions "
                         f"(lower --window instead)")
    if llm_kwargs.get("attention_backend") is None and _kv_rounding(model_dir) is KVRounding.QUERY_AWARE:
        # the cache write that rounds K query-aware is cublade's (cublade.vllm.kv_cache): score what serving
        # the checkpoint as intended gives
        llm_kwargs["attention_backend"] = "CUSTOM"
    llm = LLM(model=str(model_dir), dtype=dtype, max_model_len=max_len, enforce_eager=True, **llm_kwargs)
    try:
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in wins], params, use_tqdm=False)
    finally:
        # vLLM 0.26's LLM has no close(): left to the finalizers at interpreter exit, the engine client's
        # threads aborted the process after the loss was printed (SIGABRT, "terminate called without an active
        # exception", seen on an H200). Stop the engine core and its client threads here instead.
        llm.llm_engine.engine_core.shutdown()
    total = 0.0
    for w, out in zip(wins, outs):
        for tok, lp in zip(w[1:], out.prompt_logprobs[1:]):
            total -= lp[tok].logprob
    return total


def evaluate(model_dir, text_path, backend: Backend | str = Backend.REFERENCE, lines: slice | None = None,
             window: int = 512, dtype: str = "float32", **backend_kwargs) -> PplResult:
    backend = Backend.lookup(backend, "backend")
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a checkpoint directory (no config.json)")
    wins = windows(tokenize(model_dir, text_path, lines), window)
    if not wins:
        raise ValueError(f"{text_path}: too little text to score (fewer than 2 tokens)")
    n = sum(len(w) - 1 for w in wins)
    if backend is Backend.REFERENCE:
        nll = _reference_nll(model_dir, wins, getattr(torch, dtype), **backend_kwargs)
    else:
        nll = _vllm_nll(model_dir, wins, dtype, **backend_kwargs)
    return PplResult(str(model_dir), backend, nll / n, n)


def format_table(results: list[PplResult], names: list[str] | None = None) -> str:
    """Markdown table; the first result is the baseline for the delta column."""
    names = names or [Path(r.model).name for r in results]
    base = results[0].loss
    w = max(len("model"), *(len(n) for n in names))
    rows = [f"| {'model':<{w}} | backend   |   loss | d loss vs {names[0]} |    ppl | tokens |",
            f"|{'-' * (w + 2)}|-----------|-------:|{'-' * (len(names[0]) + 12)}:|-------:|-------:|"]
    for name, r in zip(names, results):
        rows.append(f"| {name:<{w}} | {r.backend:<9} | {r.loss:.4f} | {r.loss - base:+{len(names[0]) + 11}.4f} "
                    f"| {r.ppl:6.3f} | {r.n_tokens:6d} |")
    return "\n".join(rows)
