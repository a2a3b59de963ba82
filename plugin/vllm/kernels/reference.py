"""The pure-PyTorch reference for every linear scheme: the CPU path, and the last resort on a GPU."""
from __future__ import annotations

from cublade.vllm.kernels.base import LinearKernel, layer_tensors


class ReferenceKernel(LinearKernel):
    """scheme.linear_ref on the layer's tensors: dequantize-in-fp32 math, any device. The CPU path; on a GPU
    the last resort (e.g. fp32 activations, which no tensor-core kernel takes)."""
    name = "reference"
    own = True

    @classmethod
    def can_implement(cls, layer):
        return True, "pure-PyTorch reference (cublade.ops), fp32 math on any device"

    def apply(self, layer, x, bias):
        return self.scheme.linear_ref(x, layer_tensors(layer, self.scheme), bias)
