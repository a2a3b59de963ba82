"""MXFP8 dequantized by cublade's op to the activation dtype, then one dense GEMM."""
from __future__ import annotations

import torch

from cublade.ops.mxfp8_quant import mxfp8_dequant_ref
from cublade.vllm.kernels.base import LinearKernel, cublade_op, on_gpu


class CubladeMxfp8DequantMatmul(LinearKernel):
    """Hopper has no MX tensor cores: dequantize the MXFP8 weight to the activation dtype with cublade's op
    (exact: an e4m3 value times a power of two fits bf16/fp16 unless it leaves their range), then one dense
    GEMM. Costs a weight-sized write + read per call over an MX GEMM (at decode 2.7x the time of a bf16 layer);
    what it buys is 1-byte storage and cuBLAS's speed at prefill. Third for mxfp8, for layers neither GEMM before
    it takes."""
    name = "cublade-mxfp8-dequant-matmul"
    own = True

    @classmethod
    def can_implement(cls, layer):
        if not on_gpu(layer.weight.device):
            return False, "needs a CUDA device"
        _, how = cublade_op("mxfp8_dequant", layer.weight.device, mxfp8_dequant_ref)
        return True, f"dequantize with {how}, then a dense {layer.params_dtype} GEMM"

    def __init__(self, layer):
        super().__init__(layer)
        self.dequant, _ = cublade_op("mxfp8_dequant", layer.weight.device, mxfp8_dequant_ref)

    def apply(self, layer, x, bias):
        w = self.dequant(layer.weight, layer.weight_scale, x.dtype)
        return torch.nn.functional.linear(x, w, bias)
