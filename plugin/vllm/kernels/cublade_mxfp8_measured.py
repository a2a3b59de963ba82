"""MXFP8 on cublade's kernels, and on vLLM's Humming MXFP8 kernel at the token counts where it measured faster on this
GPU (CUBLADE_MXFP8_PREFILL=humming): cublade.vllm.kernels.measured has how the counts are timed and split, and what
the copy costs. On the H200 Humming leads cublade's op on K 14336 x N 4096 from 256 to 640 tokens and trails it on
4096x4096 (docs/performance.md#from-128-rows-passes-of-256-tokens)."""
from __future__ import annotations

from cublade.numerics.linear import MXFP8_PREFILL_ENV, mxfp8_measured_kernels
from cublade.vllm.kernels.base import LinearKernel
from cublade.vllm.kernels.cublade_mxfp8_gemm import CubladeMxfp8Gemm
from cublade.vllm.kernels.measured import MeasuredLinear
from cublade.vllm.kernels.vllm_humming_mxfp8 import VllmHummingMxfp8

VLLM_KERNELS: dict[str, type[LinearKernel]] = {"humming": VllmHummingMxfp8}
LABELS = {"cublade": "cublade's kernels", "humming": "vLLM's Humming"}


class CubladeMxfp8Measured(MeasuredLinear, CubladeMxfp8Gemm):
    """cublade's MXFP8 GEMM, and vLLM's Humming MXFP8 kernel at the token counts where it measured faster when the
    model loaded (cublade.vllm.kernels.measured). Humming's copy holds the layer's e4m3 weights and E8M0 exponents in
    its own layout (N padded to a multiple of 256)."""
    name = "cublade-mxfp8-measured"
    own = True
    what = "mxfp8"
    asked_for = f"{MXFP8_PREFILL_ENV}=humming"
    setting = MXFP8_PREFILL_ENV
    vllm_kernels = VLLM_KERNELS
    labels = LABELS
    copied = ("weight", "weight_scale")
    weights = "MXFP8"
    kernel_names = staticmethod(mxfp8_measured_kernels)

    def cublade_call(self, layer, x2):
        return self.gemm(x2, layer.weight, self.size_n)
