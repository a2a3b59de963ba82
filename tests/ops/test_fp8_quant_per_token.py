"""Dynamic per-token FP8 quant: the reference's numerics on CPU (hand-computed values, the E4M3 code table,
zero/NaN/Inf rows, odd sizes), and on the GPU the kernel against that reference, bit for bit.

Tolerance class: quantization is bit-exact (rtol=0, atol=0 on the bytes and the scales); NaN positions are
compared as positions (the sign bit of an E4M3 NaN is not part of the contract)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cublade.numerics.constants import F8E4M3_MAX, FP8_MIN_SCALE
from cublade.ops import _dispatch
from cublade.ops.fp8_quant_per_token import fp8_quant_per_token, fp8_quant_per_token_ref

from fp8_testing import FP8, e4m3_table, assert_fp8_equal, gpu


def assert_scale_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == torch.float32 and a.shape == b.shape
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0, equal_nan=True)


# ---- reference, CPU ---------------------------------------------------------------------------------------

def test_known_values_by_hand():
    x = torch.tensor([[448.0, -224.0, 1.0, 0.0],
                      [2.0, 1.0, -0.5, 0.0]])
    q, s = fp8_quant_per_token_ref(x)
    assert s.shape == (2, 1) and s.dtype == torch.float32
    assert s[0].item() == 1.0
    assert s[1].item() == np.float32(2.0) / np.float32(448.0)
    # 448 = 1.75 * 2^8 -> 0x7E, 224 -> 0x76 with the sign bit, 1 -> 0x38, 0 -> 0x00
    assert q[0].view(torch.uint8).tolist() == [0x7E, 0xF6, 0x38, 0x00]
    # row 1: scale 2/448, so 2 -> 448, 1 -> 224, -0.5 -> -112 (= 1.75 * 2^6: 0 1101 110 | sign)
    assert q[1].view(torch.uint8).tolist() == [0x7E, 0x76, 0xEE, 0x00]


def test_scale_floor_and_all_zero_rows():
    assert np.float32(FP8_MIN_SCALE) == np.float32(1.0) / np.float32(448.0 * 512.0)  # the kernels' constant
    x = torch.zeros(3, 5)
    x[1, 2] = 1e-7  # amax / 448 is below the floor
    q, s = fp8_quant_per_token_ref(x)
    assert torch.equal(s, torch.full((3, 1), np.float32(FP8_MIN_SCALE)))
    assert torch.equal(q[0].view(torch.uint8), torch.zeros(5, dtype=torch.uint8))  # zeros, not NaN
    expect = torch.tensor([1e-7], dtype=torch.float32) / torch.tensor([FP8_MIN_SCALE], dtype=torch.float32)
    assert q[1, 2].view(torch.uint8) == expect.to(FP8).view(torch.uint8)


def test_e4m3_code_table_round_trips():
    """A row holding every finite E4M3 value has amax 448, scale 1: each value maps back to its own code."""
    table = e4m3_table()
    finite = ~torch.isnan(table)
    x = table[finite].reshape(1, -1)
    q, s = fp8_quant_per_token_ref(x)
    assert s.item() == 1.0
    assert torch.equal(q.view(torch.uint8)[0], torch.arange(256, dtype=torch.uint8)[finite])
    assert torch.equal(q.float(), x)  # and the cast decodes to the table values


def test_never_exceeds_448():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 333, generator=g) * torch.logspace(-30, 30, 64).unsqueeze(1)
    q, s = fp8_quant_per_token_ref(x)
    b = q.view(torch.uint8)
    assert not ((b & 0x7F) == 0x7F).any()  # finite input never gives NaN
    above_floor = s[:, 0] > np.float32(FP8_MIN_SCALE)
    assert above_floor.sum() > 30
    assert ((b & 0x7F) == 0x7E)[above_floor].sum(dim=1).ge(1).all()  # the amax element lands on +-448


def test_nan_and_inf_rows():
    x = torch.ones(3, 6)
    x[0, 3] = float("nan")
    x[1, 2] = float("inf")
    x[1, 4] = -7.0
    q, s = fp8_quant_per_token_ref(x)
    assert torch.isnan(s[0]).all() and torch.isnan(q[0].float()).all()  # NaN: the whole row
    assert torch.isinf(s[1]).all()
    row1 = q[1].float()
    assert torch.isnan(row1[2]) and (row1[[0, 1, 3, 4, 5]] == 0).all()  # Inf/Inf = NaN, finite/Inf = 0
    assert s[2].item() == np.float32(1.0) / np.float32(448.0)  # untouched row


def midpoint_rows(n_rows: int, seed: int) -> torch.Tensor:
    """fp32 rows [amax, x...] whose quotients x / scale sit on or next to an E4M3 rounding midpoint (the
    inputs where the rounding of the division decides the byte): x = RN(m * s) and its fp32 neighbours,
    for every midpoint m between adjacent positive E4M3 values, s = RN(amax / 448)."""
    t = e4m3_table()
    pos = torch.sort(t[(t > 0) & ~torch.isnan(t)]).values
    mids = (pos[:-1] + pos[1:]) / 2  # exact in fp32
    g = torch.Generator().manual_seed(seed)
    rows = []
    for amax in (torch.rand(n_rows, generator=g, dtype=torch.float64) * 99 + 1).float().tolist():
        s = torch.tensor(amax, dtype=torch.float32) / torch.tensor(F8E4M3_MAX)
        x = mids * s
        x = torch.cat([x, torch.nextafter(x, torch.full_like(x, 1e9)), torch.nextafter(x, torch.zeros_like(x))])
        x = torch.cat([x, -x])
        rows.append(torch.cat([torch.tensor([amax]), x.clamp(max=amax)]))
    return torch.stack(rows)


def test_divides_like_vllm():
    """The per-token path divides by the scale (vLLM's dynamic_per_token kernel), not x * (1/scale):
    on inputs next to E4M3 midpoints the two give different bytes, and the reference takes the division."""
    x = midpoint_rows(64, seed=1)
    s = (x.abs().amax(-1, keepdim=True) / torch.tensor(F8E4M3_MAX)).clamp_min(FP8_MIN_SCALE)
    div = (x / s).clamp(-448, 448).to(FP8).view(torch.uint8)
    mul = (x * torch.reciprocal(s)).clamp(-448, 448).to(FP8).view(torch.uint8)
    assert (div != mul).sum() > 10, "no distinguishing input found"
    q, _ = fp8_quant_per_token_ref(x)
    assert torch.equal(q.view(torch.uint8), div)


@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (3, 19), (19, 3), (2, 3, 7), (5, 1)])
def test_odd_shapes(shape):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=g)
    q, s = fp8_quant_per_token_ref(x)
    assert q.shape == x.shape and s.shape == (*shape[:-1], 1)
    expect = (x / (x.abs().amax(-1, keepdim=True) / torch.tensor(F8E4M3_MAX)).clamp_min(FP8_MIN_SCALE))
    assert torch.equal(q.view(torch.uint8), expect.clamp(-448, 448).to(FP8).view(torch.uint8))


def test_entry_point_uses_reference_on_cpu():
    x = torch.randn(4, 32)
    q, s = fp8_quant_per_token(x)
    q2, s2 = fp8_quant_per_token_ref(x)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)


# ---- kernel, GPU ------------------------------------------------------------------------------------------

def _kernel(x: torch.Tensor):
    assert _dispatch.extension_loaded(), f"cublade._C not loaded: {_dispatch.extension_load_error()}"
    return torch.ops.cublade.fp8_quant_per_token(x)


def _check(x: torch.Tensor) -> None:
    q, s = _kernel(x)
    rq, rs = fp8_quant_per_token_ref(x.cpu())
    assert q.dtype == FP8 and q.shape == x.shape and q.is_contiguous()
    assert s.shape == (*x.shape[:-1], 1) and s.is_contiguous()
    assert_scale_equal(s, rs)
    assert_fp8_equal(q, rq)


def _cases():
    """(M, K) pairs: real sizes, every kernel mode (warp per row, block per row with VPT 4 and 8, the
    two-read fallback past 65536), and sizes that are not multiples of any vector or tile."""
    ks = [1, 3, 19, 64, 100, 256, 1000, 2048, 2056, 4096, 5120, 8192, 14336, 40000, 65536, 65544]
    for K in ks:
        for M in (1, 3, 16):
            yield M, K
    for M in (19, 256, 4096):
        for K in (8, 127, 4096, 8192):
            yield M, K
    yield 16384, 4096
    yield 16384, 8192
    yield 16384, 14336


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_matches_reference(dtype):
    g = torch.Generator().manual_seed(3)
    for M, K in _cases():
        if M * K > 60_000_000 and dtype != torch.bfloat16:
            continue  # the largest sizes once (bf16), to keep the CPU reference time down
        x = torch.randn(M, K, generator=g) * torch.logspace(-3, 3, M).unsqueeze(1)
        _check(x.to(dtype).cuda())


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_division_is_exact_for_every_16bit_value(dtype):
    """Every finite 16-bit value x, in rows whose abs-max (hence scale) sweeps many values: the kernel's
    fast division must give the IEEE quotient's byte for all of them."""
    allv = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype).float()
    allv = allv[torch.isfinite(allv)]
    g = torch.Generator().manual_seed(4)
    amaxes = allv.abs().unique()
    amaxes = amaxes[amaxes > 0]
    pick = amaxes[torch.randint(0, amaxes.numel(), (96,), generator=g)]
    rows = []
    for a in pick.tolist():
        r = allv[allv.abs() <= a]
        rows.append(torch.cat([r, torch.full((allv.numel() - r.numel(),), a)]))  # pad with the amax itself
    _check(torch.stack(rows).to(dtype).cuda())


@gpu
def test_kernel_division_at_e4m3_midpoints():
    """fp32 quotients on and next to every E4M3 rounding midpoint, for many scales: the hard cases of the
    kernel's fast division (a one-ulp error there changes the byte)."""
    _check(midpoint_rows(512, seed=6).cuda())


@gpu
def test_kernel_strided_and_unaligned_views():
    g = torch.Generator().manual_seed(5)
    base = torch.randn(64, 4104, generator=g).to(torch.bfloat16).cuda()
    _check(base[:, :4096])          # row stride 4104 (a multiple of 8: the vector path)
    _check(base[::3, :2048])        # every third row
    _check(base[:, 1:4097])         # rows start 2 bytes off a 16-byte boundary: the scalar path
    _check(base[:, :4100])          # K not a multiple of 8
    _check(base[:40, :40].t())      # column-strided
    _check(base.reshape(8, 8, 4104)[:, :, :1000])  # 3-D, non-collapsible leading dims


@gpu
def test_kernel_zero_outlier_nan_inf_rows():
    x = torch.randn(8, 4096)
    x[0] = 0.0
    x[1, 17] = 3.0e4            # one huge outlier: the rest of the row quantizes to (near) zero
    x[2, 5] = float("nan")
    x[3, 9] = float("inf")
    x[4, 9] = -float("inf")
    x[5, :7] = 1e-30            # tiny values next to normal ones
    x[6] = 1e-38                # row below the scale floor
    x[7, ::2] = -0.0            # negative zeros keep their sign (0x80), as in the IEEE division
    x[7, 1::4] = -1e-9          # and so do quotients that round to zero
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        _check(x.to(dtype).cuda())
    _check(x[:, :3].contiguous().cuda())  # the same rows through the scalar path


@gpu
def test_entry_point_dispatches_to_kernel():
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    assert _dispatch.use_kernel(x, "fp8_quant_per_token")
    q, s = fp8_quant_per_token(x)
    rq, rs = fp8_quant_per_token_ref(x.cpu())
    assert_fp8_equal(q, rq)
    assert_scale_equal(s, rs)


@gpu
def test_opcheck():
    for x in (torch.randn(5, 256, device="cuda", dtype=torch.bfloat16),
              torch.randn(2, 3, 19, device="cuda", dtype=torch.float32)):
        torch.library.opcheck(torch.ops.cublade.fp8_quant_per_token.default, (x,))


@gpu
def test_torch_compile_fullgraph():
    def f(x):
        q, s = fp8_quant_per_token(x)
        return q.float() * s

    x = torch.randn(33, 512, device="cuda", dtype=torch.bfloat16)
    got = torch.compile(f, fullgraph=True)(x)
    torch.testing.assert_close(got, f(x), rtol=0, atol=0)


@gpu
def test_invalid_inputs_are_refused_with_the_op_name():
    with pytest.raises(NotImplementedError, match=r"fp8_quant_per_token.*Int"):
        _kernel(torch.ones(2, 8, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match=r"fp8_quant_per_token.*0-dim"):
        _kernel(torch.ones((), device="cuda"))
    with pytest.raises(ValueError, match=r"fp8_quant_per_token.*last dim"):
        _kernel(torch.ones(4, 0, device="cuda"))


@gpu
def test_bytes_equal_vllm_scaled_fp8_quant_per_token():
    """vLLM's dynamic_per_token kernel divides by the scale like this op: same bytes and scales on data with
    no NaN (vLLM's fmaxf abs-max drops NaN; cublade propagates it, the reference's contract)."""
    try:
        from vllm import _custom_ops as ops
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"vLLM not importable here ({type(e).__name__}); stage it on the device to run this")
    g = torch.Generator().manual_seed(7)
    for M, K in ((1, 4096), (16, 8192), (256, 14336), (4096, 4096)):
        x = (torch.randn(M, K, generator=g) * torch.logspace(-2, 2, M).unsqueeze(1)).to(torch.bfloat16).cuda()
        q, s = _kernel(x)
        vq, vs = ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
        assert torch.equal(s, vs)
        assert torch.equal(q.view(torch.uint8), vq.view(torch.uint8))
    x = midpoint_rows(64, seed=8).cuda()  # the inputs where dividing and multiplying differ
    q, s = _kernel(x)
    vq, vs = ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
    assert torch.equal(s, vs) and torch.equal(q.view(torch.uint8), vq.view(torch.uint8))
