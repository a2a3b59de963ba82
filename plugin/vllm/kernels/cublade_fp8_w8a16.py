"""FP8 weights as storage (W8A16) on cublade's sm_80-89 kernel: `fp8` checkpoints on GPUs without FP8 tensor cores."""
from __future__ import annotations

import torch

from cublade.numerics.constants import MX_BLOCK
from cublade.ops.mxfp8_gemm import mxfp8_gemm_sm80, mxfp8_repack, unit_exponents
from cublade.vllm.kernels.base import LinearKernel, gpu_half, replace_parameter, why_no_kernel


class CubladeFp8W8A16(LinearKernel):
    """An `fp8` checkpoint's e4m3 weights kept as 1 byte and decoded in registers to exact bf16 values (the MXFP8 blob
    with every block exponent 2^0), multiplied with bf16 activations on mma.sync, the fp32 sums times the per-channel
    (or repeated per-tensor) weight scale, rounded once (cublade.ops.mxfp8_gemm_sm80). W8A16, like vLLM's FP8
    Marlin after which it stands: the activations are not quantized (a static input scale is not used), so against
    the W8A8 reference it differs within `w8a16_vs_w8a8_bound`; unlike Marlin the weight is not rounded with its
    scale. After vLLM's FP8 Marlin (sm_89+ runs vLLM's CUTLASS first): it runs where those are disabled
    (CUBLADE_DISABLED_KERNELS), on sm_90 through the compute_80 PTX. From 64 tokens: dequantize (times the scale) +
    cuBLAS. Needs K % 32 == 0 and bf16 activations. Through the PTX on an H200 it runs 0.8-1.16x Marlin at 1-8
    tokens and 0.2-0.9x at 16-48 (docs/performance.md, "sm_80 kernels"); on Ampere and Ada it is not measured."""
    name = "cublade-fp8-w8a16"
    own = True

    @classmethod
    def can_implement(cls, layer):
        cap, why = gpu_half(layer, layer.weight.device)
        if cap is None:
            return False, why
        if layer.params_dtype != torch.bfloat16:
            return False, f"takes bf16 activations, the model runs in {layer.params_dtype}"
        K = layer.input_size_per_partition
        if K % MX_BLOCK:
            return False, f"in_features K={K} is not a multiple of {MX_BLOCK} (the 1-byte blob's blocks)"
        why = why_no_kernel("mxfp8_gemm_sm80", layer.weight.device)
        if why is not None:
            return False, why
        return True, (f"W8A16 on sm_{cap}: cublade's CUDA op mxfp8_gemm_sm80 over the e4m3 codes, activations not "
                      f"quantized (from 64 tokens dequantize + cuBLAS)")

    def __init__(self, layer):
        super().__init__(layer)
        N = layer.output_size_per_partition
        self.size_n = N
        w = layer.weight.data
        replace_parameter(layer, "weight", mxfp8_repack(w, unit_exponents(w)))
        # one fp32 scale per output channel (a per-tensor scale repeated): the kernel's row_scale
        replace_parameter(layer, "weight_scale", layer.weight_scale.data.float().reshape(-1).expand(N).contiguous())
        replace_parameter(layer, "input_scale", None)  # W8A16: the activations stay unquantized

    def apply(self, layer, x, bias):
        y = mxfp8_gemm_sm80(x, layer.weight, self.size_n, layer.weight_scale)
        return y if bias is None else y + bias
