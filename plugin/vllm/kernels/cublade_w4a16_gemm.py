"""W4A16 on cublade's own GEMM (cublade.ops.w4a16_gemm)."""
from __future__ import annotations

import functools

from cublade.ops.w4a16_gemm import w4a16_gemm_ref, w4a16_repack
from cublade.vllm.kernels.base import (HALF_DTYPES, LinearKernel, batch_invariant, cublade_op, replace_parameter,
                                       why_no_kernel)


class CubladeW4A16Gemm(LinearKernel):
    """cublade's W4A16 GEMM (cublade.ops.w4a16_gemm) on weights repacked once by `w4a16_repack` into the
    kernel's tile layout. The op runs decode batches on its streaming kernel (up to 16 tokens) and its wide
    wgmma kernel (from 17, at group size 128 or per channel; from 9 on weights of 2^27 elements or more; with bf16
    activations at group size 128, from 160 tokens in passes of up to 256 on the weights rounded once to bf16) and, from
    257 to 1024 tokens by the weight's size (448-640 with fp16 activations or per channel; 128 at other group sizes),
    dequantizes the weight and runs a dense cuBLAS GEMM (the prefill path; a transient N x K weight in x's dtype per
    call).
    Sending large M to Machete instead would keep a second, Machete-layout copy of the weights (twice the
    memory W4A16 is there to save). Speeds against Machete/Marlin per M: docs/performance.md;
    `CUBLADE_DISABLED_KERNELS=cublade-w4a16-gemm` runs Machete/Marlin for every M instead.
    Under vLLM's VLLM_BATCH_INVARIANT=1 the prefill path and the rounded passes are off: their weights are rounded
    to bf16 once where the other kernels keep them exact, so a prompt's logits would depend on how many tokens its
    batch prefills (measured: 35 of 64 greedy texts changed between alone and in a batch of 64,
    docs/accuracy.md#batch-invariance); every batch then runs on the exact kernels."""
    name = "cublade-w4a16-gemm"
    own = True
    op = "w4a16_gemm"  # the CUDA op the layer runs (its reference where it cannot)

    @classmethod
    def can_implement(cls, layer):
        device = layer.weight_packed.device
        if layer.params_dtype not in HALF_DTYPES:
            return False, f"takes bf16/fp16 activations, the model runs in {layer.params_dtype}"
        why = why_no_kernel(cls.op, device)
        if why is not None:
            return False, why
        if batch_invariant():
            return True, "cublade's CUDA op w4a16_gemm (its kernels at every batch size: VLLM_BATCH_INVARIANT=1)"
        return True, "cublade's CUDA op w4a16_gemm (decode kernels; from 257-1024 tokens dequantize + cuBLAS)"

    def __init__(self, layer):
        super().__init__(layer)
        gemm, _ = cublade_op(self.op, layer.weight_packed.device, w4a16_gemm_ref)
        self.gemm = functools.partial(gemm, split_k=0, prefill=not batch_invariant())
        zp = getattr(layer, "weight_zero_point", None)
        rp = w4a16_repack(layer.weight_packed.data, layer.weight_scale.data,
                                    None if zp is None else zp.data, self.scheme.group_size)
        self.group_size, self.symmetric, self.size_n = rp.group_size, rp.symmetric, rp.size_n
        # one blob: the kernel's tiles with their scales interleaved
        replace_parameter(layer, "weight_packed", rp.packed)
        replace_parameter(layer, "weight_scale", None)
        replace_parameter(layer, "weight_zero_point", None)  # folded into the blob's scale records

    def apply(self, layer, x, bias):
        y = self.gemm(x, layer.weight_packed, self.group_size, self.symmetric, self.size_n)
        return y if bias is None else y + bias
