"""W4A16 on cublade's kernel for GPUs without Hopper's copy engine (cublade.ops.w4a16_gemm_sm80)."""
from __future__ import annotations

from cublade.vllm.kernels.base import gpu_half, why_no_kernel
from cublade.vllm.kernels.cublade_w4a16_gemm import CubladeW4A16Gemm


class CubladeW4A16GemmSm80(CubladeW4A16Gemm):
    """cublade's W4A16 GEMM for sm_80 / 86 / 89 (cublade._C_sm80: cp.async stages and mma.sync over the same blob,
    repack and register dequant as the Hopper kernels), after vLLM's Marlin: it runs where Marlin refuses a layer
    (zero points of N % 8 != 0) or is disabled (CUBLADE_DISABLED_KERNELS); on sm_90 only with the Hopper kernel,
    Machete and Marlin disabled, through the driver's compilation of its compute_80 PTX. From 64 tokens the op
    dequantizes the weight and runs cuBLAS. Through the PTX on an H200 it matches Marlin at 1-8 tokens and runs
    0.2-0.6x from 16 (docs/performance.md, "sm_80 kernels"); on Ampere and Ada it is not measured."""
    name = "cublade-w4a16-gemm-sm80"
    op = "w4a16_gemm_sm80"

    @classmethod
    def can_implement(cls, layer):
        device = layer.weight_packed.device
        cap, why = gpu_half(layer, device)  # a GPU, and bf16 / fp16 activations
        if cap is None:
            return False, why
        why = why_no_kernel(cls.op, device)
        if why is not None:
            return False, why
        return True, (f"cublade's CUDA op w4a16_gemm_sm80 on sm_{cap} (decode kernel; from 64 tokens dequantize + "
                      f"cuBLAS)")
