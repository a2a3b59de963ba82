"""MXFP8 (W8A16) on vLLM's Marlin (a fallback)."""
from __future__ import annotations

from typing import ClassVar

from cublade.vllm.kernels.base import LinearKernel, gpu_half


class VllmMarlinMxfp8(LinearKernel):
    """vLLM's MXFP8 weight-only GEMM (Marlin, W8A16; a fallback), second for mxfp8: it takes what cublade-mxfp8-gemm
    refuses (fp16 activations, block scales above 2^7). vLLM's MarlinMxfp8LinearKernel repacks cublade's tensors once
    (they are the layout it reads: e4m3 [N, K], E8M0 uint8 [N, K/32]) and multiplies bf16/fp16 activations by the e4m3
    weights times their power-of-two scales with fp32 sums: the same products as cublade's kernels. Speeds:
    CubladeMxfp8Gemm (cublade_mxfp8_gemm.py)."""
    name = "vllm-marlin-mxfp8"
    own = False
    vllm_class: ClassVar[str] = "MarlinMxfp8LinearKernel"  # in vllm.model_executor.kernels.linear

    @classmethod
    def _why_not_installed(cls) -> str | None:
        return None

    @classmethod
    def can_implement(cls, layer):
        cap, why = gpu_half(layer, layer.weight.device)
        if cap is None:
            return False, why
        try:
            from vllm.model_executor.kernels import linear as vllm_linear

            k = getattr(vllm_linear, cls.vllm_class)
        except (ImportError, AttributeError) as e:
            return False, f"this vLLM has no {cls.vllm_class} ({e})"
        why = cls._why_not_installed()
        if why is not None:
            return False, why
        ok, why = k.is_supported(cap)
        return ok, (f"vLLM's {cls.vllm_class} on sm_{cap}" if ok else f"vLLM's {cls.vllm_class}: {why}")

    def __init__(self, layer):
        super().__init__(layer)
        from vllm.model_executor.kernels import linear as vllm_linear

        self.impl = getattr(vllm_linear, self.vllm_class)(vllm_linear.Mxfp8LinearLayerConfig())
        self.impl.process_weights_after_loading(layer)

    def apply(self, layer, x, bias):
        return self.impl.apply_weights(layer, x, bias)
