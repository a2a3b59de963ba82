"""W4A16 on vLLM's Marlin (a fallback)."""
from __future__ import annotations

from cublade.vllm.kernels.vllm_mixed_precision import VllmMixedPrecision


class VllmMarlin(VllmMixedPrecision):
    name = "vllm-marlin"
    vllm_class = "MarlinLinearKernel"
