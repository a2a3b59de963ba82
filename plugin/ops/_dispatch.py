"""Where an op runs: cublade's CUDA kernel when the extension is built and the tensor is on a GPU,
else the pure-PyTorch reference (the CPU path, and the numerics every kernel reproduces bit for bit)."""
from __future__ import annotations

import functools
import os

import torch


@functools.cache
def extension_loaded() -> bool:
    """Import the compiled extension once; it registers the `torch.ops.cublade.*` kernels."""
    if os.environ.get("CUBLADE_DISABLE_KERNELS") == "1":
        return False
    try:
        from cublade import _C  # noqa: F401  (registers TORCH_LIBRARY(cublade))
    except ImportError:
        return False
    return True


def use_kernel(x: torch.Tensor, op_name: str) -> bool:
    """True when `torch.ops.cublade.<op_name>` exists and can take `x` (a CUDA tensor)."""
    return x.is_cuda and extension_loaded() and hasattr(torch.ops.cublade, op_name)
