"""W4A16 on vLLM's Humming (the `humming-kernels` package; JIT-compiled on first use). Not in the selection order:
cublade-w4a16-measured builds it on a copy of a layer's weights and runs it where it measures fastest."""
from __future__ import annotations

from cublade.vllm.kernels.vllm_mixed_precision import VllmMixedPrecision


class VllmHumming(VllmMixedPrecision):
    name = "vllm-humming"
    vllm_class = "HummingLinearKernel"
