"""MXFP8 (W8A16) on vLLM's Humming (the `humming-kernels` package; JIT-compiled on first use). Not in the selection
order: cublade-mxfp8-measured builds it on a copy of a layer's weights and runs it where it measures fastest."""
from __future__ import annotations

from cublade.vllm.kernels.vllm_marlin_mxfp8 import VllmMarlinMxfp8


class VllmHummingMxfp8(VllmMarlinMxfp8):
    """vLLM's HummingMxfp8LinearKernel on cublade's MXFP8 tensors (the layout it reads, as Marlin's: e4m3 [N, K], E8M0
    uint8 [N, K/32]), prepared as vLLM prepares it at load. Humming splits K across thread blocks on Hopper
    (stream-K), so its sums are not added in a fixed order."""
    name = "vllm-humming-mxfp8"
    vllm_class = "HummingMxfp8LinearKernel"

    @classmethod
    def _why_not_installed(cls) -> str | None:
        from vllm.utils.import_utils import has_humming

        if has_humming():
            return None
        return "vLLM's Humming needs the humming-kernels package (pip install humming-kernels)"
