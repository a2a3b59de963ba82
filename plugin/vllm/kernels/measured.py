"""Linear kernels measured at load: cublade's op, and vLLM kernels the user names, each running the token counts where
it measured fastest on this GPU. cublade_w4a16_measured (W4A16: Machete, Humming) and cublade_mxfp8_measured (MXFP8:
Humming) build on what is here.

cublade's kernels lead at decode batches; from about 128 tokens, where a GEMM is bound by the bf16 tensor cores,
vLLM's kernels lead on some shapes (docs/performance.md). Each layer shape is timed once when the model loads,
cublade's op and each named vLLM kernel at each of MEASURED_ROWS tokens, and the token counts are split at the
measured points: a call of M tokens runs on the kernel that was fastest at the smallest measured count >= M (the
largest's beyond it; cublade's below the first). The upper point, because cublade's time steps up just past its pass
sizes (a call of 200 tokens costs about what 224 does: docs/decisions.md, "Rounded passes of 256 rows"), and the
others' grow smoothly. The price is memory: each vLLM kernel reads its own layout, so the layer keeps a copy of its
quantized weights and scales per kernel that won a range (the layer's quantized bytes once more each); a kernel that
won no measured count keeps no copy.

Each call goes through one custom op, `cublade::measured_linear(x, size_n, layer)`: the choice by M is made when the
call runs, not when vLLM traces the model, and the op finds the layer's kernels by its name (vLLM's prefix) in a
table of this module, as vLLM's attention ops find their layers."""
from __future__ import annotations

import functools
import logging
import os
import statistics
import time
import weakref
from typing import Callable, ClassVar

import torch

from cublade.vllm.kernels.base import LinearKernel, batch_invariant, replace_parameter

logger = logging.getLogger("vllm.cublade")

# Token counts timed at load: the decode batches where the kernels cross, then prefill chunk sizes.
MEASURED_ROWS = (16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
TIMED_REPS = 5  # per kernel and token count; the median is kept
FLUSH_BYTES = 256 << 20  # written before each timed call, so the weights come from DRAM as in a model's step
# GPU clock cycles a spin kernel holds the stream before each timed call, so the call is queued before its start
# event runs. Measured on the H200: 200k cycles hold 108 us, and a bf16 GEMM after 150 us of host work timed 159 us
# unheld, 69 us held (its own time, as with none).
HOLD_CYCLES = 200_000
NO_END = 2**62  # the upper end of a range that runs to any token count
# A vLLM kernel takes a measured count only where its time is under this fraction of cublade's: closer than that the
# two are within the timing's noise and the floor cublade holds itself to (0.98x the best vLLM kernel), and a kernel
# that never leads by more keeps no copy.
MARGIN = 0.98


def kernel_ranges(times: dict[int, list[float]]) -> list[tuple[int, int, int]]:
    """The token ranges the vLLM kernels run, [(lo, hi, k), ...] (hi exclusive, NO_END: no bound; k >= 1 indexes the
    timed kernels, 0 being cublade's), from `times` {M: [cublade us, kernel 1 us, ...]}: at each measured M the
    fastest vLLM kernel takes M if it is under MARGIN x cublade's time, and its range covers the counts above the
    measured one before it up to M itself (the last one also those above it; below the first, decode batches,
    cublade's kernels always); adjacent ranges of one kernel merged."""
    ms = sorted(times)
    out: list[tuple[int, int, int]] = []
    for i, m in enumerate(ms):
        t = times[m]
        k = min(range(1, len(t)), key=lambda j: t[j], default=0)
        if not k or t[k] >= MARGIN * t[0]:
            continue
        lo = ms[i - 1] + 1 if i else m
        hi = m + 1 if i + 1 < len(ms) else NO_END
        if out and out[-1][1] == lo and out[-1][2] == k:
            out[-1] = (out[-1][0], hi, k)
        else:
            out.append((lo, hi, k))
    return out


def kernel_at(m: int, ranges: list[tuple[int, int, int]]) -> int:
    """The index of the kernel a call of m tokens runs on under `ranges` (kernel_ranges'): 0 = cublade's."""
    return next((k for lo, hi, k in ranges if lo <= m < hi), 0)


def describe(ranges: list[tuple[int, int, int]], labels: list[str]) -> str:
    """"vLLM's Machete at 97-128, 385+ tokens, vLLM's Humming at 193-384 tokens, cublade's kernels at the rest", for
    `labels` of the timed kernels, cublade's first."""
    parts = []
    for k, label in enumerate(labels[1:], 1):
        mine = [f"{lo}+" if hi == NO_END else f"{lo}-{hi - 1}" for lo, hi, kk in ranges if kk == k]
        if mine:
            parts.append(f"{label} at {', '.join(mine)} tokens")
    return ", ".join(parts + [f"{labels[0]} at {'the rest' if parts else 'every count'}"])


def _replay(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> tuple[Callable[[], object], object]:
    """f(x) captured once as a CUDA graph: (its replay, the graph to keep alive). Timed as replays, a kernel's time is
    its GPU time whatever the host spends launching it, as in vLLM's CUDA-graphed steps. Eager calls behind the hold
    alone count host work that outlasts it: at load on the H200, one run of two read K 4096 x N 4096 at 160-256 tokens
    on cublade's kernels at 136-176 us (31-36 in the other) and at 16-512 tokens on Humming at 39-86 us (13-26). Where
    f cannot be captured, f(x) itself, held as the timing holds every call."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            f(x)
    except RuntimeError as e:
        logger.info("cublade: a kernel timed without a CUDA graph (%s)", str(e).splitlines()[0])
        return functools.partial(f, x), None
    return graph.replay, graph


def time_rows(kernels: dict[str, Callable[[torch.Tensor], torch.Tensor]], K: int, dtype: torch.dtype,
              device: torch.device, rows=MEASURED_ROWS, reps: int = TIMED_REPS) -> dict[int, list[float]]:
    """{M: [median us of each kernel, in `kernels`' order]} for random x [M, K]: CUDA events around each call, one
    CUDA graph replay (_replay), the L2 flushed and the stream held (HOLD_CYCLES) before it, the kernels alternated
    within each rep."""
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    out = {}
    for m in rows:
        x = torch.randn(m, K, dtype=dtype, device=device)
        for f in kernels.values():
            f(x)  # first calls (workspaces, lazy setup, Humming's JIT) out of the capture and the timing
        calls = [_replay(f, x) for f in kernels.values()]
        samples: list[list[float]] = [[] for _ in kernels]
        for r in range(reps):
            for i, (call, _) in enumerate(calls):
                flush.zero_()
                torch.cuda._sleep(HOLD_CYCLES)
                events[r][0].record()
                call()
                events[r][1].record()
                events[r][1].synchronize()
                samples[i].append(events[r][0].elapsed_time(events[r][1]) * 1e3)
        del calls  # the graphs and their outputs
        out[m] = [statistics.median(s) for s in samples]
    del flush
    torch.cuda.empty_cache()  # the flush buffer and the timing's outputs back before vLLM sizes its KV cache
    return out


class KernelFailed(RuntimeError):
    """A vLLM kernel the setting names failed on this machine while a layer was prepared or timed at load."""


def _guarded(label: str, f: Callable) -> Callable:
    """f, its failures raised as KernelFailed naming `label` (one line: the error's type and first line)."""
    def call(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except KernelFailed:
            raise
        except Exception as e:  # noqa: BLE001  (whatever a vLLM kernel raises: named, then stopped in __init__)
            first = str(e).splitlines()[0] if str(e) else ""
            raise KernelFailed(f"{label}: {type(e).__name__}{': ' + first if first else ''}") from e
    return call


class WeightCopy(torch.nn.Module):
    """The attributes vLLM's linear kernels read from a layer, with copies of the layer's quantized tensors `names` in
    cublade's checkpoint layout: a vLLM kernel's adapter builds its own layout here and leaves the layer's tensors to
    cublade. Its bias stays with the layer (added after whichever kernel ran)."""

    def __init__(self, layer: torch.nn.Module, names: tuple[str, ...]):
        super().__init__()
        for name in ("cublade_scheme", "params_dtype", "input_size_per_partition", "output_size_per_partition"):
            setattr(self, name, getattr(layer, name))
        self.input_size = getattr(layer, "input_size", layer.input_size_per_partition)
        self.output_size = getattr(layer, "output_size", layer.output_size_per_partition)
        self.output_partition_sizes = list(getattr(layer, "logical_widths", [layer.output_size_per_partition]))
        self.has_bias = False
        for name in names:
            t = getattr(layer, name, None)
            if t is not None:  # a copy: no vLLM kernel's preparation may touch the tensors cublade repacks next
                replace_parameter(self, name, t.data.clone())


_measured: dict[tuple, list[tuple[int, int, int]]] = {}  # (kind, shape, dtype, device, names) -> ranges
_layers: dict[str, tuple[weakref.ref, "MeasuredLinear"]] = {}  # the op's table: layer name -> (layer, kernel)


def _register(layer: torch.nn.Module, impl: "MeasuredLinear") -> str:
    """The name the op finds `layer` by: vLLM's prefix (the same in every process, so a compiled graph cached by vLLM
    names the right layer), suffixed where a live layer of another model already holds it."""
    base = getattr(layer, "prefix", "") or impl.what
    name, n = base, 0
    while name in _layers and _layers[name][0]() not in (None, layer):
        n += 1
        name = f"{base}#{n}"
    _layers[name] = (weakref.ref(layer), impl)
    return name


@torch.library.custom_op("cublade::measured_linear", mutates_args=())
def measured_linear(x: torch.Tensor, size_n: int, layer: str) -> torch.Tensor:
    """y [M, size_n] = x [M, K] @ W^T on the kernel the layer named `layer` measured fastest at M tokens."""
    ref, impl = _layers[layer]
    return impl.run(ref(), x)


@measured_linear.register_fake
def _(x, size_n, layer):
    return x.new_empty((x.shape[0], size_n))


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of the tensors a copy holds: its parameters and buffers, and the plain tensor attributes a vLLM kernel's
    preparation may leave, each tensor once."""
    tensors = [*module.parameters(), *module.buffers(), *(v for v in vars(module).values() if torch.is_tensor(v))]
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


@functools.cache
def say_humming_order() -> None:
    # measured on the H200: the same input twice through Humming's W4A16 kernel alone, 17-384 tokens, differed by up
    # to 0.19 (mean relative 1e-3..4e-3); cublade's kernels and Machete gave the same bits each time
    logger.info("cublade: vLLM's Humming splits K across thread blocks (stream-K) and adds their parts in no fixed "
                "order: at the token counts it runs, outputs can differ in the last bits from run to run")


class MeasuredLinear:
    """Mixin before one of cublade's kernel classes (its constructor repacks the layer's tensors and sets `size_n`,
    `cublade_call` runs its op): the vLLM kernels `kernel_names()` returns run the token counts where one measured
    faster at load (module docstring). Not under VLLM_BATCH_INVARIANT=1 (a prompt's logits would depend on which kernel
    its batch size picks)."""
    what: ClassVar[str] = ""  # the scheme, in the log
    asked_for: ClassVar[str] = ""  # the setting that asks for the kernel, in its refusal
    setting: ClassVar[str] = ""  # its environment variable, in the error where a named kernel fails
    vllm_kernels: ClassVar[dict[str, type[LinearKernel]]] = {}  # name the setting gives -> adapter class
    labels: ClassVar[dict[str, str]] = {}  # "cublade" and each name -> the log's words
    copied: ClassVar[tuple[str, ...]] = ()  # the layer's tensors a vLLM kernel's copy takes
    # names the setting may give for cublade's other paths on the layer's own tensors (no copy): `own_call` runs them
    own_kernels: ClassVar[tuple[str, ...]] = ()
    weights: ClassVar[str] = ""  # what they are ("int4", "MXFP8"), in the reason

    @staticmethod
    def kernel_names() -> tuple[str, ...]:
        """The vLLM kernels asked for, in the setting's order (none: the kernel does not run)."""
        raise NotImplementedError

    def shape_key(self, layer: torch.nn.Module) -> tuple:
        """What besides K, N, dtype and the kernels makes two layers time alike (cublade's op's arguments)."""
        return ()

    def cublade_call(self, layer: torch.nn.Module, x2: torch.Tensor) -> torch.Tensor:
        """cublade's op on the layer's repacked tensors, x2 [M, K] -> [M, N]."""
        raise NotImplementedError

    def own_call(self, name: str, layer: torch.nn.Module, x2: torch.Tensor) -> torch.Tensor:
        """cublade's other path `name` (of `own_kernels`) on the layer's repacked tensors."""
        raise NotImplementedError

    @classmethod
    def own_can_implement(cls, name: str, layer: torch.nn.Module) -> tuple[bool, str]:
        raise NotImplementedError

    @classmethod
    def can_implement(cls, layer):
        names = cls.kernel_names()
        if not names:
            return False, f"runs when asked for ({cls.asked_for})"
        if batch_invariant():
            return False, "VLLM_BATCH_INVARIANT=1 asks for one kernel at every batch size"
        ok, why = super().can_implement(layer)
        if not ok:
            return ok, why
        for n in names:
            if n in cls.own_kernels:
                ok, why = cls.own_can_implement(n, layer)
            else:
                ok, why = cls.vllm_kernels[n].can_implement(layer)
            if not ok:
                return False, f"needs {cls.labels[n]} too: {why}"
        vllm = " and ".join(cls.labels[n] for n in names)
        return True, (f"cublade's CUDA op {cls.op}, and {vllm} at the token counts where measured faster at load (a "
                      f"copy of the {cls.weights} weights in each one's layout)")

    def __init__(self, layer):
        names = self.kernel_names()
        self.names = ["cublade", *names]
        self.device = getattr(layer, self.copied[0]).device
        key = (self.what, layer.input_size_per_partition, layer.output_size_per_partition, *self.shape_key(layer),
               layer.params_dtype, self.device, tuple(self.names))
        # a shape timed before: only the vLLM kernels that won a range there get a copy
        wanted = self._won(_measured[key]) if key in _measured else list(names)
        copies = {n: WeightCopy(layer, self.copied) for n in wanted if n not in self.own_kernels}
        try:
            # before cublade's repack replaces the tensors
            adapters = {n: _guarded(self.labels[n], self.vllm_kernels[n])(c) for n, c in copies.items()}
            super().__init__(layer)
            self.ranges = self._measure(layer, key, copies, adapters)
        except KernelFailed as e:
            raise RuntimeError(
                f"cublade: {self.setting}={os.environ.get(self.setting, '')!r} asks for a vLLM kernel that failed on "
                f"this machine while {self.what} layers of N={layer.output_size_per_partition}, "
                f"K={layer.input_size_per_partition} were prepared for it at load ({e}); leave it out of "
                f"{self.setting}") from e
        won = self._won(self.ranges)
        self.adapters = [None] + [adapters.get(n) if n in won else None for n in names]  # cublade's paths: None
        for n in names:  # the copies that won a range stay with the layer (their tensors move with it)
            if n not in self.own_kernels:
                setattr(layer, f"cublade_{n}", copies[n] if n in won else None)
        if "humming" in won:
            say_humming_order()
        self.layer_name = _register(layer, self)

    def said(self) -> str:
        """The log's words for the token ranges each kernel runs here."""
        return describe(self.ranges, [self.labels[n] for n in self.names])

    def _won(self, ranges: list[tuple[int, int, int]]) -> list[str]:
        """The vLLM kernels that run a range under `ranges`, in the setting's order."""
        return [n for k, n in enumerate(self.names) if k and any(kk == k for _, _, kk in ranges)]

    def _kernels(self, layer, copies, adapters) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        out = {"cublade": functools.partial(self.cublade_call, layer)}
        for n in self.names[1:]:  # in the names' order: the timings' columns
            out[n] = (functools.partial(self.own_call, n, layer) if n in self.own_kernels
                      else _guarded(self.labels[n], functools.partial(adapters[n].apply, copies[n], bias=None)))
        return out

    def _measure(self, layer, key, copies, adapters) -> list[tuple[int, int, int]]:
        K, N = layer.input_size_per_partition, self.size_n
        if key not in _measured:
            t0 = time.perf_counter()
            times = time_rows(self._kernels(layer, copies, adapters), K, layer.params_dtype, self.device)
            _measured[key] = kernel_ranges(times)
            kept = "".join(f"; {self.labels[n]}'s copy {tensor_bytes(copies[n]) / 2**20:.2f} MiB a layer"
                           for n in self._won(_measured[key]) if n in copies)
            logger.info("cublade: %s layers of N=%d, K=%d run on %s%s (measured at load in %.1f s, us %s: %s)",
                        self.what, N, K, describe(_measured[key], [self.labels[n] for n in self.names]), kept,
                        time.perf_counter() - t0, " / ".join(self.names),
                        ", ".join(f"M={m} " + "/".join(f"{v:.1f}" for v in t) for m, t in times.items()))
        return _measured[key]

    def run(self, layer, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] on the kernel of M's range."""
        k = kernel_at(x2.shape[0], self.ranges)
        if k == 0:
            return self.cublade_call(layer, x2)
        if self.names[k] in self.own_kernels:
            return self.own_call(self.names[k], layer, x2)
        return self.adapters[k].apply(getattr(layer, f"cublade_{self.names[k]}"), x2, None)

    def apply(self, layer, x, bias):
        # Through the op even where cublade's kernels won every count: the compiled graph is then the same whatever
        # a run measured, and vLLM loads a compiled model cached by another run (VLLM_USE_AOT_COMPILE) as it is.
        y = torch.ops.cublade.measured_linear(x.reshape(-1, x.shape[-1]), self.size_n, self.layer_name)
        y = y.reshape(*x.shape[:-1], self.size_n)
        return y if bias is None else y + bias
