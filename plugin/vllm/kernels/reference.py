"""The pure-PyTorch reference for every linear scheme: the CPU path; on a GPU only when asked for."""
from __future__ import annotations

from cublade.vllm.kernels.base import LinearKernel, layer_tensors, reference_allowed


class ReferenceKernel(LinearKernel):
    """scheme.linear_ref on the layer's tensors: dequantize-in-fp32 math, any device. The CPU path (tests,
    `cublade ppl`); on a GPU it runs only with CUBLADE_ALLOW_REFERENCE=1 (base.reference_allowed), e.g. for fp32
    activations, which no tensor-core kernel takes."""
    name = "reference"
    own = True

    @classmethod
    def can_implement(cls, layer):
        weights = next(iter(layer_tensors(layer, layer.cublade_scheme).values()))
        return reference_allowed(weights.device)

    def apply(self, layer, x, bias):
        return self.scheme.linear_ref(x, layer_tensors(layer, self.scheme), bias)
