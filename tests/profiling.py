"""Which CUDA kernels a call launches: the tests that check a kernel choice (wide vs streaming) read it here."""
from __future__ import annotations

import torch


def kernels_run(fn) -> list[str]:
    """Names of the CUDA kernels fn() launches, in launch order (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
