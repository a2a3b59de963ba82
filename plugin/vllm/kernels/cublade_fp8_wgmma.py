"""FP8 W8A8 on cublade's wgmma GEMM where it measured faster than vLLM's CUTLASS scaled-mm at load, CUTLASS elsewhere,
both on the layer's one E4M3 weight tensor (no copy).

cublade.ops.fp8_gemm_wgmma computes what CUTLASS computes (the tensor cores' FP8 accumulation in K order, the weight
scale then the activation scale), so, unsplit, their outputs differ by at most one bf16 step, at no more than 1% of them
(tests/ops/test_fp8_gemm_wgmma.py); where its launcher halves K over a cluster (K >= 8192 on small grids) the sums are
two fp32 halves added. When the model loads each layer shape is timed once, both GEMMs after cublade's quantization of
the same activations, as one CUDA graph replay each at MEASURED_ROWS tokens (cublade.vllm.kernels.measured.time_rows),
and a call of M tokens runs on the one that was faster at the smallest measured count >= M; cublade's kernel takes a
count only where it is under measured.MARGIN x CUTLASS's time. The quantization stays outside the GEMM, so cublade's
compile pass still fuses it into the norm or SiLU-and-mul before it. The choice by M is made when the call runs,
inside one custom op (`cublade::fp8_wgmma_linear`), which finds the layer's ranges by its name.

Opt-in (CUBLADE_FP8_WGMMA=1), refused under VLLM_BATCH_INVARIANT=1 (which kernel runs depends on the batch)."""
from __future__ import annotations

import functools
import logging
import time

import torch

from cublade.ops.fp8_gemm_wgmma import fp8_gemm_wgmma
from cublade.vllm.kernels import measured
from cublade.vllm.kernels.base import batch_invariant, env_switch, replace_parameter, why_no_kernel
from cublade.vllm.kernels.vllm_cutlass_scaled_mm import VllmCutlassScaledMM, input_quant_choice

logger = logging.getLogger("vllm.cublade")

ENV = "CUBLADE_FP8_WGMMA"
# Decode batches from one token, then the batches and prompt chunks of a busy server.
MEASURED_ROWS = (1, 8, *measured.MEASURED_ROWS)
LABELS = ["vLLM's CUTLASS scaled-mm", "cublade's fp8_gemm_wgmma"]

_ranges: dict[tuple, list[tuple[int, int, int]]] = {}  # (N, K, activations, device) -> measured.kernel_ranges


def wgmma_asked_for() -> bool:
    """CUBLADE_FP8_WGMMA=1: `fp8` layers on Hopper time cublade's wgmma GEMM against CUTLASS at load."""
    return env_switch(ENV)


class CubladeFp8Wgmma(VllmCutlassScaledMM):
    """`fp8` layers on Hopper (bf16 models): each token count on the faster of cublade's fp8_gemm_wgmma and vLLM's
    CUTLASS scaled-mm, measured at load (module docstring); the activations quantized by cublade's op either way."""
    name = "cublade-fp8-wgmma"
    own = True

    @classmethod
    def can_implement(cls, layer):
        if not wgmma_asked_for():
            return False, f"runs when asked for ({ENV}=1)"
        if batch_invariant():
            return False, "VLLM_BATCH_INVARIANT=1 asks for one kernel at every batch size"
        ok, why = VllmCutlassScaledMM.can_implement(layer)
        if not ok:
            return False, f"needs vLLM's CUTLASS for the other token counts: {why}"
        if layer.params_dtype != torch.bfloat16:
            return False, f"writes bf16 outputs, the model runs in {layer.params_dtype}"
        why = why_no_kernel("fp8_gemm_wgmma", layer.weight.device)
        if why is not None:
            return False, f"fp8_gemm_wgmma: {why}"
        quant = input_quant_choice(layer.cublade_scheme, layer.weight.device)[1]
        return True, (f"cublade's fp8_gemm_wgmma at the token counts where it measured faster than vLLM's CUTLASS at "
                      f"load, CUTLASS at the rest (the same weight tensor); {quant}")

    def __init__(self, layer):
        super().__init__(layer)
        N, K = layer.output_size_per_partition, layer.input_size_per_partition
        # one fp32 scale per output channel (a per-tensor scale repeated), as both GEMMs take it
        replace_parameter(layer, "weight_scale", layer.weight_scale.data.float().reshape(-1).expand(N).contiguous())
        self.gemms = self._gemms(layer)
        key = (N, K, self.scheme.activations, layer.weight.device)
        if key not in _ranges:
            _ranges[key] = self._measure(layer, N, K)
        self.ranges = _ranges[key]
        self.what = f"fp8 N={N} K={K}"
        self.layer_name = measured._register(layer, self)

    def _gemms(self, layer):
        """(x2, input_scale) -> y for CUTLASS and for cublade's kernel, in LABELS' order."""
        from vllm import _custom_ops as ops

        def cutlass(xq, xs):
            return ops.cutlass_scaled_mm(xq, layer.weight.t(), scale_a=xs, scale_b=layer.weight_scale,
                                         out_dtype=torch.bfloat16)

        def wgmma(xq, xs):
            return fp8_gemm_wgmma(xq, xs, layer.weight, layer.weight_scale)

        return cutlass, wgmma

    def _measure(self, layer, N: int, K: int) -> list[tuple[int, int, int]]:
        t0 = time.perf_counter()
        input_scale = getattr(layer, "input_scale", None)

        def timed(gemm, x):
            xq, xs = self.quant_input(x, input_scale)
            return gemm(xq, xs)

        kernels = {label: functools.partial(timed, g) for label, g in zip(LABELS, self.gemms)}
        times = measured.time_rows(kernels, K, torch.bfloat16, layer.weight.device, rows=MEASURED_ROWS)
        ranges = measured.kernel_ranges(times)
        logger.info("cublade: fp8 layers of N=%d, K=%d run on %s (measured at load in %.1f s, us CUTLASS / wgmma, "
                    "quantization included: %s)", N, K, measured.describe(ranges, LABELS), time.perf_counter() - t0,
                    ", ".join(f"M={m} " + "/".join(f"{v:.1f}" for v in t) for m, t in times.items()))
        return ranges

    def run(self, layer, xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:  # noqa: ARG002 (the op's table form)
        """The GEMM of xq's token count's range."""
        return self.gemms[measured.kernel_at(xq.shape[0], self.ranges)](xq, xs)

    def apply(self, layer, x, bias):
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        xq, xs = self.quantize(x2, getattr(layer, "input_scale", None))  # fused by cublade's pass where it applies
        y = torch.ops.cublade.fp8_wgmma_linear(xq, xs, layer.output_size_per_partition, self.layer_name)
        y = y.reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias


@torch.library.custom_op("cublade::fp8_wgmma_linear", mutates_args=())
def fp8_wgmma_linear(xq: torch.Tensor, xs: torch.Tensor, size_n: int, layer: str) -> torch.Tensor:
    """y [M, size_n] (bf16) = the E4M3 activations xq [M, K] (scale xs) @ W^T on the GEMM the layer named `layer`
    measured faster at M tokens."""
    ref, impl = measured._layers[layer]
    return impl.run(ref(), xq, xs)


@fp8_wgmma_linear.register_fake
def _(xq, xs, size_n, layer):
    return xq.new_empty((xq.shape[0], size_n), dtype=torch.bfloat16)
