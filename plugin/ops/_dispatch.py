"""Where an op runs: cublade's CUDA kernel when the extension is built and the tensor is on a GPU,
else the pure-PyTorch reference (the CPU path, and the numerics every kernel reproduces bit for bit).

The extension `cublade._C` is imported once, when this module is first imported (not lazily inside an op
call), so that `torch.compile` never traces an import: under dynamo, `use_kernel` is plain attribute reads.
Where the installed package has no extension and the GPU is one the kernels target (sm_90), it is built on first
use into a cache (cublade.extension); when that cannot be done, importing this module raises
ExtensionUnavailable with the fix. `cublade._C_sm80` (kernels for sm_80 and later GPUs, built by setup.py) loads
beside it where installed. Set CUBLADE_DISABLE_KERNELS=1 to force the references everywhere."""
from __future__ import annotations

import os
from typing import Callable

import torch

_LOADED: bool | None = None
_LOAD_ERROR: str | None = None
_LOADED_FROM: str | None = None  # the extension library's path, when loaded
_CUDA_OPS: frozenset[str] = frozenset()  # the ops with a CUDA kernel in the loaded extension
_SM80_FROM: str | None = None  # cublade._C_sm80's path, when loaded


def ops_with_cuda_kernel(namespace: str) -> frozenset[str]:
    """The ops of `namespace` that have a CUDA kernel registered. bindings.cpp declares every op's schema, so a
    build that left some .cu files out (scripts/device_check.sh's CUBLADE_CU_ONLY) has schemas without kernels:
    calling one fails, so such an op must count as missing and its reference run instead."""
    prefix = f"{namespace}::"
    names = {n[len(prefix):].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith(prefix)}
    return frozenset(n for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(prefix + n, "CUDA"))


def _load_sm80() -> None:
    """cublade._C_sm80 (the kernels for sm_80 and later without Hopper's copy engine), where it is built; its ops
    join _CUDA_OPS. Built only by setup.py (no first-use build)."""
    global _SM80_FROM
    try:
        from cublade import _C_sm80  # (a TORCH_LIBRARY_FRAGMENT of cublade)
        _SM80_FROM = _C_sm80.__file__
    except ImportError:
        _SM80_FROM = None


def _load() -> bool:
    global _LOAD_ERROR, _CUDA_OPS, _LOADED_FROM
    if os.environ.get("CUBLADE_DISABLE_KERNELS") == "1":
        _LOAD_ERROR = "CUBLADE_DISABLE_KERNELS=1"
        return False
    try:
        from cublade import _C  # (registers TORCH_LIBRARY(cublade) and the CUDA kernels)
        _LOADED_FROM = _C.__file__
    except ImportError as e:  # no build (CPU machines, a pure-Python install), or a build for another torch
        from cublade import extension

        if extension.kernels_target_this_gpu():
            _LOADED_FROM = str(extension.load_or_build())  # raises ExtensionUnavailable when it cannot
        else:
            _LOAD_ERROR = f"{type(e).__name__}: {e}"
    _load_sm80()
    if _LOADED_FROM is None and _SM80_FROM is None:
        return False
    _CUDA_OPS = ops_with_cuda_kernel("cublade")
    return True


def extension_loaded() -> bool:
    """True when `cublade._C` imported (its `torch.ops.cublade.*` kernels are registered)."""
    global _LOADED
    if _LOADED is None:
        _LOADED = _load()
    return _LOADED


def extension_load_error() -> str | None:
    """Why the extension is not loaded (None when it is)."""
    extension_loaded()
    return _LOAD_ERROR


def extension_path() -> str | None:
    """The loaded extension library (the installed cublade._C, or a build in the cache); None when not loaded."""
    extension_loaded()
    return _LOADED_FROM


def use_kernel(x: torch.Tensor, op_name: str) -> bool:
    """True when `torch.ops.cublade.<op_name>` has a CUDA kernel and can take `x` (a CUDA tensor)."""
    return x.is_cuda and extension_loaded() and op_name in _CUDA_OPS


def sm80_extension_path() -> str | None:
    """cublade._C_sm80's library when loaded (sm_80-89 kernels), else None."""
    extension_loaded()
    return _SM80_FROM


def register_fake(qualname: str, library: str = "_C") -> Callable:
    """`torch.library.register_fake(qualname)` when the extension library that defines the op's schema (`_C`, or
    `_C_sm80`) is loaded, else a no-op: the fake sits next to the op's Python entry either way."""
    def deco(fn: Callable) -> Callable:
        loaded = _SM80_FROM is not None if library == "_C_sm80" else _LOADED_FROM is not None
        if extension_loaded() and loaded:
            torch.library.register_fake(qualname)(fn)
        return fn
    return deco


extension_loaded()  # import-time load; see the module docstring
