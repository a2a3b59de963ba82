"""W4A16 on cublade's kernels, and on vLLM's Machete at the token counts where Machete measured faster on this GPU
(CUBLADE_W4A16_PREFILL=machete).

cublade's kernels lead at decode batches and Machete from about 128 tokens, where the GEMM is bound by the bf16
tensor cores (docs/performance.md#w4a16-gemm). Each layer shape is timed once when the model loads, both kernels at
each of MEASURED_ROWS tokens, and the token counts are split at the measured points: a call of M tokens runs on the
kernel that was faster at the smallest measured count >= M (the largest's beyond it; cublade's below the first). The
upper point, because cublade's time steps up just past its pass sizes (a call of 200 tokens costs about what 224
does: docs/decisions.md, "Rounded passes of 256 rows"), and Machete's grows smoothly. The price is memory: Machete
reads its own layout, so the layer keeps a second copy of its int4 weights and scales (the layer's int4 bytes twice,
still half of bf16's); a shape on which Machete won at no measured count keeps no copy."""
from __future__ import annotations

import logging
import statistics
import time
from typing import Callable, Optional

import torch

from cublade.numerics.linear import W4A16_PREFILL_ENV, w4a16_prefill_math
from cublade.vllm.kernels.base import replace_parameter
from cublade.vllm.kernels.cublade_w4a16_gemm import CubladeW4A16Gemm, batch_invariant
from cublade.vllm.kernels.vllm_machete import VllmMachete

logger = logging.getLogger("vllm.cublade")

# Token counts timed at load: the decode batches where the kernels cross, then prefill chunk sizes.
MEASURED_ROWS = (16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
TIMED_REPS = 5  # per kernel and token count; the median is kept
FLUSH_BYTES = 256 << 20  # written before each timed call, so the weights come from DRAM as in a model's step
# GPU clock cycles (about 100 us) a spin kernel holds the stream before each timed call, so the call is queued before
# its start event runs and the timing sees the kernel's GPU time, as a CUDA-graph replay runs it. Unheld, the host's
# dispatch shows (H200, K 4096 x N 28672 at 16 tokens: cublade's 30 us kernel read 48-97 us and Machete took those
# decode batches).
HOLD_CYCLES = 200_000
NO_END = 2**62  # the upper end of a range that runs to any token count
# Machete takes a measured count only where its time is under this fraction of cublade's: closer than that the two
# are within the timing's noise and the floor cublade holds itself to (0.98x the best vLLM kernel), and a shape on
# which Machete never leads by more keeps no second copy.
MACHETE_MARGIN = 0.98


def machete_rows(times: dict[int, tuple[float, float]]) -> list[int]:
    """The token ranges Machete runs, flattened [lo0, hi0, lo1, hi1, ...] (hi exclusive; NO_END: no bound), from
    `times` {M: (cublade us, Machete us)}: each measured M where Machete was faster by more than MACHETE_MARGIN
    covers the counts above the measured one before it up to M itself (the last one also those above it; below the
    first, decode batches, cublade's kernels always); adjacent ranges merged."""
    ms = sorted(times)
    out: list[int] = []
    for i, m in enumerate(ms):
        if times[m][1] >= MACHETE_MARGIN * times[m][0]:
            continue
        lo = ms[i - 1] + 1 if i else m
        hi = m + 1 if i + 1 < len(ms) else NO_END
        if out and out[-1] == lo:
            out[-1] = hi
        else:
            out += [lo, hi]
    return out


def on_machete(m: int, rows: list[int]) -> bool:
    """Whether a call of m tokens runs on Machete under `rows` (machete_rows' ranges)."""
    return any(lo <= m < hi for lo, hi in zip(rows[::2], rows[1::2]))


def describe_rows(rows: list[int]) -> str:
    if not rows:
        return "none"
    return ", ".join(f"{lo}+" if hi == NO_END else f"{lo}-{hi - 1}" for lo, hi in zip(rows[::2], rows[1::2]))


def _cublade_gemm(x, packed, group_size, symmetric, size_n):
    return torch.ops.cublade.w4a16_gemm(x, packed, group_size, symmetric, size_n, 0, True)


def _machete_mm(x, w, s, zp, type_id, group_size):
    return torch.ops._C.machete_mm(x, w, type_id, None, s, zp, group_size, None, None, None)


@torch.library.custom_op("cublade::w4a16_gemm_or_machete", mutates_args=())
def w4a16_gemm_or_machete(x: torch.Tensor, packed: torch.Tensor, group_size: int, symmetric: bool, size_n: int,
                          machete_w: torch.Tensor, machete_s: torch.Tensor, machete_zp: Optional[torch.Tensor],
                          machete_type: int, machete_group: int, machete_rows: list[int]) -> torch.Tensor:
    """y [M, size_n] = x [M, K] @ W^T: cublade's w4a16_gemm on its blob, or vLLM's machete_mm on Machete's copy of
    the same weights when M lies in `machete_rows` (machete_rows' ranges). One op, so the choice by M is made when
    the call runs, not when vLLM traces the model."""
    if on_machete(x.shape[0], machete_rows):
        return _machete_mm(x, machete_w, machete_s, machete_zp, machete_type, machete_group)
    return _cublade_gemm(x, packed, group_size, symmetric, size_n)


@w4a16_gemm_or_machete.register_fake
def _(x, packed, group_size, symmetric, size_n, machete_w, machete_s, machete_zp, machete_type, machete_group,
      machete_rows):
    return x.new_empty((x.shape[0], size_n))


def time_rows(kernels: dict[str, Callable[[torch.Tensor], torch.Tensor]], K: int, dtype: torch.dtype,
              device: torch.device, rows=MEASURED_ROWS, reps: int = TIMED_REPS) -> dict[int, list[float]]:
    """{M: [median us of each kernel, in `kernels`' order]} for random x [M, K]: CUDA events around each call, the
    L2 flushed and the stream held (HOLD_CYCLES) before it, the kernels alternated within each rep."""
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    out = {}
    for m in rows:
        x = torch.randn(m, K, dtype=dtype, device=device)
        for f in kernels.values():
            f(x)  # first calls (workspaces, lazy setup) out of the timing
        samples: list[list[float]] = [[] for _ in kernels]
        for r in range(reps):
            for i, f in enumerate(kernels.values()):
                flush.zero_()
                torch.cuda._sleep(HOLD_CYCLES)
                events[r][0].record()
                f(x)
                events[r][1].record()
                events[r][1].synchronize()
                samples[i].append(events[r][0].elapsed_time(events[r][1]) * 1e3)
        out[m] = [statistics.median(s) for s in samples]
    del flush
    torch.cuda.empty_cache()  # the flush buffer and the timing's outputs back before vLLM sizes its KV cache
    return out


class _MacheteCopy(torch.nn.Module):
    """The attributes vLLM's Machete kernel reads from a layer, with the layer's int4 tensors in cublade's checkpoint
    layout: the adapter (VllmMachete) builds Machete's copy here and leaves the layer's own tensors to cublade."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        for name in ("cublade_scheme", "params_dtype", "input_size_per_partition", "output_size_per_partition"):
            setattr(self, name, getattr(layer, name))
        self.input_size = getattr(layer, "input_size", layer.input_size_per_partition)
        self.output_size = getattr(layer, "output_size", layer.output_size_per_partition)
        for name in ("weight_packed", "weight_scale", "weight_zero_point"):
            t = getattr(layer, name, None)
            if t is not None:
                replace_parameter(self, name, t.data)


_measured: dict[tuple, list[int]] = {}  # (K, N, group size, symmetric, dtype, device) -> machete_rows


class CubladeW4A16Machete(CubladeW4A16Gemm):
    """cublade's W4A16 GEMM, and vLLM's Machete for the token counts where it measured faster when the model loaded
    (module docstring). Asked for with CUBLADE_W4A16_PREFILL=machete; not under VLLM_BATCH_INVARIANT=1 (a prompt's
    logits would depend on which kernel its batch size picks)."""
    name = "cublade-w4a16-machete"
    own = True

    @classmethod
    def can_implement(cls, layer):
        if w4a16_prefill_math() != "machete":
            return False, f"runs when asked for ({W4A16_PREFILL_ENV}=machete)"
        if batch_invariant():
            return False, "VLLM_BATCH_INVARIANT=1 asks for one kernel at every batch size"
        ok, why = super().can_implement(layer)
        if not ok:
            return ok, why
        ok, why = VllmMachete.can_implement(layer)
        if not ok:
            return False, f"needs vLLM's Machete too: {why}"
        return True, ("cublade's CUDA op w4a16_gemm, and vLLM's Machete at the token counts where it measured faster "
                      "at load (a second, Machete-layout copy of the int4 weights)")

    def __init__(self, layer):
        copy = _MacheteCopy(layer)
        machete = VllmMachete(copy)  # before cublade's repack replaces the layer's tensors
        super().__init__(layer)
        c = machete.impl.config
        self.machete_type, self.machete_group = c.weight_type.id, c.group_size
        names = [f"machete_{n}" for n in ("weight_packed", "weight_scale") + (
            ("weight_zero_point",) if c.zero_points else ())]
        for name in names:
            replace_parameter(layer, name, getattr(copy, name[len("machete_"):]).data)
        self.rows = self._measured_rows(layer)
        if not self.rows:  # Machete won no token count on this shape: its copy is not kept
            for name in names:
                replace_parameter(layer, name, None)

    def _machete(self, layer, x):
        return _machete_mm(x, layer.machete_weight_packed, layer.machete_weight_scale,
                           getattr(layer, "machete_weight_zero_point", None), self.machete_type, self.machete_group)

    def _measured_rows(self, layer) -> list[int]:
        K, N = layer.input_size_per_partition, self.size_n
        dev = layer.weight_packed.device
        key = (K, N, self.group_size, self.symmetric, layer.params_dtype, dev)
        if key not in _measured:
            t0 = time.perf_counter()
            times = time_rows({"cublade": lambda x: _cublade_gemm(x, layer.weight_packed, self.group_size,
                                                                  self.symmetric, N),
                               "machete": lambda x: self._machete(layer, x)}, K, layer.params_dtype, dev)
            _measured[key] = machete_rows({m: (t[0], t[1]) for m, t in times.items()})
            rows = _measured[key]
            logger.info("cublade: w4a16 layers of N=%d, K=%d run on vLLM's Machete at %s tokens, on cublade's "
                        "kernels at the rest%s (measured at load in %.1f s, us cublade / Machete: %s)", N, K,
                        describe_rows(rows), "" if rows else " (no second copy kept)", time.perf_counter() - t0,
                        ", ".join(f"M={m} {t[0]:.1f}/{t[1]:.1f}" for m, t in times.items()))
        return _measured[key]

    def apply(self, layer, x, bias):
        if not self.rows:
            return super().apply(layer, x, bias)
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.ops.cublade.w4a16_gemm_or_machete(
            x2, layer.weight_packed, self.group_size, self.symmetric, self.size_n, layer.machete_weight_packed,
            layer.machete_weight_scale, getattr(layer, "machete_weight_zero_point", None), self.machete_type,
            self.machete_group, self.rows).reshape(*x.shape[:-1], self.size_n)
        return y if bias is None else y + bias
