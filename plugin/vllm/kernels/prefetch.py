"""The next layer's weight into L2 while the kernels between two GEMMs run (opt-in: CUBLADE_L2_PREFETCH=<MiB>).

A decode step at few tokens reads every weight from HBM once, GEMM after GEMM, and between two GEMMs runs kernels
that read little (RMSNorm, RoPE and the KV-cache write, attention over a short context, SiLU-and-mul, the activation
quantization), while HBM is mostly idle. With the setting, each linear layer whose kernel takes part asks L2, right
after its GEMM, for the first MiB of the next linear layer's weight (cublade.ops.l2_prefetch): those bytes stream in
during the gap, and the next GEMM reads them from L2.

"Next" is the order vLLM prepares the layers in (process_weights_after_loading over model.named_modules()), which
for decoder models is the order a step runs them: qkv, o, gate_up, down, the next layer's qkv, ..., an int4 or fp8
lm_head. A wrong guess costs only the bytes fetched: a prefetch changes no value. The prefetch runs inside the op
that computes the layer's output (an op without an output would be dropped from a compiled graph), which finds the
tensor by the layer's name here.
"""
from __future__ import annotations

import functools
import logging
import os
import weakref

import torch

from cublade.ops.l2_prefetch import l2_prefetch

ENV = "CUBLADE_L2_PREFETCH"
MIB = 2**20
logger = logging.getLogger("vllm.cublade")


def prefetch_mib() -> int:
    """CUBLADE_L2_PREFETCH: MiB of the next layer's weight each layer asks L2 for after its GEMM (0 or unset: off)."""
    v = os.environ.get(ENV, "0").strip()
    if not v.isdigit():
        raise ValueError(f"{ENV}={v!r}: expected a whole number of MiB (0: off), e.g. {ENV}=24")
    return int(v)


_names: dict[str, weakref.ref] = {}  # name -> the layer holding it
_next: dict[str, tuple[weakref.ref, int]] = {}  # layer name -> (the next layer's streamed weight, bytes to prefetch)
_last: list[str | None] = [None]  # the layer linked last, when its kernel prefetches


def _name(layer: torch.nn.Module, prefix: str) -> str:
    """vLLM's prefix for the layer, suffixed where a live layer of another model already holds it."""
    base = prefix or type(layer).__name__
    name, n = base, 0
    while name in _names and _names[name]() not in (None, layer):
        n += 1
        name = f"{base}#{n}"
    _names[name] = weakref.ref(layer)
    return name


def link(layer: torch.nn.Module, prefix: str, kernel, mib: int | None = None) -> None:
    """Called for each layer in the order vLLM prepares them, after its kernel is built: this layer's streamed weight
    (`kernel.streamed`, a layer attribute; none: it is not prefetched) becomes what the layer linked before it
    prefetches, and the kernel, if it prefetches (`kernel.prefetches`), gets the name its op finds its own next
    weight by (`kernel.prefetch_name`). mib: the amount (default: the setting); 0 links nothing."""
    mib = prefetch_mib() if mib is None else mib
    if mib <= 0:
        return
    _say(mib, layer)
    streamed = getattr(layer, kernel.streamed, None) if kernel.streamed else None
    prev = _last[0]
    if prev is not None and streamed is not None:
        _next[prev] = (weakref.ref(streamed), min(mib * MIB, streamed.numel() * streamed.element_size()))
    _last[0] = None
    if kernel.prefetches:
        kernel.prefetch_name = _name(layer, prefix)
        _next.pop(kernel.prefetch_name, None)
        _last[0] = kernel.prefetch_name


@functools.cache
def _said(mib: int, l2_mib: float | None) -> None:
    from cublade.vllm.kernels import add_to_compile_key

    add_to_compile_key(f"{ENV}={mib}")  # the layers' ops take their names: another traced graph
    l2 = "" if l2_mib is None else f" (this GPU's L2: {l2_mib:.0f} MiB)"
    logger.info("cublade: %s=%d: after its GEMM each linear layer asks L2 for the first %d MiB of the next layer's "
                "weight%s", ENV, mib, mib, l2)


def _say(mib: int, layer: torch.nn.Module) -> None:
    device = next((t.device for t in layer.parameters()), None)
    cuda = device is not None and device.type == "cuda"
    _said(mib, torch.cuda.get_device_properties(device).L2_cache_size / MIB if cuda else None)


def after(name: str) -> None:
    """In the op of the layer `name`, after its GEMM: ask L2 for the head of the next layer's weight."""
    entry = _next.get(name)
    if entry is None:
        return
    t = entry[0]()
    if t is not None:
        l2_prefetch(t, entry[1])


def next_of(name: str) -> tuple[torch.Tensor, int] | None:
    """(the tensor the layer `name` prefetches, bytes), or None (for the log and tests)."""
    entry = _next.get(name)
    t = None if entry is None else entry[0]()
    return None if t is None else (t, entry[1])
