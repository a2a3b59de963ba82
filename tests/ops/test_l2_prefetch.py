"""l2_prefetch: a hint that changes no value. CPU: the reference does nothing and refuses a negative byte count. GPU:
the kernel runs on tensors of any size, dtype and 16-byte misalignment (the range is rounded inward, never past the
tensor), inside a CUDA graph capture, and leaves the tensor as it was; bad inputs are one line naming the op."""
from __future__ import annotations

import pytest
import torch

from cublade.ops.l2_prefetch import l2_prefetch, l2_prefetch_ref
from fp8_testing import gpu


def test_reference_does_nothing():
    t = torch.arange(64, dtype=torch.float32)
    before = t.clone()
    assert l2_prefetch_ref(t, 1 << 20) is None
    assert l2_prefetch(t, 100) is None  # the CPU path is the reference
    assert torch.equal(t, before)


def test_reference_refuses_negative_bytes():
    with pytest.raises(ValueError, match=r"cublade\.l2_prefetch: max_bytes must be >= 0, got -1"):
        l2_prefetch_ref(torch.zeros(4), -1)


@gpu
@pytest.mark.parametrize("numel,dtype,offset,max_bytes", [
    (0, torch.uint8, 0, 1 << 20),             # nothing to fetch
    (15, torch.uint8, 0, 1 << 20),            # under one 16-byte unit
    (4096, torch.bfloat16, 0, 1 << 30),       # the whole tensor (8 KB)
    (4096, torch.uint8, 3, 1 << 30),          # a view 3 bytes into its storage: start rounded up
    (1 << 20, torch.float32, 0, 1000),        # capped, not a multiple of 16
    (96 << 20, torch.uint8, 0, 24 << 20),     # the size a decode layer asks for
    (97 * 16384 + 48, torch.uint8, 0, 1 << 30),  # a chunk tail and a CTA tail
])
def test_kernel_leaves_the_tensor(numel, dtype, offset, max_bytes):
    base = torch.randint(0, 100, (numel + offset,), dtype=torch.int32, device="cuda").to(dtype)
    t = base[offset:]
    before = t.clone()
    torch.ops.cublade.l2_prefetch(t, max_bytes)
    torch.cuda.synchronize()
    assert torch.equal(t, before)


@gpu
def test_kernel_in_a_cuda_graph():
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    ref = x @ w.t()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        l2_prefetch(w, 16 << 20)
        y = x @ w.t()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        l2_prefetch(w, 16 << 20)
        y = x @ w.t()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, ref)


@gpu
def test_kernel_errors_name_the_op():
    w = torch.zeros(64, 64, device="cuda")
    with pytest.raises(ValueError, match=r"cublade\.l2_prefetch: t must be contiguous"):
        torch.ops.cublade.l2_prefetch(w.t(), 1024)
    with pytest.raises(ValueError, match=r"cublade\.l2_prefetch: max_bytes must be >= 0, got -5"):
        torch.ops.cublade.l2_prefetch(w, -5)
