"""MXFP8 (W8A16) on cublade's own GEMM (cublade.ops.mxfp8_gemm)."""
from __future__ import annotations

import torch

from cublade.ops.mxfp8_gemm import mxfp8_gemm, mxfp8_repack, why_not_repackable
from cublade.vllm.kernels.base import LinearKernel, gpu_half, replace_parameter, why_no_kernel


class CubladeMxfp8Gemm(LinearKernel):
    """cublade's MXFP8 GEMM (cublade.ops.mxfp8_gemm, W8A16) on weights repacked once by `mxfp8_repack` into the kernels'
    tile layout (1 byte a weight plus its exponents, as the checkpoint). The op runs 1-16 tokens on its streaming
    kernel, from 17 on its wide (wgmma) kernel, and from 257 (640 on weights of 2^25 elements or more, 1024 from 2^26)
    dequantizes the weight to bf16 and runs cuBLAS (the prefill path; a transient N x K bf16 weight per call). Each path
    multiplies the same exact bf16 weights. bf16 activations only (the kernels build bf16 weights); E8M0 scales up to
    2^7.
    On an H200 (benchmarks/bench_mxfp8_gemm.py, every kernel class in one run; docs/performance.md): against vLLM's
    MXFP8 Marlin 1.00-1.63x as fast at 1-16 tokens, 1.03-1.70x at 32-256, 1.54-2.32x from 512 (K 8192 x N 28672 at
    M = 1 / 64 / 256 / 4096: 75.7 / 94.0 / 261.4 / 2845.5 us, Marlin 75.6 / 113.9 / 411.1 / 6591.4); 3.4-4.5x as fast
    as the dequantize path (CubladeMxfp8DequantMatmul) at 1-16 tokens, 0.97-1.07x from 512 (where it runs that path)."""
    name = "cublade-mxfp8-gemm"
    own = True
    op = "mxfp8_gemm"  # the CUDA op (cublade._C); `gemm` its Python entry
    gemm = staticmethod(mxfp8_gemm)

    @classmethod
    def reason(cls, cap: int) -> str:
        return "cublade's CUDA op mxfp8_gemm (decode kernels; from 257-1024 tokens by weight size, dequantize + cuBLAS)"

    @classmethod
    def can_implement(cls, layer):
        cap, why = gpu_half(layer, layer.weight.device)
        if cap is None:
            return False, why
        if layer.params_dtype != torch.bfloat16:
            return False, f"takes bf16 activations, the model runs in {layer.params_dtype}"
        why = why_no_kernel(cls.op, layer.weight.device) or why_not_repackable(layer.weight_scale)
        if why is not None:
            return False, why
        return True, cls.reason(cap)

    def __init__(self, layer):
        super().__init__(layer)
        self.size_n = layer.output_size_per_partition
        replace_parameter(layer, "weight", mxfp8_repack(layer.weight.data, layer.weight_scale.data))
        replace_parameter(layer, "weight_scale", None)  # in the blob's records

    def apply(self, layer, x, bias):
        y = self.gemm(x, layer.weight, self.size_n)
        return y if bias is None else y + bias
