"""Which CUDA kernels a call launches: the tests that check a kernel choice (wide vs streaming, K slices) read it
here."""
from __future__ import annotations

import re

import torch


def kernels_run(fn) -> list[str]:
    """Names of the CUDA kernels fn() launches, in launch order (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def kernel_grids(fn) -> list[tuple[str, tuple[int, int, int]]]:
    """(name, grid) of each CUDA kernel fn() launches, in launch order, from the profiler's trace (its kernel events
    carry the launch's grid)."""
    import json
    import tempfile
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    return [(e["name"], tuple(e["args"]["grid"])) for e in kernels]


# The streaming kernel's K slices per chunk: its last template argument, in the demangled or the mangled name.
_STREAM_KSL = re.compile(r"stream_gemm_kernel<.*Policy<[^>]*>, \d, (\d)>|stream_gemm_kernel\w*Policy\w*Li\dELi(\d)EEEv")


def stream_k_slices(names: list[str]) -> list[int]:
    """K slices (stream_gemm_kernel's KSL) of each streaming-kernel launch among the kernel names, in order."""
    return [int(m.group(1) or m.group(2)) for m in map(_STREAM_KSL.search, names) if m]
