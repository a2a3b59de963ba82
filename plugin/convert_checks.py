"""The converter's checks before it writes: the output directory (what may be replaced, one conversion at a time),
the source's completeness and values, and options that would quantize nothing. Each failure is one line naming
the path, tensor or option and the rule; nothing is written before they pass, and nothing of the user's is
replaced or removed."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import sys
from collections import Counter
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

import torch

from cublade.checkpoint import CheckpointError, iter_tensors
from cublade.numerics.exact import abs_amax

LOCK_MARK = ".cublade-lock"
CHUNK = 1 << 24  # elements per check: bounds the NaN / Inf masks' temporaries to 16 MiB


# ---- the output directory ------------------------------------------------------------------------------------

def why_not_cublade_output(d: Path) -> str | None:
    """None when `d` is a directory cublade convert wrote (config.json whose quantization_config has cublade's
    quant_method); else why not. Only such a directory may be replaced by --overwrite."""
    from cublade.config import QUANT_METHOD

    cfg = d / "config.json"
    if not cfg.is_file():
        return "it has no config.json"
    try:
        qc = json.loads(cfg.read_text(encoding="utf-8")).get("quantization_config")
    except (ValueError, AttributeError) as e:
        return f"its config.json is not a JSON object ({e})"
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != QUANT_METHOD:
        return f"its config.json has no quantization_config with quant_method {QUANT_METHOD!r}"
    return None


def check_output_target(src: Path, out: Path, overwrite: bool) -> None:
    """OUT must be new, or (with --overwrite) a cublade output directory that does not hold the source."""
    if out.parent.exists() and not out.parent.is_dir():
        raise NotADirectoryError(f"{out.parent} is a file; OUT's parent must be a directory")
    if out.exists() or out.is_symlink():
        if not overwrite:
            what = "a directory" if out.is_dir() else "a file"
            raise FileExistsError(f"{out} already exists ({what}); pass --overwrite to replace a cublade output "
                                  f"directory")
        why = "it is a file" if not out.is_dir() else why_not_cublade_output(out)
        if why is not None:
            raise FileExistsError(f"--overwrite replaces only a directory cublade convert wrote, and {out} is not one "
                                  f"({why}); move or remove it yourself")
    if out.resolve() == src.resolve():
        raise ValueError("the output directory must differ from the source checkpoint")
    if src.resolve().is_relative_to(out.resolve()):
        raise ValueError(f"OUT {out} holds the source checkpoint {src}; choose an OUT outside it")


@contextmanager
def output_lock(out: Path):
    """Hold `.<OUT>.cublade-lock` beside OUT for the whole conversion: a second conversion to the same OUT fails
    at once, naming the first one's process. The lock file is removed when released, and OUT's parent
    directories that this call created are removed again when the conversion fails."""
    created = [d for d in (out.parent, *out.parent.parents) if not d.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with _locked(out):
            yield
    except BaseException:
        for d in created:  # innermost first; a directory something else wrote into stays
            try:
                d.rmdir()
            except OSError:
                break
        raise


@contextmanager
def _locked(out: Path):
    path = out.parent / f".{out.name}{LOCK_MARK}"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise FileExistsError(f"another cublade convert (pid {holder}) is writing {out}; wait for it to "
                                      f"finish or choose another OUT") from None
            raise
        try:  # the file this process locked may have been removed by a holder that just finished: retry then
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        try:
            os.unlink(path)
        finally:
            os.close(fd)


def clean_after_killed_runs(out: Path, tmp_mark: str, old_mark: str) -> list[str]:
    """Directories a killed conversion to OUT left beside it (its process gone): temporary output is removed; a
    previous OUT moved aside for --overwrite is put back when OUT is missing (the kill came between the two
    renames), else removed. Returns one line per directory, for the user."""
    done = []
    for d in sorted(out.parent.glob(f".{out.name}{tmp_mark}*")) + sorted(out.parent.glob(f".{out.name}{old_mark}*")):
        pid = d.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or _pid_alive(int(pid)):
            continue
        if old_mark in d.name and not out.exists():
            d.rename(out)
            done.append(f"put back {out} from {d.name}, moved aside by a killed --overwrite run (pid {pid})")
        else:
            shutil.rmtree(d, ignore_errors=True)
            done.append(f"removed {d}, left by a killed run (pid {pid})")
    return done


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def say(line: str) -> None:
    print(f"cublade convert: {line}", file=sys.stderr, flush=True)


# ---- the source ----------------------------------------------------------------------------------------------

def check_layers_complete(names: Iterable[str], cfg: dict) -> None:
    """In a model whose layers all hold the same tensors, a layer missing some of them is an incomplete
    checkpoint (a shard or index from another revision). Models with layers of several kinds (dense and MoE,
    several attention types) are not checked: there, a layer's set differs by design."""
    n_layers = cfg.get("num_hidden_layers") if isinstance(cfg, dict) else None
    per_layer: dict[tuple[str, int], set[str]] = {}
    for name in names:
        head, sep, rest = name.partition(".layers.")
        idx, _, suffix = rest.partition(".")
        if sep and idx.isdigit() and suffix:
            per_layer.setdefault((head, int(idx)), set()).add(suffix)
    for head in sorted({h for h, _ in per_layer}):
        layers = {i: s for (h, i), s in per_layer.items() if h == head}
        if isinstance(n_layers, int) and head == "model":
            absent = [i for i in range(n_layers) if i not in layers]
            if absent:
                raise CheckpointError(f"{head}.layers.{absent[0]}: no tensors in the checkpoint, and config.json has "
                                      f"num_hidden_layers={n_layers}")
        common, _ = Counter(frozenset(s) for s in layers.values()).most_common(1)[0]
        if any(not s <= common for s in layers.values()):
            continue  # layers of several kinds
        for i in sorted(layers):
            missing = sorted(common - layers[i])
            if missing:
                more = f"; {len(missing)} tensors of this layer are missing" if len(missing) > 1 else ""
                raise CheckpointError(f"{head}.layers.{i}.{missing[0]}: missing from the checkpoint (every other "
                                      f"layer has it{more})")


def check_values(name: str, t: torch.Tensor, out_dtype: torch.dtype | None = None, option: str = "--dtype") -> None:
    """A float tensor the output keeps must be finite, and stay finite in `out_dtype` (the dtype it is written in
    when not quantized)."""
    if not t.is_floating_point():
        return
    flat = t.reshape(-1)
    limit = torch.finfo(out_dtype).max if out_dtype is not None and out_dtype != t.dtype else None
    for start in range(0, flat.numel(), CHUNK):
        chunk = flat[start:start + CHUNK]
        amax = abs_amax(chunk)  # one pass: NaN if a NaN is there, Inf if an Inf is; the masks below only when it fails
        if torch.isfinite(amax) and (limit is None or amax <= limit):
            continue
        bad = ~torch.isfinite(chunk)
        if bad.any():
            first = _index(t, start + int(bad.nonzero()[0, 0]))
            n = int(sum(int((~torch.isfinite(flat[s:s + CHUNK])).sum()) for s in range(0, flat.numel(), CHUNK)))
            raise CheckpointError(f"{name}: {n} NaN/Inf value(s) (first at index {first}); the output keeps this "
                                  f"tensor and its values must be finite")
        if limit is not None:
            over = chunk.abs() > limit
            if over.any():
                k = start + int(over.nonzero()[0, 0])
                raise CheckpointError(f"{name}: value {float(flat[k]):g} at index {_index(t, k)} is outside "
                                      f"{str(out_dtype).removeprefix('torch.')}'s range (max {limit:g}) and would be "
                                      f"Inf in the output ({option} {str(out_dtype).removeprefix('torch.')}); use "
                                      f"{option} auto or bfloat16")


def _index(t: torch.Tensor, flat_index: int) -> list[int]:
    out = []
    for d in reversed(t.shape):
        out.append(flat_index % d)
        flat_index //= d
    return out[::-1]


def check_source_values(src: Path, kept_dtype) -> None:
    """check_values over every tensor of the source, one at a time: run before calibration, so a bad tensor is
    named before minutes of work, not blamed on a layer's Hessian. `kept_dtype(name)`: the dtype the output
    writes that tensor in when unquantized, None when it is quantized or kept as is."""
    for name, t in iter_tensors(src):
        check_values(name, t, kept_dtype(name))
        del t


# ---- options -------------------------------------------------------------------------------------------------

def check_lm_head(plan, policy, cfg: dict) -> None:
    """A quantized lm_head must be a matrix of its own: with tie_word_embeddings vLLM computes the logits from the
    embedding's unquantized weights (and the checkpoint often has no lm_head tensor at all)."""
    tied = cfg.get("tie_word_embeddings", False) or cfg.get("text_config", {}).get("tie_word_embeddings", False)
    heads = [m for m in plan.quantize if m.rsplit(".", 1)[-1] == "lm_head"]
    if tied and (heads or policy.scheme_for("lm_head") is not None):
        raise ValueError(f"{heads[0] if heads else 'lm_head'}: tied to the input embeddings (tie_word_embeddings "
                         f"in config.json), so it cannot be quantized on its own; leave it unquantized (the "
                         f"presets' default)")


def check_quantizes_something(plan, policy, kv_cache: bool) -> None:
    """A conversion that quantizes no layer writes a copy with a quantization_config that describes nothing: the
    options that led there are a mistake."""
    if plan.quantize or kv_cache:
        return
    if not plan.linear_modules:
        raise ValueError("the checkpoint has no linear layers (2-D '*.weight' tensors) to quantize")
    ignored = [m for m in plan.linear_modules if m not in plan.skipped and policy.scheme_for(m) is None]
    parts = []
    if ignored:
        parts.append(f"{len(ignored)} ignored (the policy's ignore list and --ignore)")
    if plan.skipped:
        parts.append(f"{len(plan.skipped)} left unquantized by --skip-unsupported, e.g. "
                     f"{next(iter(plan.skipped.values()))}")
    raise ValueError(f"{policy.preset} would quantize none of the {len(plan.linear_modules)} linear layers: "
                     f"{'; '.join(parts)}")
