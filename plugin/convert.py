"""`cublade convert`: a Hugging Face safetensors checkpoint -> a cublade checkpoint, streaming.

Memory: one source tensor at a time (each on a mapping of its own, unmapped with it) and its quantization's
temporaries; no shard is held, source or output. The output's tensor list (names, shapes, dtypes) is known
from the plan before anything is read, so each output shard's layout is fixed up front and each tensor is
written to its place in its shard file as it is produced (ShardWriter).
Crash safety: everything is written into a temporary directory beside OUT and renamed to OUT only when
complete; on any error (or Ctrl-C) the temporary directory is removed, and a directory left by a killed run
is removed by the next run. OUT itself never holds a half checkpoint.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from cublade.checkpoint import (DTYPES, FLOAT_DTYPES, INDEX_NAME, CheckpointError, iter_tensors,
                                safetensors_header, tensor_infos)
from cublade.config import Policy, UnsupportedShape, to_quantization_config
from cublade.config import compressed_tensors as ct_format
from cublade.config.experts import ExpertLayout
from cublade.config.format import QuantMethod
from cublade.convert_checks import (check_layers_complete, check_lm_head, check_output_target,
                                    check_quantizes_something, check_source_values, check_values,
                                    clean_after_killed_runs, output_lock, say)
from cublade.convert_experts import check_router_policy, expert_tensor_infos, expert_tensors
from cublade.numerics.exact import abs_amax

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt)$|.*\.safetensors\.index\.json$|.*\.bin\.index\.json$")
TMP_MARK = ".cublade-tmp-"
OLD_MARK = ".cublade-old-"


@dataclass
class Plan:
    """What the converter will do with each module, decided before anything is written."""
    quantize: dict[str, object] = field(default_factory=dict)  # module -> scheme
    skipped: dict[str, str] = field(default_factory=dict)  # module -> reason (shape not supported)
    linear_modules: list[str] = field(default_factory=list)  # every module with a 2-D `.weight`
    n_tensors: int = 0
    tensors: list[tuple[str, tuple[int, ...], str]] = field(default_factory=list)  # (name, shape, dtype), in order


def plan_conversion(src: Path, policy: Policy, skip_unsupported: bool, layout=None) -> Plan:
    """Check every tensor's name, shape and dtype against the policy without loading any data. `layout`: the
    checkpoint's MoE expert layout (cublade.config.experts.ExpertLayout.from_config), None for a dense model."""
    plan = Plan()
    # MoE experts: fused 3-D tensors are split per expert, expert count and shapes checked (cublade.convert_experts).
    for path, name, shape, dtype in expert_tensor_infos(tensor_infos(src), layout):
        plan.n_tensors += 1
        plan.tensors.append((name, tuple(shape), dtype))
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


def quant_device_checked(device: str | None) -> torch.device | None:
    """The device of `quant_device` (None: the CPU's default path; "auto": the current CUDA device where torch
    sees one, else the CPU), refused at once where it cannot run."""
    if device is None or (device == "auto" and not torch.cuda.is_available()):
        return None
    if device == "auto":
        return torch.device("cuda", torch.cuda.current_device())
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--quant-device {device!r}: not a device name (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--quant-device {device}: this machine has no CUDA GPU that torch can use")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--quant-device {device}: there are {torch.cuda.device_count()} CUDA device(s)")
    return dev


def check_finite(name: str, w: torch.Tensor) -> None:
    if w.numel() and not torch.isfinite(abs_amax(w)):  # one pass; the mask only when it fails
        bad = ~torch.isfinite(w)
        first = [int(i) for i in bad.nonzero()[0]]
        raise CheckpointError(f"{name}: {int(bad.sum())} NaN/Inf value(s) (first at index {first}); "
                              f"refusing to quantize a non-finite weight")


class ShardWriter:
    """Writes output shards of at most max_bytes each, straight to disk; names them model-0000i-of-0000n at the end.

    `specs`: every tensor the conversion will write, (name, shape, dtype) in the order it writes them, known
    before any data is read (_output_specs). So the shards are laid out at the start: tensors fill a shard in
    that order until the next one would take it past max_bytes (one larger than max_bytes gets a shard of its
    own), and each shard has the layout safetensors' save_file gives the same tensors (safetensors_header).
    A shard's file is created with its header when its first tensor comes, each tensor is written at its
    offset as it comes, and the file is closed after its last one: no shard is held in memory."""

    def __init__(self, out_dir: Path, max_bytes: int, specs: list[tuple[str, tuple[int, ...], torch.dtype]]):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        shards: list[list] = []
        current, size = [], 0
        for name, shape, dtype in specs:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            if current and size + nbytes > max_bytes:
                shards.append(current)
                current, size = [], 0
            current.append((name, tuple(shape), dtype))
            size += nbytes
        if current:
            shards.append(current)
        self.files = [(out_dir / f"part-{i:05d}.safetensors", [n for n, _, _ in shard]) for i, shard in
                      enumerate(shards, 1)]
        self.headers, self.where, self.left = [], {}, [len(shard) for shard in shards]
        for i, shard in enumerate(shards):
            header, offsets = safetensors_header(shard, {"format": "pt"})
            self.headers.append(header)
            for name, shape, dtype in shard:
                if name in self.where:
                    raise CheckpointError(f"{name}: the conversion would write this tensor twice")
                self.where[name] = (i, offsets[name], shape, dtype)
        self.fds: dict[int, int] = {}

    def add(self, name: str, t: torch.Tensor) -> None:
        i, offset, shape, dtype = self.where.pop(name, (None, 0, None, None))
        if i is None or tuple(t.shape) != shape or t.dtype != dtype:
            raise RuntimeError(f"cublade convert: {name} {list(t.shape)} {t.dtype} is not the planned "
                               f"{list(shape) if shape is not None else 'nothing'} {dtype or ''}")
        if i not in self.fds:
            self.fds[i] = os.open(self.files[i][0], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            _pwrite_all(self.fds[i], self.headers[i], 0)
        _pwrite_all(self.fds[i], t.contiguous().reshape(-1).view(torch.uint8).numpy(), offset)
        self.left[i] -= 1
        if not self.left[i]:
            os.close(self.fds.pop(i))

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}

    def finish(self) -> None:
        self.close()
        if self.where:
            raise RuntimeError(f"cublade convert: {len(self.where)} planned tensor(s) not written, e.g. "
                               f"{next(iter(self.where))}")
        n = len(self.files)
        weight_map, total = {}, 0
        for i, (path, names) in enumerate(self.files, 1):
            final = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
            path.rename(self.out_dir / final)
            (self.out_dir / final).chmod(0o644)  # whatever the umask: a checkpoint is for sharing
            total += (self.out_dir / final).stat().st_size
            weight_map.update({k: final for k in names})
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _pwrite_all(fd: int, data, offset: int) -> None:
    view, done = memoryview(data).cast("B"), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _output_specs(plan: Plan, dtype: torch.dtype | None, kv_scales: list[str], out_layout=None
                  ) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor convert writes, in the order it writes them: each source tensor
    (as the plan lists them, MoE experts already split) unchanged, cast to `dtype` if float, or replaced by
    its scheme's tensors (scheme.tensor_specs, or `out_layout.specs` for another output format), then the
    KV-cache scales."""
    specs = []
    for name, shape, st_dtype in plan.tensors:
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        scheme = plan.quantize.get(module)
        if scheme is None:
            keep = DTYPES[st_dtype]
            specs.append((name, shape, dtype if dtype is not None and keep.is_floating_point else keep))
        else:
            tensor_specs = scheme.tensor_specs(*shape) if out_layout is None else out_layout.specs(scheme, *shape)
            specs += [(f"{module}.{s}", tuple(sh), dt) for s, (sh, dt) in tensor_specs.items()]
    return specs + [(name, (), torch.float32) for name in kv_scales]


def _remove_stale_tmp_dirs(out: Path) -> None:
    for line in clean_after_killed_runs(out, TMP_MARK, OLD_MARK):
        say(line)


def _write_config(src: Path, cfg: dict, tmp: Path, policy: Policy, plan: Plan, dtype: torch.dtype | None,
                  calib_info: dict | None, out_layout=None) -> None:
    if out_layout is not None:
        qc = out_layout.config(policy, plan.quantize, plan.linear_modules)
    else:
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
    if src.is_file():
        raise CheckpointError(f"{src} is a file; the checkpoint is its directory ({src.parent})")
    if not path.is_file():
        raise CheckpointError(f"{src} has no config.json: not a Hugging Face checkpoint directory"
                              if src.is_dir() else f"checkpoint directory {src} does not exist")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{path}: not a JSON text ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    if "quantization_config" in cfg:
        method = cfg["quantization_config"].get("quant_method", "?")
        raise CheckpointError(f"{path} already has a quantization_config (quant_method {method!r}); "
                              f"cublade convert takes an unquantized checkpoint")
    return cfg


def convert(src, out, policy: Policy, *, overwrite: bool = False, **options) -> Path:
    """Convert the checkpoint at `src` with `policy` into a new directory `out` (options: _convert_locked); returns
    `out`. OUT must be new, or with `overwrite` a directory cublade convert wrote; one conversion to OUT at a time
    (a lock file beside it)."""
    src, out = Path(src), Path(out)
    output_layout(options.get("out_format", QuantMethod.CUBLADE.value), policy)  # refused before anything is written
    if out.parent.is_dir():
        _remove_stale_tmp_dirs(out)  # first: a killed --overwrite run may have left OUT moved aside
    check_output_target(src, out, overwrite)
    with output_lock(out):
        return _convert_locked(src, out, policy, overwrite=overwrite, **options)


def _convert_locked(src, out, policy: Policy, *, overwrite: bool = False,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, skip_unsupported: bool = False,
            dtype: torch.dtype | None = None, calib_text=None, calib_tokens: int | None = None,
            calib_lines: slice | None = None, progress: bool | None = None,
            allow_quantized_router: bool = False, calib_device: str | None = None,
            out_format: str = QuantMethod.CUBLADE.value, quant_device: str | None = None) -> Path:
    """Convert the checkpoint at `src` with `policy` into a new directory `out`; returns `out`.

    out_format: "cublade" (cublade's checkpoint format) or "compressed-tensors" (what vLLM's own
    compressed-tensors method loads, for the policies it can express: cublade.config.compressed_tensors).

    dtype: cast the tensors that stay unquantized (embeddings, norms, biases, ignored layers) to this dtype
    (None keeps the source's). calib_*: run calibration (GPTQ for w4a16, static FP8 input scales, FP8
    KV-cache scales) over that text first (cublade.calib). quant_device: where each weight's round-to-nearest
    quantization runs (None: on the CPU; "auto", the command line's default: the GPU where torch sees one); a
    weight moves there, one at a time, and its tensors come back."""
    src, out = Path(src), Path(out)
    qdev = quant_device_checked(quant_device)
    out_layout = output_layout(out_format, policy)
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
    check_layers_complete((name for name, _, _ in plan.tensors), cfg)
    check_quantizes_something(plan, policy, policy.kv_cache is not None)
    check_lm_head(plan, policy, cfg)
    if out_layout is not None:  # the format's own rules, and a config it can write, before anything is written
        out_layout.check_plan(plan, skip_unsupported, experts=layout is not None)
        out_layout.config(policy, plan.quantize, plan.linear_modules)

    calib = None
    if calib_text is not None:
        from cublade.calib import calibrate  # heavy: only when asked for

        check_source_values(src, lambda name: dtype if _module(name) not in plan.quantize else None)

        calib = calibrate(src, policy, Path(calib_text), calib_tokens, lines=calib_lines, device=calib_device)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}{TMP_MARK}{os.getpid()}"
    tmp.mkdir()
    writer = None
    try:
        kv_scales = _kv_scale_names(plan) if policy.kv_cache is not None else []
        writer = ShardWriter(tmp, max_shard_bytes, _output_specs(plan, dtype, kv_scales, out_layout))
        quantize = _WeightQuantizer(qdev)
        bar = tqdm(total=plan.n_tensors, desc=f"convert {policy.preset}", unit="tensor",
                   disable=None if progress is None else not progress)  # None: off unless stderr is a tty
        for name, t in expert_tensors(iter_tensors(src), layout):
            module = name[: -len(".weight")] if name.endswith(".weight") else None
            scheme = plan.quantize.get(module)
            if scheme is None:
                check_values(name, t, dtype)
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                writer.add(name, t)
            else:
                q_tensors = quantize(name, module, t, scheme, calib)
                if out_layout is not None:
                    q_tensors = out_layout.tensors(scheme, q_tensors, *t.shape)
                for suffix, q in q_tensors.items():
                    writer.add(f"{module}.{suffix}", q)
            bar.update()
            del t
        if policy.kv_cache is not None:
            for name, scale in _kv_scales(plan, calib).items():
                writer.add(name, scale)
        bar.close()
        if qdev is not None and qdev.type == "cuda":
            torch.cuda.empty_cache()  # a vLLM engine started next (another process) sees the GPU's memory free
        writer.finish()
        _write_config(src, cfg, tmp, policy, plan, dtype, calib.info if calib is not None else None, out_layout)
        if out.exists() and not overwrite:
            raise FileExistsError(f"{out} appeared while converting; it is left as it is (pass --overwrite to "
                                  f"replace a cublade output directory)")
        if out.exists():
            old = out.parent / f".{out.name}{OLD_MARK}{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException as e:
        if writer is not None:
            writer.close()
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno is not None and e.filename is None:  # os.pwrite names no file
            e.filename = str(tmp)
        raise
    return out


def output_layout(out_format: str, policy: Policy):
    """None for cublade's own format; the layout object of another format, once `policy` is checked against it
    (before anything is read or written)."""
    fmt = QuantMethod.lookup(out_format, "output format", "--format")
    if fmt is QuantMethod.CUBLADE:
        return None
    ct_format.check_expressible(policy)
    return ct_format.CompressedTensorsLayout()
def _module(name: str) -> str | None:
    return name[: -len(".weight")] if name.endswith(".weight") else None


class _WeightQuantizer:
    """`_quantized` of a source weight (on the CPU) run on `qdev` (None: the CPU), its tensors back on the CPU. A
    weight that does not fit the GPU's free memory is quantized on the CPU instead (the same bytes:
    tests/gpu/test_convert_on_gpu.py), said once per conversion."""

    def __init__(self, qdev: torch.device | None):
        self.qdev, self.fell_back = qdev, False

    def __call__(self, name: str, module: str, t: torch.Tensor, scheme, calib) -> dict[str, torch.Tensor]:
        if self.qdev is not None:
            try:
                w = t.to(self.qdev)
                check_finite(name, w)
                return {k: v.cpu() for k, v in _quantized(module, w, scheme, calib).items()}
            except torch.cuda.OutOfMemoryError:
                pass
            w = None  # the failed try's tensors, given back before the CPU takes this weight
            if self.qdev.type == "cuda":
                torch.cuda.empty_cache()
            if not self.fell_back:
                self.fell_back = True
                tqdm.write(f"cublade convert: {name} does not fit the free memory of {self.qdev}: it, and any "
                           f"weight after it that does not, is quantized on the CPU (the same bytes)", file=sys.stderr)
        check_finite(name, t)
        return _quantized(module, t, scheme, calib)


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


def _kv_scale_names(plan: Plan) -> list[str]:
    """`<attention>.k_scale` / `.v_scale` for every attention module (the parent of a `k_proj`)."""
    attns = sorted({m.rsplit(".", 1)[0] for m in plan.linear_modules if m.endswith(".k_proj")})
    if not attns:
        raise ValueError("--kv-cache fp8: found no attention modules (no '*.k_proj' linear) in the checkpoint")
    return [f"{attn}.{which}" for attn in attns for which in ("k_scale", "v_scale")]


def _kv_scales(plan: Plan, calib) -> dict[str, torch.Tensor]:
    out = {}
    for name in _kv_scale_names(plan):
        v = calib.get(name) if calib is not None else None
        if v is None:
            raise ValueError(f"--kv-cache fp8: calibration produced no {name}")
        out[name] = v.float().reshape(())
    return out
