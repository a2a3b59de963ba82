"""MXFP8 (W8A16) on cublade's kernel for GPUs without Hopper's copy engine (cublade.ops.mxfp8_gemm_sm80)."""
from __future__ import annotations

from cublade.ops.mxfp8_gemm import mxfp8_gemm_sm80
from cublade.vllm.kernels.cublade_mxfp8_gemm import CubladeMxfp8Gemm


class CubladeMxfp8GemmSm80(CubladeMxfp8Gemm):
    """cublade's 1-byte-weight GEMM for sm_80 / 86 / 89 (cublade._C_sm80: cp.async stages and mma.sync, the same
    blob, repack and register dequant as the Hopper kernels), for `mxfp8` after vLLM's MXFP8 Marlin: it runs where
    Marlin is disabled (CUBLADE_DISABLED_KERNELS), on sm_90 through the driver's compilation of its compute_80 PTX.
    From 64 tokens the op dequantizes the weight and runs cuBLAS. bf16 activations only. Through the PTX on an H200
    it matches Marlin at 1-8 tokens and runs 0.25-0.6x from 16 (docs/performance.md, "sm_80 kernels"); on Ampere and
    Ada it is not measured."""
    name = "cublade-mxfp8-gemm-sm80"
    op = "mxfp8_gemm_sm80"
    gemm = staticmethod(mxfp8_gemm_sm80)

    @classmethod
    def reason(cls, cap: int) -> str:
        return f"cublade's CUDA op mxfp8_gemm_sm80 on sm_{cap} (decode kernel; from 64 tokens dequantize + cuBLAS)"
