"""`cublade convert`: a Hugging Face safetensors checkpoint -> a cublade checkpoint, streaming.

Memory: one source tensor at a time (source shards are memory-mapped one at a time) plus the output shard
being filled, so the peak stays near one shard's size whatever the model's size.
Crash safety: everything is written into a temporary directory beside OUT and renamed to OUT only when
complete; on any error (or Ctrl-C) the temporary directory is removed, and a directory left by a killed run
is removed by the next run. OUT itself never holds a half checkpoint.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from cublade.checkpoint import FLOAT_DTYPES, INDEX_NAME, CheckpointError, iter_tensors, tensor_infos
from cublade.config import Policy, UnsupportedShape, to_quantization_config
from cublade.config.experts import ExpertLayout
from cublade.convert_experts import check_router_policy, expert_tensor_infos, expert_tensors

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt)$|.*\.safetensors\.index\.json$|.*\.bin\.index\.json$")
TMP_MARK = ".cublade-tmp-"


@dataclass
class Plan:
    """What the converter will do with each module, decided before anything is written."""
    quantize: dict[str, object] = field(default_factory=dict)  # module -> scheme
    skipped: dict[str, str] = field(default_factory=dict)  # module -> reason (shape not supported)
    linear_modules: list[str] = field(default_factory=list)  # every module with a 2-D `.weight`
    n_tensors: int = 0


def plan_conversion(src: Path, policy: Policy, skip_unsupported: bool, layout=None) -> Plan:
    """Check every tensor's name, shape and dtype against the policy without loading any data. `layout`: the
    checkpoint's MoE expert layout (cublade.config.experts.ExpertLayout.from_config), None for a dense model."""
    plan = Plan()
    # MoE experts: fused 3-D tensors are split per expert, expert count and shapes checked (cublade.convert_experts).
    for path, name, shape, dtype in expert_tensor_infos(tensor_infos(src), layout):
        plan.n_tensors += 1
        if not name.endswith(".weight"):
            continue
        module = name[: -len(".weight")]
        if len(shape) != 2:  # norms, 1-D; a linear's weight is [out_features, in_features]
            continue
        plan.linear_modules.append(module)
        scheme = policy.scheme_for(module)
        if scheme is None:
            continue
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{name}: dtype {dtype} in {path.name}; cublade convert quantizes float "
                                  f"weights ({', '.join(FLOAT_DTYPES)}) — is this checkpoint already quantized?")
        try:
            scheme.check_shape(module, *shape)
        except UnsupportedShape as e:
            if not skip_unsupported:
                raise UnsupportedShape(f"{e} (use --skip-unsupported to leave such layers unquantized)") from None
            plan.skipped[module] = str(e)
            continue
        plan.quantize[module] = scheme
    return plan


def check_finite(name: str, w: torch.Tensor) -> None:
    bad = ~torch.isfinite(w)
    if bad.any():
        first = [int(i) for i in bad.nonzero()[0]]
        raise CheckpointError(f"{name}: {int(bad.sum())} NaN/Inf value(s) (first at index {first}); "
                              f"refusing to quantize a non-finite weight")


class ShardWriter:
    """Fills output shards up to max_bytes each; names them model-0000i-of-0000n at the end."""

    def __init__(self, out_dir: Path, max_bytes: int):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.bytes = 0
        self.files: list[tuple[Path, list[str]]] = []

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.buffer and self.bytes + nbytes > self.max_bytes:
            self.flush()
        self.buffer[name] = t.contiguous()
        self.bytes += nbytes

    def flush(self) -> None:
        if not self.buffer:
            return
        path = self.out_dir / f"part-{len(self.files) + 1:05d}.safetensors"
        save_file(self.buffer, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.buffer)))
        self.buffer, self.bytes = {}, 0

    def finish(self) -> None:
        self.flush()
        n = len(self.files)
        weight_map, total = {}, 0
        for i, (path, names) in enumerate(self.files, 1):
            final = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
            path.rename(self.out_dir / final)
            (self.out_dir / final).chmod(0o644)  # safetensors writes 0600; a checkpoint is for sharing
            total += (self.out_dir / final).stat().st_size
            weight_map.update({k: final for k in names})
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _remove_stale_tmp_dirs(out: Path) -> None:
    for d in out.parent.glob(f".{out.name}{TMP_MARK}*"):
        pid = d.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_config(src: Path, cfg: dict, tmp: Path, policy: Policy, plan: Plan, dtype: torch.dtype | None,
                  calib_info: dict | None) -> None:
    if plan.skipped:
        policy = policy.with_ignore(*(re.escape(m) for m in sorted(plan.skipped)))
    qc = to_quantization_config(policy)
    if calib_info:
        qc["calibration"] = calib_info
    cfg["quantization_config"] = qc
    if dtype is not None:
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in sorted(src.iterdir()):  # tokenizer, generation config, license, ...
        if f.is_file() and f.name != "config.json" and not WEIGHT_FILES.fullmatch(f.name):
            shutil.copy2(f, tmp / f.name)


def _source_config(src: Path) -> dict:
    path = src / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{src} has no config.json: not a Hugging Face checkpoint directory"
                              if src.is_dir() else f"checkpoint directory {src} does not exist")
    cfg = json.loads(path.read_text())
    if "quantization_config" in cfg:
        method = cfg["quantization_config"].get("quant_method", "?")
        raise CheckpointError(f"{path} already has a quantization_config (quant_method {method!r}); "
                              f"cublade convert takes an unquantized checkpoint")
    return cfg


def convert(src, out, policy: Policy, *, overwrite: bool = False,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, skip_unsupported: bool = False,
            dtype: torch.dtype | None = None, calib_text=None, calib_tokens: int | None = None,
            calib_lines: slice | None = None, progress: bool | None = None,
            allow_quantized_router: bool = False, calib_device: str | None = None) -> Path:
    """Convert the checkpoint at `src` with `policy` into a new directory `out`; returns `out`.

    dtype: cast the tensors that stay unquantized (embeddings, norms, biases, ignored layers) to this dtype
    (None keeps the source's). calib_*: run calibration (GPTQ for w4a16, static FP8 input scales, FP8
    KV-cache scales) over that text first (cublade.calib)."""
    src, out = Path(src), Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass --overwrite to replace it")
    if out.resolve() == src.resolve():
        raise ValueError("the output directory must differ from the source checkpoint")
    needs = policy.needs_calibration()
    if needs and calib_text is None:
        raise ValueError(f"preset {policy.preset!r} needs calibration data for {' and '.join(needs)}: "
                         f"pass --calib-text FILE (and optionally --calib-tokens N)")
    cfg = _source_config(src)
    layout = ExpertLayout.from_config(cfg) if isinstance(cfg, dict) else None
    plan = plan_conversion(src, policy, skip_unsupported, layout)
    check_router_policy(policy, layout, allow_quantized_router, plan.linear_modules)

    calib = None
    if calib_text is not None:
        from cublade.calib import calibrate  # heavy: only when asked for

        calib = calibrate(src, policy, Path(calib_text), calib_tokens, lines=calib_lines, device=calib_device)

    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(out)
    tmp = out.parent / f".{out.name}{TMP_MARK}{os.getpid()}"
    tmp.mkdir()
    try:
        writer = ShardWriter(tmp, max_shard_bytes)
        bar = tqdm(total=plan.n_tensors, desc=f"convert {policy.preset}", unit="tensor",
                   disable=None if progress is None else not progress)  # None: off unless stderr is a tty
        for name, t in expert_tensors(iter_tensors(src), layout):
            module = name[: -len(".weight")] if name.endswith(".weight") else None
            scheme = plan.quantize.get(module)
            if scheme is None:
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                writer.add(name, t)
            else:
                check_finite(name, t)
                for suffix, q in _quantized(module, t, scheme, calib).items():
                    writer.add(f"{module}.{suffix}", q)
            bar.update()
            del t
        if policy.kv_cache is not None:
            for name, scale in _kv_scales(plan, calib).items():
                writer.add(name, scale)
        bar.close()
        writer.finish()
        _write_config(src, cfg, tmp, policy, plan, dtype, calib.info if calib is not None else None)
        if out.exists():
            old = out.parent / f".{out.name}.cublade-old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _quantized(module: str, w: torch.Tensor, scheme, calib) -> dict[str, torch.Tensor]:
    """The scheme's tensors for one weight: the calibrated ones (GPTQ weights, static input scales) where
    calibration produced them, round-to-nearest otherwise."""
    specs = scheme.tensor_specs(*w.shape)
    weight_specs = [s for s in specs if s != "input_scale"]
    got = {s: calib.get(f"{module}.{s}") for s in specs} if calib is not None else {}
    if weight_specs and all(got.get(s) is not None for s in weight_specs):
        tensors = {s: got[s] for s in weight_specs}
    else:
        tensors = scheme.quantize(w)
    if "input_scale" in specs:
        if got.get("input_scale") is None:
            raise ValueError(f"{module}: scheme {scheme.kind} has static activations but calibration produced "
                             f"no {module}.input_scale")
        tensors["input_scale"] = got["input_scale"].float().reshape(1)
    return tensors


def _kv_scales(plan: Plan, calib) -> dict[str, torch.Tensor]:
    """`<attention>.k_scale` / `.v_scale` for every attention module (the parent of a `k_proj`)."""
    attns = sorted({m.rsplit(".", 1)[0] for m in plan.linear_modules if m.endswith(".k_proj")})
    if not attns:
        raise ValueError("--kv-cache fp8: found no attention modules (no '*.k_proj' linear) in the checkpoint")
    out = {}
    for attn in attns:
        for which in ("k_scale", "v_scale"):
            v = calib.get(f"{attn}.{which}") if calib is not None else None
            if v is None:
                raise ValueError(f"--kv-cache fp8: calibration produced no {attn}.{which}")
            out[f"{attn}.{which}"] = v.float().reshape(())
    return out
