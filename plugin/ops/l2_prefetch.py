"""`l2_prefetch(t, max_bytes)`: ask the GPU's memory system to bring the first min(max_bytes, t's bytes) of a contiguous
tensor into L2, and return at once. A hint: nothing is written, and no later kernel waits for it; a kernel that then
reads those bytes finds them in L2 or already on their way. The reference (the CPU path) therefore does nothing.

In a decode step the weights stream from HBM once per step while the kernels between two GEMMs (norms, RoPE,
attention at few tokens) read little; a layer that prefetches the next layer's weight right after its own GEMM moves
part of that read into those gaps (cublade.vllm.prefetch chains the layers). The kernel: csrc/l2_prefetch.cu.

The op has no output, so a compiled graph would drop it: call it from inside another op (the linear layers' custom
ops do), or eagerly."""
from __future__ import annotations

import torch

from cublade.ops._dispatch import register_fake, use_kernel


def l2_prefetch_ref(t: torch.Tensor, max_bytes: int) -> None:
    """Nothing to compute: a prefetch changes no value."""
    if max_bytes < 0:
        raise ValueError(f"cublade.l2_prefetch: max_bytes must be >= 0, got {max_bytes}")


def l2_prefetch(t: torch.Tensor, max_bytes: int) -> None:
    if use_kernel(t, "l2_prefetch"):
        torch.ops.cublade.l2_prefetch(t, max_bytes)
    else:
        l2_prefetch_ref(t, max_bytes)


@register_fake("cublade::l2_prefetch")
def _l2_prefetch_fake(t: torch.Tensor, max_bytes: int) -> None:
    return None
