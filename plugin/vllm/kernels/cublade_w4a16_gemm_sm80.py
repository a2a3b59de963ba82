"""W4A16 on cublade's kernel for GPUs without Hopper's copy engine (cublade.ops.w4a16_gemm_sm80)."""
from __future__ import annotations

from cublade.ops.w4a16_gemm import w4a16_gemm_sm80, w4a16_repack
from cublade.vllm.kernels.base import HALF_DTYPES, LinearKernel, gpu_half, replace_parameter, why_no_sm80_kernel


class CubladeW4A16GemmSm80(LinearKernel):
    """cublade's W4A16 GEMM for sm_80 / 86 / 89 (cublade._C_sm80: cp.async stages and mma.sync over the same blob and
    register dequant as the Hopper kernels, weights repacked once by `w4a16_repack`), second after the Hopper kernel
    class: on sm_90 it runs only where cublade-w4a16-gemm is disabled (CUBLADE_DISABLED_KERNELS), through the driver's
    compilation of its compute_80 PTX. From 64 tokens the op dequantizes the weight and runs cuBLAS. Its speed on
    Ampere and Ada is not measured."""
    name = "cublade-w4a16-gemm-sm80"
    own = True

    @classmethod
    def can_implement(cls, layer):
        device = layer.weight_packed.device
        cap, why = gpu_half(layer, device)
        if cap is None:
            return False, why
        if layer.params_dtype not in HALF_DTYPES:
            return False, f"takes bf16/fp16 activations, the model runs in {layer.params_dtype}"
        why = why_no_sm80_kernel("w4a16_gemm_sm80", device)
        if why is not None:
            return False, why
        return True, (f"cublade's CUDA op w4a16_gemm_sm80 on sm_{cap} (decode kernel; from 64 tokens dequantize + "
                      f"cuBLAS)")

    def __init__(self, layer):
        super().__init__(layer)
        zp = getattr(layer, "weight_zero_point", None)
        rp = w4a16_repack(layer.weight_packed.data, layer.weight_scale.data, None if zp is None else zp.data,
                          self.scheme.group_size)
        self.group_size, self.symmetric, self.size_n = rp.group_size, rp.symmetric, rp.size_n
        replace_parameter(layer, "weight_packed", rp.packed)
        replace_parameter(layer, "weight_scale", None)
        replace_parameter(layer, "weight_zero_point", None)  # folded into the blob's scale records

    def apply(self, layer, x, bias):
        y = w4a16_gemm_sm80(x, layer.weight_packed, self.group_size, self.symmetric, self.size_n)
        return y if bias is None else y + bias
