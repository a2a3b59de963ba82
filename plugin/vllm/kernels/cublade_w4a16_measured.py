"""W4A16 on cublade's kernels, and on vLLM's W4A16 kernels (Machete, Humming) at the token counts where one of them
measured faster on this GPU (CUBLADE_W4A16_PREFILL=machete, humming, or machete,humming; with fp8 among them,
cublade's FP8 tensor-core path is timed too): cublade.vllm.kernels.measured has how the counts are timed and split,
and what the copies cost. On the H200, from about 128 tokens Machete or Humming lead cublade's bf16 kernels on most
Llama shapes, and from about 1024 the FP8 path leads them all (docs/performance.md#w4a16-gemm)."""
from __future__ import annotations

import torch

from cublade.numerics.linear import W4A16_PREFILL_ENV, w4a16_measured_kernels
from cublade.vllm.kernels.base import LinearKernel
from cublade.vllm.kernels.cublade_w4a16_fp8_prefill import why_not_fp8
from cublade.vllm.kernels.cublade_w4a16_gemm import CubladeW4A16Gemm
from cublade.vllm.kernels.measured import MeasuredLinear
from cublade.vllm.kernels.vllm_humming import VllmHumming
from cublade.vllm.kernels.vllm_machete import VllmMachete

# The vLLM kernels CUBLADE_W4A16_PREFILL may name, and the names the log gives them.
VLLM_KERNELS: dict[str, type[LinearKernel]] = {"machete": VllmMachete, "humming": VllmHumming}
LABELS = {"cublade": "cublade's kernels", "machete": "vLLM's Machete", "humming": "vLLM's Humming",
          "fp8": "cublade's FP8 tensor-core path"}


def _cublade_gemm(x, packed, group_size, symmetric, size_n):
    return torch.ops.cublade.w4a16_gemm(x, packed, group_size, symmetric, size_n, 0, True)


class CubladeW4A16Measured(MeasuredLinear, CubladeW4A16Gemm):
    """cublade's W4A16 GEMM, and the vLLM kernels CUBLADE_W4A16_PREFILL names at the token counts where one measured
    faster when the model loaded (cublade.vllm.kernels.measured). Each vLLM kernel's copy holds the layer's int4
    weights, scales and zero points in its own layout. With "fp8" among the names, cublade's FP8 tensor-core path
    (the int4 values as E4M3 codes, the activations rounded to E4M3 per 1 x 128: cublade.ops.w4a16_gemm_fp8) is timed
    too, on the layer's own blob, and runs where it measured fastest: its outputs there are that path's."""
    name = "cublade-w4a16-measured"
    own = True
    what = "w4a16"
    asked_for = f"{W4A16_PREFILL_ENV}=machete, humming or machete,humming"
    setting = W4A16_PREFILL_ENV
    vllm_kernels = VLLM_KERNELS
    labels = LABELS
    copied = ("weight_packed", "weight_scale", "weight_zero_point")
    weights = "int4"
    own_kernels = ("fp8",)  # cublade.ops.w4a16_gemm_fp8 on the layer's blob: activations in E4M3 per 1 x 128
    kernel_names = staticmethod(w4a16_measured_kernels)

    @classmethod
    def own_can_implement(cls, name, layer):
        why = why_not_fp8(layer)
        return why is None, why or "cublade's FP8 tensor-core path"

    def own_call(self, name, layer, x2):
        return torch.ops.cublade.w4a16_gemm_fp8(x2, layer.weight_packed, self.group_size, self.symmetric,
                                                self.size_n, 0)

    def shape_key(self, layer):
        return layer.cublade_scheme.group_size, layer.cublade_scheme.symmetric

    def cublade_call(self, layer, x2):
        return _cublade_gemm(x2, layer.weight_packed, self.group_size, self.symmetric, self.size_n)
