"""cublade.ops._dispatch: which of the extension's ops count as built (runs on any machine)."""
from __future__ import annotations

import torch

from cublade.ops._dispatch import ops_with_cuda_kernel


def test_an_op_declared_without_a_cuda_kernel_counts_as_missing():
    """bindings.cpp declares every op; a build that left a .cu file out has the schema and no kernel, and calling
    it would fail, so only ops with a CUDA kernel count (the others run their reference)."""
    lib = torch.library.Library("cublade_dispatch_test", "DEF")
    lib.define("declared_only(Tensor x) -> Tensor")
    lib.define("with_kernel(Tensor x) -> Tensor")
    lib.impl("with_kernel", lambda x: x.clone(), "CUDA")
    assert ops_with_cuda_kernel("cublade_dispatch_test") == frozenset({"with_kernel"})
    assert ops_with_cuda_kernel("no_such_namespace") == frozenset()
