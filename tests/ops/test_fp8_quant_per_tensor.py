"""Per-tensor FP8 quant, dynamic and static: the reference's numerics on CPU (hand-computed values, the E4M3
code table, round-to-nearest-even ties, saturation, zero/NaN/Inf tensors), and on the GPU the two-pass kernel
against that reference, bit for bit.

Tolerance class: bit-exact (bytes and scale); NaN positions compared as positions."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cublade.numerics.constants import FP8_MIN_SCALE
from cublade.ops import _dispatch
from cublade.ops.fp8_quant_per_tensor import fp8_quant_per_tensor, fp8_quant_per_tensor_ref

from fp8_testing import FP8, e4m3_table, assert_fp8_equal, gpu


def one(v: float) -> torch.Tensor:
    return torch.tensor([v], dtype=torch.float32)


# ---- reference, CPU ---------------------------------------------------------------------------------------

def test_dynamic_known_values():
    x = torch.tensor([[448.0, -224.0], [1.0, 0.0]])
    q, s = fp8_quant_per_tensor_ref(x)
    assert s.shape == (1,) and s.item() == 1.0
    assert q.view(torch.uint8).flatten().tolist() == [0x7E, 0xF6, 0x38, 0x00]
    q, s = fp8_quant_per_tensor_ref(x * 2)  # amax 896: scale 2, the same codes
    assert s.item() == 2.0 and q.view(torch.uint8).flatten().tolist() == [0x7E, 0xF6, 0x38, 0x00]


def test_static_scale_multiplies_by_the_reciprocal():
    x = torch.tensor([1.0, 3.0, -448.0, 1000.0, -1e9, float("inf")])
    q, s = fp8_quant_per_tensor_ref(x, one(2.0))
    assert s.item() == 2.0
    # x / 2 = 0.5, 1.5, -224, 500 -> 448 (saturated), -5e8 -> -448, inf -> 448
    assert q.view(torch.uint8).tolist() == [0x30, 0x3C, 0xF6, 0x7E, 0xFE, 0x7E]
    # 0-dim and [1] scales are the same, the returned scale is [1]
    q0, s0 = fp8_quant_per_tensor_ref(x, torch.tensor(2.0))
    assert s0.shape == (1,) and torch.equal(q0.view(torch.uint8), q.view(torch.uint8))
    # a scale of 3: x * RN(1/3), one rounding of the reciprocal, then one of the product
    q, _ = fp8_quant_per_tensor_ref(torch.tensor([7.0]), one(3.0))
    expect = (torch.tensor([7.0]) * torch.reciprocal(one(3.0))).to(FP8)
    assert torch.equal(q.view(torch.uint8), expect.view(torch.uint8))


def test_code_table_round_trips_and_ties_to_even():
    t = e4m3_table()
    finite = ~torch.isnan(t)
    q, _ = fp8_quant_per_tensor_ref(t[finite], one(1.0))
    assert torch.equal(q.view(torch.uint8), torch.arange(256, dtype=torch.uint8)[finite])
    # midpoints between neighbours: 1.0625 lies between 1.0 (0x38) and 1.125 (0x39): even 0x38;
    # 1.1875 between 0x39 and 1.25 (0x3A): even 0x3A; 2^-10, half the smallest subnormal: even 0x00;
    # 464 (between 448 and the NaN slot) saturates to 448.
    q, _ = fp8_quant_per_tensor_ref(torch.tensor([1.0625, 1.1875, 2.0**-10, 1.5 * 2.0**-9, 464.0]), one(1.0))
    assert q.view(torch.uint8).tolist() == [0x38, 0x3A, 0x00, 0x02, 0x7E]


def test_zero_nan_inf_tensors():
    q, s = fp8_quant_per_tensor_ref(torch.zeros(4, 7))
    assert s.item() == np.float32(FP8_MIN_SCALE) and not q.view(torch.uint8).any()  # zeros, not NaN
    x = torch.ones(4, 7)
    x[2, 3] = float("nan")
    q, s = fp8_quant_per_tensor_ref(x)
    assert torch.isnan(s).all() and torch.isnan(q.float()).all()  # one NaN poisons the tensor
    x = torch.ones(4, 7)
    x[1, 1] = -float("inf")
    q, s = fp8_quant_per_tensor_ref(x)
    f = q.float()
    assert torch.isinf(s).all() and torch.isnan(f[1, 1]) and (f.flatten()[torch.arange(28) != 8] == 0).all()


@pytest.mark.parametrize("shape", [(1,), (3,), (19, 3), (2, 3, 5), ()])
def test_odd_shapes(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    q, s = fp8_quant_per_tensor_ref(x)
    assert q.shape == x.shape and s.shape == (1,)


# ---- kernel, GPU ------------------------------------------------------------------------------------------

def _kernel(x, scale=None):
    assert _dispatch.extension_loaded(), f"cublade._C not loaded: {_dispatch.extension_load_error()}"
    return torch.ops.cublade.fp8_quant_per_tensor(x, scale)


def _check(x: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    q, s = _kernel(x, scale)
    rq, rs = fp8_quant_per_tensor_ref(x.cpu(), None if scale is None else scale.cpu())
    assert q.dtype == FP8 and q.shape == x.shape and q.is_contiguous()
    assert s.shape == (1,) and s.dtype == torch.float32
    torch.testing.assert_close(s.cpu(), rs, rtol=0, atol=0, equal_nan=True)
    assert_fp8_equal(q, rq)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_matches_reference(dtype):
    g = torch.Generator().manual_seed(1)
    shapes = [(1, 1), (1, 7), (3, 19), (16, 4096), (19, 4100), (256, 8192), (4096, 14336), (1, 1_000_003),
              (2, 3, 129)]
    if dtype == torch.bfloat16:
        shapes.append((16384, 8192))
    for shape in shapes:
        x = torch.randn(shape, generator=g) * 3
        _check(x.to(dtype).cuda())
        _check(x.to(dtype).cuda(), torch.tensor([0.0173], device="cuda"))


@gpu
def test_kernel_code_table_ties_and_saturation():
    t = e4m3_table()
    x = torch.cat([t[~torch.isnan(t)], torch.tensor([1.0625, 1.1875, 2.0**-10, 1.5 * 2.0**-9, 464.0, 1e30,
                                                     -float("inf"), 2.0**-140])])
    _check(x.cuda(), torch.ones(1, device="cuda"))  # fp32 in, scale 1: the conversion itself
    _check(x.cuda(), torch.tensor(0.25, device="cuda"))


@gpu
def test_kernel_strided_unaligned_and_special_tensors():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(64, 4104, generator=g).to(torch.bfloat16).cuda()
    _check(base[:, :4096])      # rows not contiguous with each other: the strided path
    _check(base[:, 1:])         # unaligned start
    _check(base[:40, :40].t())  # column-strided
    _check(base.flatten()[3:40003])  # contiguous 1-D, unaligned start
    x = torch.zeros(128, 256)
    _check(x.cuda())
    x[5, 7] = 2.5e4  # outlier
    _check(x.cuda())
    x[100, 3] = float("nan")
    _check(x.cuda())
    x[100, 3] = float("inf")
    _check(x.cuda())
    _check(x.to(torch.bfloat16).cuda(), torch.tensor([1e-3], device="cuda"))


@gpu
def test_dynamic_scale_needs_no_host_sync():
    """The scale is computed and consumed on the device: the op records into a CUDA graph and replays."""
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    torch.ops.cublade.fp8_quant_per_tensor(x)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, s = torch.ops.cublade.fp8_quant_per_tensor(x)
    x.mul_(3)
    graph.replay()
    rq, rs = fp8_quant_per_tensor_ref(x.cpu())
    torch.testing.assert_close(s.cpu(), rs, rtol=0, atol=0)
    assert_fp8_equal(q, rq)


@gpu
def test_entry_point_dispatches_to_kernel():
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    assert _dispatch.use_kernel(x, "fp8_quant_per_tensor")
    for scale in (None, torch.tensor([0.02], device="cuda", dtype=torch.float64)):  # any float dtype
        q, s = fp8_quant_per_tensor(x, scale)
        rq, rs = fp8_quant_per_tensor_ref(x.cpu(), None if scale is None else scale.cpu())
        assert_fp8_equal(q, rq)
        torch.testing.assert_close(s.cpu(), rs, rtol=0, atol=0)


@gpu
def test_opcheck():
    x = torch.randn(7, 300, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.cublade.fp8_quant_per_tensor.default, (x,))
    torch.library.opcheck(torch.ops.cublade.fp8_quant_per_tensor.default, (x, torch.tensor([0.5], device="cuda")))


@gpu
def test_torch_compile_fullgraph():
    def f(x, s):
        q1, s1 = fp8_quant_per_tensor(x)
        q2, _ = fp8_quant_per_tensor(x, s)
        return q1.float() * s1 + q2.float()

    x = torch.randn(65, 512, device="cuda", dtype=torch.bfloat16)
    s = torch.tensor([0.01], device="cuda")
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(x, s), f(x, s), rtol=0, atol=0)


@gpu
def test_invalid_inputs_are_refused_with_the_op_name():
    x = torch.ones(4, 8, device="cuda")
    with pytest.raises(ValueError, match=r"fp8_quant_per_tensor: scale must have one element"):
        _kernel(x, torch.ones(2, device="cuda"))
    with pytest.raises(ValueError, match=r"fp8_quant_per_tensor: scale must be float32"):
        _kernel(x, torch.ones(1, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match=r"fp8_quant_per_tensor: scale must be on cuda"):
        _kernel(x, torch.ones(1))
    with pytest.raises(ValueError, match=r"fp8_quant_per_tensor: dynamic quantization of an empty tensor"):
        _kernel(torch.ones(0, 8, device="cuda"))
    with pytest.raises(NotImplementedError, match=r"fp8_quant_per_tensor: x must be"):
        _kernel(torch.ones(4, 8, device="cuda", dtype=torch.float64))
