"""Calibration for `cublade convert --calib-text FILE`: GPTQ for w4a16 weights, static FP8 activation scales,
FP8 KV-cache scales.

    result = calibrate(src_dir, policy, text_path, n_tokens, lines=None, device=None)
    result.get("model.layers.0.mlp.down_proj.weight_packed")   # -> tensor or None
    result.info                                                 # provenance, JSON-serializable

How it runs (cublade.calib.capture): the text is tokenized exactly as `cublade ppl` does (each non-empty
line = BOS + its tokens, concatenated; the first `n_tokens`), cut into windows of `window` tokens, embedded,
then pushed through the model one decoder layer at a time. For each layer:
  1. its weights are loaded from the safetensors (one layer in memory at a time);
  2. its quantized linears are taken in call order, grouped by shared input ([q, k, v], [o], [gate, up],
     [down] for Llama; "true sequential"). For each group: the layer runs over every window while hooks sum
     each GPTQ linear's X^T X and track each static-FP8 linear's input abs-max; then the group is quantized
     (GPTQ for w4a16, the scheme's round-to-nearest otherwise, plus input_scale for static FP8) and swapped
     for its quantized stand-in, so the next group is calibrated on what the quantized layer feeds it;
  3. the fully quantized layer runs once more: its outputs are the next layer's inputs (GPTQ's sequential
     scheme: each layer sees the outputs of the quantized layers before it), and the attention function
     sees K after RoPE and V, as vLLM writes them into its cache.
GPTQ outputs are spooled to a temporary safetensors file per layer, so memory stays bounded by one layer.

FP8 scales (input_scale, k_scale, v_scale) are abs-max / 448, floored at FP8_MIN_SCALE like the dynamic
scales: nothing seen in calibration saturates. Measured on the bundled model (fp8-static and fp8-dynamic +
fp8 KV, calibrated on lines 0:6, scored on 6:), smaller scales only lose: input scales x0.9 / x0.75 / x0.5
(a percentile-style clip) give d loss +0.0137 / +0.0117 / +0.0351 against +0.0096 for abs-max; k/v scales
x0.5 take the loss from 1.754 to 2.62, while x2 .. x64 change it by < 0.003 (E4M3's relative precision
does not depend on the scale until values reach the subnormals).
"""
from __future__ import annotations

import logging
import shutil
import tempfile
import weakref
from contextlib import nullcontext
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from cublade.calib.capture import (LayerwiseModel, QuantizedLinear, linear_groups, observe_kv, observe_linears,
                                   release_free_heap)
from cublade.calib.gptq import GPTQConfig, gptq_quantize, weighted_error
from cublade.config import Fp8Scheme, Policy, UnsupportedShape, W4A16Scheme
from cublade.numerics.fp8 import dynamic_scale
from cublade.text import format_lines, tokenize
from cublade.text import windows as make_windows

__all__ = ["calibrate", "CalibResult", "GPTQConfig", "MIN_CALIB_TOKENS", "DEFAULT_WINDOW"]

log = logging.getLogger(__name__)

# Fewer calibration tokens than this is refused: a couple of sentences give abs-max scales and Hessians that
# describe those sentences, not the model's inputs. (GPTQ practice is 128 x 2048 tokens; the bundled model's
# bars use ~3k.)
MIN_CALIB_TOKENS = 128
# Calibration windows, the same as `cublade ppl`'s default (capped at the model's max_position_embeddings).
DEFAULT_WINDOW = 512


class CalibResult:
    """Calibrated tensors by checkpoint name, plus provenance (`info`) for the quantization_config.

    Small tensors (scales) are held in memory; GPTQ weights live in per-layer safetensors files in a
    temporary directory, read back one tensor at a time by `get`, and removed when the result is closed or
    garbage-collected."""

    def __init__(self, spool_dir: Path):
        self.info: dict = {}
        self._small: dict[str, torch.Tensor] = {}
        self._spooled: dict[str, Path] = {}
        self._dir = Path(spool_dir)
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self._dir), True)

    def get(self, name: str) -> torch.Tensor | None:
        if name in self._small:
            return self._small[name]
        path = self._spooled.get(name)
        if path is None:
            return None
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(name)

    def names(self) -> list[str]:
        return sorted([*self._small, *self._spooled])

    def __contains__(self, name: str) -> bool:
        return name in self._small or name in self._spooled

    def __len__(self) -> int:
        return len(self._small) + len(self._spooled)

    def close(self) -> None:
        self._cleanup()

    def __enter__(self) -> CalibResult:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- filled by calibrate --------------------------------------------------------------------------
    def _put(self, name: str, t: torch.Tensor) -> None:
        self._small[name] = t.detach().cpu()

    def _spool(self, stem: str, tensors: dict[str, torch.Tensor]) -> None:
        if not tensors:
            return
        path = self._dir / f"{stem}.safetensors"
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))
        self._spooled.update(dict.fromkeys(tensors, path))


def _needs(policy: Policy) -> list[str]:
    what = []
    if any(isinstance(s, W4A16Scheme) for _, s in policy.schemes):
        what.append("gptq")
    if any(isinstance(s, Fp8Scheme) and s.static for _, s in policy.schemes):
        what.append("fp8-input-scales")
    if policy.kv_cache is not None:
        what.append("kv-cache-scales")
    return what


def calibration_tokens(src_dir, text_path, n_tokens: int | None, lines: slice | None = None) -> list[int]:
    """The calibration token stream: `cublade ppl`'s tokenization of the (selected lines of the) text, cut to
    the first n_tokens. Raises ValueError for empty, too short, or not-enough text."""
    where = f"{text_path}" + (f" (lines {format_lines(lines)})" if lines is not None else "")
    if n_tokens is not None and n_tokens < MIN_CALIB_TOKENS:
        raise ValueError(f"--calib-tokens {n_tokens} is too few: calibration needs at least {MIN_CALIB_TOKENS} "
                         f"tokens")
    try:
        ids = tokenize(src_dir, text_path, lines)
    except ValueError as e:
        raise ValueError(f"calibration text: {e}") from None
    if n_tokens is not None and len(ids) < n_tokens:
        raise ValueError(f"calibration text {where} tokenizes to {len(ids)} tokens, fewer than the {n_tokens} "
                         f"asked for (--calib-tokens): give more text or ask for fewer tokens")
    if len(ids) < MIN_CALIB_TOKENS:
        raise ValueError(f"calibration text {where} is too short: {len(ids)} tokens, calibration needs at least "
                         f"{MIN_CALIB_TOKENS}")
    return ids[:n_tokens] if n_tokens is not None else ids


def calibrate(src_dir, policy: Policy, text_path, n_tokens: int | None, lines: slice | None = None,
              device: str | None = None, *, gptq: GPTQConfig | None = GPTQConfig(), sequential: bool = True,
              window: int = DEFAULT_WINDOW, spool_dir=None, progress: bool | None = None) -> CalibResult:
    """Calibrate `policy` on the unquantized checkpoint `src_dir` over the text at `text_path`.

    n_tokens: use the first n tokens (None: all of the selected lines). lines: a slice of the text's
    non-empty lines (a held-out split). device: 'cuda', 'cpu', ... (None: CUDA when available).
    gptq: GPTQ settings for w4a16 layers (None: leave w4a16 to round-to-nearest). sequential: calibrate the
    linears of a layer group by group on the quantized groups' outputs (False: all from the float layer).
    spool_dir: where the temporary GPTQ spool goes (None: the system temp dir)."""
    src_dir, text_path = Path(src_dir), Path(text_path)
    needs = _needs(policy)
    if not needs:
        raise ValueError(f"preset {policy.preset!r} has nothing to calibrate: calibration computes GPTQ weights "
                         f"(w4a16), static FP8 input scales (fp8-static) and FP8 KV-cache scales (--kv-cache fp8)")
    if "gptq" in needs and gptq is None:
        needs.remove("gptq")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))

    ids = calibration_tokens(src_dir, text_path, n_tokens, lines)
    model = LayerwiseModel(src_dir, dev)
    win = min(window, getattr(model.config, "max_position_embeddings", None) or window)
    spool = Path(tempfile.mkdtemp(prefix="cublade-calib-", dir=None if spool_dir is None else str(spool_dir)))
    result = CalibResult(spool)
    run = _Run(model, policy, result, gptq if "gptq" in needs else None, sequential)

    with torch.inference_mode():
        hidden = model.embed(make_windows(ids, win))
        pos = [model.position_embeddings(h) for h in hidden]
        for i in tqdm(range(len(model)), desc="calibrate", unit="layer",
                      disable=None if progress is None else not progress):
            hidden = run.layer(i, hidden, pos)
    del hidden, pos
    release_free_heap()  # before the conversion streams the checkpoint

    info: dict = {"text": text_path.name, "lines": format_lines(lines), "tokens": len(ids), "window": win,
                  "device": dev.type, "sequential": sequential, "method": needs}
    if "gptq" in needs:
        errs = run.gptq_errors
        info["gptq"] = {**gptq.to_dict(), "layers": len(errs),
                        "output_error_vs_rtn_mean": round(sum(errs) / len(errs), 4) if errs else None}
    if "fp8-input-scales" in needs:
        info["fp8_input_scale"] = "absmax/448 of each linear's input over the calibration tokens"
    if "kv-cache-scales" in needs:
        info["kv_cache_scale"] = "absmax/448 of K (after RoPE) and V per attention layer"
    if run.skipped:
        info["skipped"] = sorted(run.skipped)
    if run.rtn_experts:
        info["gptq"]["experts_round_to_nearest"] = len(run.rtn_experts)
    result.info = info
    log.info("calibration: %s", info)
    return result


class _Run:
    """One calibration pass over the layers; `layer(i, hidden, pos)` replaces the windows in the list `hidden` by
    layer i's quantized outputs, one window at a time, and returns the list."""

    def __init__(self, model: LayerwiseModel, policy: Policy, result: CalibResult, gptq: GPTQConfig | None,
                 sequential: bool):
        self.model, self.policy, self.result, self.gptq, self.sequential = model, policy, result, gptq, sequential
        self.gptq_errors: list[float] = []  # per GPTQ linear: output error / RTN's on its calibration inputs
        self.skipped: dict[str, str] = {}
        self.rtn_experts: list[str] = []  # w4a16 expert linears left to round-to-nearest

    def _check_experts(self, prefix: str) -> None:
        """MoE experts run quantized (round-to-nearest) while calibrating; GPTQ would need per-expert inputs,
        which this pass does not gather: say which w4a16 experts keep round-to-nearest."""
        for module, scheme in self.model.quantized_experts.items():
            if module.startswith(prefix + ".") and isinstance(scheme, W4A16Scheme) and self.gptq is not None:
                self.rtn_experts.append(module)

    def _plan(self, layer: nn.Module, prefix: str) -> dict[str, tuple[str, nn.Linear, object]]:
        """full name -> (path in layer, module, scheme) of every linear of the layer the policy quantizes."""
        plan = {}
        for path, mod in layer.named_modules():
            full = f"{prefix}.{path}"
            scheme = self.policy.scheme_for(full) if isinstance(mod, nn.Linear) else None
            if scheme is None:
                continue
            try:
                scheme.check_shape(full, mod.out_features, mod.in_features)
            except UnsupportedShape as e:  # the converter refuses it, or leaves it unquantized when asked
                self.skipped[full] = str(e)
                continue
            plan[full] = (path, mod, scheme)
        return plan

    def layer(self, i: int, hidden: list[torch.Tensor], pos: list) -> list[torch.Tensor]:
        model = self.model
        prefix = model.layer_name(i)
        release_free_heap()
        layer = model.load_layer(i, self.policy)
        self._check_experts(prefix)
        plan = self._plan(layer, prefix)
        if self.sequential:
            groups = linear_groups(layer, prefix, set(plan), lambda: model.run_layer(layer, hidden[0], pos[0]))
        else:
            groups = [list(plan)]
        spooled: dict[str, torch.Tensor] = {}
        for group in groups:
            want_h = {n for n in group if isinstance(plan[n][2], W4A16Scheme) and self.gptq is not None}
            want_a = {n for n in group if isinstance(plan[n][2], Fp8Scheme) and plan[n][2].static}
            stats = {}
            if want_h or want_a:
                with observe_linears(layer, prefix, want_h, want_a) as stats:
                    for h, pe in zip(hidden, pos):
                        model.run_layer(layer, h, pe)
            for full in group:
                path, mod, scheme = plan.pop(full)  # the float linear is freed once its stand-in replaces it
                w, st = mod.weight.detach(), stats.pop(full, None)  # a Hessian is freed once its last user is done
                if full in want_h:
                    tensors = self._gptq(full, w, scheme, st.hessian)
                    spooled.update({f"{full}.{k}": v for k, v in tensors.items()})
                else:
                    tensors = scheme.quantize(w)
                if full in want_a:
                    tensors["input_scale"] = dynamic_scale(st.amax.float()).reshape(1)
                    self.result._put(f"{full}.input_scale", tensors["input_scale"])
                layer.set_submodule(path, QuantizedLinear(scheme, tensors, mod.bias))
                del mod, w, st
            del stats
        self.result._spool(f"layer{i:05d}", spooled)

        # Each window's input is dropped as its output is made: one set of calibration activations at a time.
        with observe_kv(layer, prefix) if self.policy.kv_cache is not None else nullcontext() as kv:
            for j, pe in enumerate(pos):
                hidden[j] = model.run_layer(layer, hidden[j], pe)
        if kv is not None:
            if not kv.k_amax:
                raise NotImplementedError(f"calibration: --kv-cache fp8 but layer {prefix} has no attention module "
                                          f"(with k_proj and v_proj) whose K/V could be observed")
            for name in kv.k_amax:
                self.result._put(f"{name}.k_scale", dynamic_scale(kv.k_amax[name]).reshape(()))
                self.result._put(f"{name}.v_scale", dynamic_scale(kv.v_amax[name]).reshape(()))
        model.release_layer(i)
        return hidden

    def _gptq(self, full: str, w: torch.Tensor, scheme: W4A16Scheme, H: torch.Tensor) -> dict[str, torch.Tensor]:
        release_free_heap()  # the observation passes' temporaries, before the K x K factorizations
        r = gptq_quantize(w, H, scheme.group_size, scheme.symmetric, self.gptq, full)
        rtn = scheme.dequantize({k: v.to(w.device) for k, v in scheme.quantize(w).items()})
        e_rtn = weighted_error(w, rtn, H)
        self.gptq_errors.append(weighted_error(w, r.dequant, H) / e_rtn if e_rtn > 0 else 1.0)
        return r.tensors
