"""W4A16 with FP8 tensor cores for large batches (cublade.ops.w4a16_gemm_fp8), chosen with
CUBLADE_W4A16_PREFILL=fp8."""
from __future__ import annotations

import torch

from cublade.numerics.linear import W4A16_FP8_MIN_ROWS, W4A16_PREFILL_ENV, w4a16_prefill_math
from cublade.ops.w4a16_gemm_fp8 import blockwise_fp8_supported
from cublade.vllm.kernels.base import why_no_kernel
from cublade.vllm.kernels.cublade_w4a16_gemm import CubladeW4A16Gemm


def why_not_fp8(layer) -> str | None:
    """Why the FP8 tensor-core path (cublade.ops.w4a16_gemm_fp8) cannot run this w4a16 layer, None where it can."""
    G, K = layer.cublade_scheme.group_size, layer.input_size_per_partition
    if G not in (128, -1):
        return f"needs group size 128 or per channel (1 x 128 block scales), the layer has {G}"
    if K % 128:
        return f"needs K a multiple of 128 (1 x 128 blocks), the layer has K={K}"
    if layer.output_size_per_partition % 16:
        return f"needs N a multiple of 16, the layer has N={layer.output_size_per_partition}"
    for op in ("w4a16_dequant_fp8", "fp8_quant_per_group"):
        why = why_no_kernel(op, layer.weight_packed.device)
        if why is not None:
            return why
    if not blockwise_fp8_supported():
        return f"torch {torch.__version__} has no blockwise-scaled FP8 GEMM (torch.nn.functional.scaled_mm)"
    return None


class CubladeW4A16Fp8Prefill(CubladeW4A16Gemm):
    """cublade's W4A16 GEMM below W4A16_FP8_MIN_ROWS tokens; from there the int4 values as exact E4M3 codes with their
    scales as 1 x 128 block scales, the activations quantized to E4M3 per 1 x 128 group, and one blockwise-scaled
    FP8 GEMM (cuBLASLt): twice the bf16 tensor-core rate where a batch is large enough to be bound by it. It rounds
    the activations of those batches to E4M3 (the accuracy cost: docs/accuracy.md), so it runs only when asked
    for."""
    name = "cublade-w4a16-fp8-prefill"
    own = True

    @classmethod
    def can_implement(cls, layer):
        if w4a16_prefill_math() != "fp8":
            return False, f"runs when asked for ({W4A16_PREFILL_ENV}=fp8)"
        ok, why = super().can_implement(layer)
        if not ok:
            return ok, why
        why = why_not_fp8(layer)
        if why is not None:
            return False, why
        rows = W4A16_FP8_MIN_ROWS
        return True, (f"cublade's w4a16_gemm below {rows} tokens, from {rows} FP8 tensor cores "
                      f"(activations in E4M3 per 1 x 128)")

    def __init__(self, layer):
        super().__init__(layer)
        self.min_rows = W4A16_FP8_MIN_ROWS

    def apply(self, layer, x, bias):
        y = torch.ops.cublade.w4a16_gemm_fp8(x, layer.weight_packed, self.group_size, self.symmetric, self.size_n,
                                             self.min_rows)
        return y if bias is None else y + bias
