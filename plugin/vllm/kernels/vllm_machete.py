"""W4A16 on vLLM's Machete (a fallback, sm_90)."""
from __future__ import annotations

from cublade.vllm.kernels.vllm_mixed_precision import VllmMixedPrecision


class VllmMachete(VllmMixedPrecision):
    name = "vllm-machete"
    vllm_class = "MacheteLinearKernel"
