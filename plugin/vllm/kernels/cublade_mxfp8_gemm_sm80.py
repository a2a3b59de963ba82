"""MXFP8 (W8A16) on cublade's kernel for GPUs without Hopper's copy engine (cublade.ops.mxfp8_gemm_sm80)."""
from __future__ import annotations

import torch

from cublade.ops.mxfp8_gemm import mxfp8_gemm_sm80, mxfp8_repack, why_not_repackable
from cublade.vllm.kernels.base import LinearKernel, gpu_half, replace_parameter, why_no_sm80_kernel


class CubladeMxfp8GemmSm80(LinearKernel):
    """cublade's 1-byte-weight GEMM for sm_80 / 86 / 89 (cublade._C_sm80: cp.async stages and mma.sync, the same
    blob and register dequant as the Hopper kernels), second for `mxfp8` after the Hopper kernel class: on sm_90 it
    runs only when cublade-mxfp8-gemm is disabled (CUBLADE_DISABLED_KERNELS), through the driver's compilation of its
    compute_80 PTX. From 64 tokens the op dequantizes the weight and runs cuBLAS. bf16 activations only. Its speed on
    Ampere and Ada is not measured."""
    name = "cublade-mxfp8-gemm-sm80"
    own = True

    @classmethod
    def can_implement(cls, layer):
        cap, why = gpu_half(layer, layer.weight.device)
        if cap is None:
            return False, why
        if layer.params_dtype != torch.bfloat16:
            return False, f"takes bf16 activations, the model runs in {layer.params_dtype}"
        why = why_no_sm80_kernel("mxfp8_gemm_sm80", layer.weight.device) or why_not_repackable(layer.weight_scale)
        if why is not None:
            return False, why
        return True, (f"cublade's CUDA op mxfp8_gemm_sm80 on sm_{cap} (decode kernel; from 64 tokens dequantize + "
                      f"cuBLAS)")

    def __init__(self, layer):
        super().__init__(layer)
        self.size_n = layer.output_size_per_partition
        replace_parameter(layer, "weight", mxfp8_repack(layer.weight.data, layer.weight_scale.data))
        replace_parameter(layer, "weight_scale", None)  # in the blob's records

    def apply(self, layer, x, bias):
        y = mxfp8_gemm_sm80(x, layer.weight, self.size_n)
        return y if bias is None else y + bias
