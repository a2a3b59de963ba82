"""MXFP8 (W8A16) on vLLM's Marlin (a fallback)."""
from __future__ import annotations

from cublade.vllm.kernels.base import LinearKernel, gpu_half


class VllmMarlinMxfp8(LinearKernel):
    """vLLM's MXFP8 weight-only GEMM (Marlin, W8A16; a fallback), second for mxfp8: it takes what cublade-mxfp8-gemm
    refuses (fp16 activations, block scales above 2^7). vLLM's MarlinMxfp8LinearKernel repacks cublade's tensors once
    (they are the layout it reads: e4m3 [N, K], E8M0 uint8 [N, K/32]) and multiplies bf16/fp16 activations by the e4m3
    weights times their power-of-two scales with fp32 sums: the same products as cublade's kernels. Speeds:
    CubladeMxfp8Gemm (cublade_mxfp8_gemm.py)."""
    name = "vllm-marlin-mxfp8"
    own = False

    @classmethod
    def can_implement(cls, layer):
        cap, why = gpu_half(layer, layer.weight.device)
        if cap is None:
            return False, why
        try:
            from vllm.model_executor.kernels.linear import MarlinMxfp8LinearKernel
        except ImportError as e:
            return False, f"this vLLM has no MarlinMxfp8LinearKernel ({e})"
        ok, why = MarlinMxfp8LinearKernel.is_supported(cap)
        return ok, (f"vLLM's MarlinMxfp8LinearKernel on sm_{cap}" if ok else f"vLLM's MarlinMxfp8LinearKernel: {why}")

    def __init__(self, layer):
        super().__init__(layer)
        from vllm.model_executor.kernels.linear import MarlinMxfp8LinearKernel, Mxfp8LinearLayerConfig

        self.impl = MarlinMxfp8LinearKernel(Mxfp8LinearLayerConfig())
        self.impl.process_weights_after_loading(layer)

    def apply(self, layer, x, bias):
        return self.impl.apply_weights(layer, x, bias)
