"""Shared timing and printing for benchmarks/bench_*.py.

Timing: the median of `triton.testing.do_bench` (CUDA events around each call, warm-up first; do_bench
zeroes a 256 MB buffer before every call, so each call starts with a cold L2 and inputs stream from DRAM)
unless a bench asks for CUDA-graph replay (`graph=True`: launch gaps removed, for the
small sizes vLLM serves from CUDA graphs). Bandwidth: explicit bytes read + bytes written once, over the
median. The copy ceiling is measured in the same run (a device-to-device copy, bytes read + written).

Every bench prints a header (GPU, versions, copy ceiling), then one markdown row per (op, size) and, when
CUBLADE_BENCH_JSON is set, appends the same rows as JSON lines to that file."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass, field

import torch

REFERENCE_COPY_TBPS = 4.28  # the H200's device-to-device copy (bytes read + written)


def vllm_ops():
    """vLLM's `_custom_ops` (the baselines), or None with the reason printed."""
    try:
        from vllm import _custom_ops as ops  # noqa: PLC0415
        import vllm  # noqa: PLC0415

        return ops, vllm.__version__
    except Exception as e:  # noqa: BLE001  (ImportError, or vLLM failing to initialise on this machine)
        print(f"baseline: vLLM not importable ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
        return None, None


def versions(vllm_version: str | None = None) -> dict:
    import triton  # noqa: PLC0415

    p = torch.cuda.get_device_properties(0)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": p.name, "sms": p.multi_processor_count, "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": triton.__version__, "vllm": vllm_version or "not importable", "python": platform.python_version(),
    }


def bench_us(fn, *, graph: bool = False, warmup_ms: int = 25, rep_ms: int = 200) -> float:
    """Median time of fn() in microseconds."""
    import triton.testing  # noqa: PLC0415

    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3


def graphed(fn):
    """fn as one CUDA graph replay: the kernels it launches, captured once after a warm-up call on a side stream, so a
    timing sees their GPU time back to back (as vLLM's CUDA-graphed decode runs them, programmatic dependent launches
    included) without the host's launch gaps between them. The graph's outputs are reused by every replay. Unlike
    bench_us(graph=True), which replays fn many times inside one graph (L2 warm from the previous call), timing
    bench_us(graphed(fn)) keeps do_bench's L2 clear before every replay: weights that fit L2 still come from DRAM."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def rel_err(c: torch.Tensor, ref: torch.Tensor) -> float:
    """mean |c - ref| / mean |ref|: the GEMM benches' accuracy measure."""
    return ((c.float() - ref).abs().mean() / ref.abs().mean()).item()


_COPY_TBPS: float | None = None


def copy_ceiling_tbps() -> float:
    """Device-to-device copy of 2 GiB (bytes read + written) / median time, once per process."""
    global _COPY_TBPS
    if _COPY_TBPS is None:
        src = torch.randn(512 * 2**20, device="cuda")  # 2 GiB fp32
        dst = torch.empty_like(src)
        us = bench_us(lambda: dst.copy_(src))
        _COPY_TBPS = 2 * src.numel() * 4 / (us * 1e-6) / 1e12
        del src, dst
        torch.cuda.empty_cache()
    return _COPY_TBPS


@dataclass
class Row:
    op: str
    size: str
    cublade_us: float
    baseline: str = ""
    baseline_us: float | None = None
    bytes: int = 0
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def tbps(self) -> float:
        return self.bytes / (self.cublade_us * 1e-6) / 1e12

    @property
    def ratio(self) -> float | None:
        """baseline time / cublade time: > 1 means cublade is faster."""
        return None if self.baseline_us is None else self.baseline_us / self.cublade_us


def header(title: str, vllm_version: str | None) -> dict:
    v = versions(vllm_version)
    ceil = copy_ceiling_tbps()
    print(f"\n## {title}")
    print(f"{v['date']} | {v['gpu']} ({v['sms']} SMs) | torch {v['torch']} (CUDA {v['cuda']}) | "
          f"triton {v['triton']} | vLLM {v['vllm']}")
    print(f"copy ceiling measured now: {ceil:.2f} TB/s (reference {REFERENCE_COPY_TBPS} TB/s)")
    print("| op | size | cublade us | baseline | baseline us | ratio | TB/s | % of copy | note |")
    print("|---|---|---|---|---|---|---|---|---|")
    return v


def emit(row: Row) -> None:
    ceil = copy_ceiling_tbps()
    b_us = "-" if row.baseline_us is None else f"{row.baseline_us:.1f}"
    ratio = "-" if row.ratio is None else f"{row.ratio:.2f}x"
    print(f"| {row.op} | {row.size} | {row.cublade_us:.1f} | {row.baseline or '-'} | {b_us} | {ratio} | "
          f"{row.tbps:.2f} | {100 * row.tbps / ceil:.0f}% | {row.note} |", flush=True)
    path = os.environ.get("CUBLADE_BENCH_JSON")
    if path:
        with open(path, "a") as f:
            d = asdict(row)
            d.update(tbps=row.tbps, ratio=row.ratio, copy_tbps=ceil)
            f.write(json.dumps(d) + "\n")


def require_op(bench: str, op_name: str):
    """torch.ops.cublade.<op_name>, after printing the GPU and versions; exits saying why without a CUDA GPU or
    the built extension."""
    from cublade.ops._dispatch import extension_load_error, extension_loaded

    if not torch.cuda.is_available() or not extension_loaded():
        raise SystemExit(f"{bench}: needs a GPU and the built extension ({extension_load_error()})")
    v = versions()
    print(f"GPU {v['gpu']}, torch {v['torch']}, triton {v['triton']}, python {v['python']}")
    return getattr(torch.ops.cublade, op_name)


def require_gpu() -> None:
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to benchmark")
        sys.exit(0)


def vllm_single_process_state() -> None:
    """vLLM's parameter classes read the tensor-parallel rank: set up a one-process group once, under a current
    VllmConfig (vLLM 0.26's initialize_model_parallel reads it), which stays current for the kernels' setup
    (the benches that build vLLM's linear kernels as baselines)."""
    import socket

    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _VLLM_CONTEXT.enter_context(set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device=device))))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ps.init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
    ps.initialize_model_parallel(1, 1)


_VLLM_CONTEXT = contextlib.ExitStack()  # the bench's VllmConfig, current until the process ends


def write_json(path: str | None, rows: list, **meta) -> None:
    """A bench's rows with the GPU, torch and `meta` (baseline notes, kernels not run) as JSON at `path` (if given)."""
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, **meta, "rows": rows}, f,
                      indent=1)


def stand_in_layer(tensors: dict, scheme, N: int, K: int) -> torch.nn.Module:
    """What cublade.vllm.linear leaves for a kernel class: the scheme's tensors (copies) as Parameters, sizes (N, K),
    bf16 activations, no bias."""
    layer = torch.nn.Module()
    for name, v in tensors.items():
        layer.register_parameter(name, torch.nn.Parameter(v.clone(), requires_grad=False))
    layer.output_size_per_partition = layer.output_size = N
    layer.input_size_per_partition = layer.input_size = K
    layer.params_dtype, layer.cublade_scheme, layer.bias = torch.bfloat16, scheme, None
    return layer


def measured_linear(module: str, cls: str, env: str, value: str, layer: torch.nn.Module):
    """(fn(x), the ranges it measured, in the log's words) for one of cublade's measured kernel classes
    (cublade.vllm.kernels.measured: `cls` of `module`) built on `layer` with `env`=`value` (the class reads its kernels
    when built): cublade's op and the named kernels, the shape timed as at load and each call on the fastest for its
    M; or (None, why) where it cannot be built (no vLLM, a kernel that cannot take the shape or fails here)."""
    import importlib
    from unittest.mock import patch

    try:
        vllm_single_process_state()
        with patch.dict(os.environ, {env: value}):
            kernel_cls = getattr(importlib.import_module(module), cls)
            ok, why = kernel_cls.can_implement(layer)
            if not ok:
                return None, why
            kernel = kernel_cls(layer)
    except Exception as e:  # noqa: BLE001  (any failure to build it means: no column)
        return None, f"{type(e).__name__}: {e}"
    return (lambda x: kernel.apply(layer, x, None)), kernel.said()


def humming_linear(kernel_cls, config, layer: torch.nn.Module, what: str):
    """(fn(x), None) for one of vLLM's Humming linear kernel classes prepared on `layer` as vLLM does at load time, or
    (None, why it cannot run here): the humming package missing, the GPU refused, or the preparation failing."""
    from vllm.utils.import_utils import has_humming

    if not has_humming():
        return None, "the humming package is not installed (pip install humming-kernels)"
    ok, why = kernel_cls.is_supported()
    if not ok:
        return None, f"vLLM's Humming {what}: {why}"
    try:
        k = kernel_cls(config)
        k.process_weights_after_loading(layer)
    except Exception as e:  # noqa: BLE001  (any failure of the baseline's preparation: reported, not fatal)
        return None, f"vLLM's Humming {what} failed to prepare the weights ({type(e).__name__}: {e})"
    return (lambda x: k.apply_weights(layer, x)), None


def print_kernel_table(rows: list[dict], ours: str, title: str, reference: str) -> None:
    """The GEMM benches' table: one line per (shape, M) row ({"K", "N", "M", "weight_bytes", "us": {kernel: us},
    "errors_m16": {kernel: error}}), each kernel's time, its TB/s (weight bytes / time) and x = its time / `ours`'s;
    then the accuracy at the first M against `reference`."""
    names = list(rows[0]["us"])
    print(f"\n{title}; median us (do_bench, L2 cleared); TB/s = weight bytes / time (copy ceiling "
          f"~{REFERENCE_COPY_TBPS} TB/s); x = time / {ours}'s")
    print(f"{'K x N':>12} {'M':>5} " + " ".join(f"{n:>28}" for n in names))
    for r in rows:
        us = r["us"]
        cells = []
        for n in names:
            tbs = r["weight_bytes"] / us[n] / 1e6
            ratio = f" {us[n] / us[ours]:5.2f}x" if ours in us and n != ours else ""
            cells.append(f"{us[n]:9.1f} {tbs:5.2f}TB/s{ratio}".rjust(28))
        print(f"{r['K']:>5}x{r['N']:<6} {r['M']:>5} " + " ".join(cells))
    print(f"accuracy at M={rows[0]['M']} (mean|C-ref|/mean|ref| vs {reference}): " + " | ".join(
        f"{r['K']}x{r['N']}: " + ", ".join(f"{k} {v:.2e}" for k, v in r["errors_m16"].items())
        for r in rows if r["M"] == rows[0]["M"]))
