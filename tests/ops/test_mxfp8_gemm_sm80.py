"""mxfp8_gemm_sm80 (cublade._C_sm80: the 1-byte-weight GEMM for sm_80 / 86 / 89, run on Hopper through its
compute_80 PTX): its reference on CPU, and on a GPU the kernel against it for MXFP8 blobs and for `fp8` codes stored
with unit exponents and a per-channel row scale, the dequantize kernel bit for bit, the prefill path, and the
kernel class cublade-fp8-w8a16 against the W8A16 and W8A8 references.

Tolerance classes as tests/ops/test_mxfp8_gemm.py: the reference is exact (rtol=0, atol=0); the kernel multiplies
exact bf16 weights, sums in fp32 in another order and multiplies the row scale once, so each output is held to one
bf16 rounding of the fp32 reference; the dequantize kernel is bit-exact.
"""
from __future__ import annotations

import pytest
import torch

from accuracy import assert_one_rounding
from cublade.numerics.fp8 import fp8_quant_weight
from cublade.ops import _dispatch
from cublade.ops.mxfp8_gemm import (mxfp8_dequant_packed_ref, mxfp8_gemm_sm80, mxfp8_gemm_sm80_ref, mxfp8_repack,
                                    unit_exponents)
from cublade.ops.mxfp8_quant import mxfp8_dequant_ref, mxfp8_quant_ref

SM80 = pytest.mark.skipif(not torch.cuda.is_available() or _dispatch.sm80_extension_path() is None,
                          reason="needs a CUDA GPU and cublade._C_sm80 (built by setup.py where nvcc is)")
BAR = 2e-3


def fp8_weights(N: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * torch.linspace(0.01, 2.0, N).unsqueeze(1)
    w[N // 2] = 0.0
    return fp8_quant_weight(w)  # e4m3 [N, K], fp32 scale [N]


# ---- CPU ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("N,K", [(64, 512), (100, 96), (1, 32)])
def test_unit_exponent_blob_holds_the_codes_exactly(N, K):
    q, s = fp8_weights(N, K)
    packed = mxfp8_repack(q, unit_exponents(q))
    torch.testing.assert_close(mxfp8_dequant_packed_ref(packed, N, K).float(), q.float(), rtol=0, atol=0)
    x = torch.randn(3, K).to(torch.bfloat16)
    want = ((x.float() @ q.float().t()) * s.float()).to(torch.bfloat16)
    torch.testing.assert_close(mxfp8_gemm_sm80_ref(x, packed, N, s), want, rtol=0, atol=0)
    torch.testing.assert_close(mxfp8_gemm_sm80(x, packed, N, s), want, rtol=0, atol=0)  # the CPU entry


def test_fp8_w8a16_within_the_w8a8_bound():
    """W8A16 on the exact codes against the `fp8` scheme's W8A8 reference: within w8a16_vs_w8a8_bound."""
    from cublade.config import Fp8Scheme
    from cublade.numerics.fp8 import quantize_per_token
    from cublade.numerics.linear import w8a16_vs_w8a8_bound

    N, K = 96, 256
    q, s = fp8_weights(N, K)
    x = (torch.randn(7, K) * torch.linspace(0.05, 4.0, K)).to(torch.bfloat16)
    y = mxfp8_gemm_sm80_ref(x, mxfp8_repack(q, unit_exponents(q)), N, s)
    t = {"weight": q, "weight_scale": s}
    ref = Fp8Scheme("channel", "dynamic-token").linear_ref(x, t)
    xq, xs = quantize_per_token(x.float())
    assert ((y.float() - ref.float()).abs() <= w8a16_vs_w8a8_bound(x, q, s, xq.float() * xs.float())).all()


def test_refuses_fp16():
    q, s = fp8_weights(16, 64)
    with pytest.raises(NotImplementedError, match="mxfp8_gemm_sm80: x must be bfloat16"):
        mxfp8_gemm_sm80(torch.randn(2, 64).half(), mxfp8_repack(q, unit_exponents(q)), 16)


# ---- GPU ---------------------------------------------------------------------------------------------------------

def mx_case(N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, e = mxfp8_quant_ref(torch.randn(N, K, generator=g) * 0.05)
    return mxfp8_repack(q.cuda(), e.cuda()), mxfp8_dequant_ref(q, e).cuda(), None


def fp8_case(N, K, seed=0):
    q, s = fp8_weights(N, K, seed)
    return mxfp8_repack(q.cuda(), unit_exponents(q).cuda()), q.float().cuda(), s.float().cuda()


def check(x, packed, w, scale, kernel_only=True):
    N = w.shape[0]
    y = torch.ops.cublade.mxfp8_gemm_sm80(x, packed, scale, N, kernel_only)
    ref = x.reshape(-1, x.shape[-1]).float() @ w.t()
    if scale is not None:
        ref = ref * scale
    assert y.shape == (*x.shape[:-1], N) and y.dtype == torch.bfloat16
    assert_one_rounding(y.reshape(-1, N), ref, BAR)
    return y


@SM80
@pytest.mark.parametrize("case", [mx_case, fp8_case], ids=["mxfp8", "fp8-codes"])
def test_kernel_every_m_1_to_40(case):
    packed, w, s = case(272, 1024)
    for M in list(range(1, 41)) + [63, 100]:
        check(torch.randn(M, 1024, device="cuda").to(torch.bfloat16), packed, w, s)


@SM80
@pytest.mark.parametrize("case", [mx_case, fp8_case], ids=["mxfp8", "fp8-codes"])
@pytest.mark.parametrize("N,K", [(100, 96), (16, 1056), (1000, 4096), (4096, 512), (200, 14336)])
@pytest.mark.parametrize("M", [1, 7, 16, 24])
def test_kernel_shapes(case, N, K, M):
    packed, w, s = case(N, K, seed=N + M)
    check(torch.randn(M, K, device="cuda").to(torch.bfloat16), packed, w, s)


@SM80
def test_dequant_kernel_is_bit_exact():
    for N, K in [(272, 1024), (100, 96), (64, 4128)]:
        g = torch.Generator().manual_seed(N)
        q, e = mxfp8_quant_ref(torch.randn(N, K, generator=g) * 0.05)
        got = torch.ops.cublade.mxfp8_dequant_packed_sm80(mxfp8_repack(q.cuda(), e.cuda()), N, K)
        torch.testing.assert_close(got, mxfp8_dequant_ref(q, e, torch.bfloat16).cuda(), rtol=0, atol=0)


@SM80
def test_prefill_path_from_64_rows():
    packed, w, _ = mx_case(200, 1024)
    for M in (64, 150):
        x = torch.randn(M, 1024, device="cuda").to(torch.bfloat16)
        y = torch.ops.cublade.mxfp8_gemm_sm80(x, packed, None, 200, False)
        torch.testing.assert_close(y, x @ w.to(torch.bfloat16).t(), rtol=0, atol=0)
    packed, w, s = fp8_case(200, 1024)
    x = torch.randn(80, 1024, device="cuda").to(torch.bfloat16)
    y = torch.ops.cublade.mxfp8_gemm_sm80(x, packed, s, 200, False)
    torch.testing.assert_close(y, x @ (w * s[:, None]).to(torch.bfloat16).t(), rtol=0, atol=0)


@SM80
def test_kernel_strided_nan_inf():
    packed, w, s = fp8_case(64, 256)
    x = torch.randn(3, 5, 512, device="cuda").to(torch.bfloat16)[..., ::2]  # column-strided: the op copies
    check(x, packed, w, s)
    x = torch.randn(12, 256, device="cuda").to(torch.bfloat16)
    x[1, 7] = float("nan")
    x[2, 9] = float("inf")
    for rows in (4, 12):  # one pass of 8, one of 16
        y = torch.ops.cublade.mxfp8_gemm_sm80(x[:rows], packed, s, 64, True)
        assert torch.isnan(y[1]).all() and not torch.isfinite(y[2]).all()
        assert torch.isfinite(y[0]).all() and torch.isfinite(y[3:]).all()
        assert (y[0, 32] == 0).all()  # the all-zero weight row


@SM80
@pytest.mark.parametrize("case", [mx_case, fp8_case], ids=["mxfp8", "fp8-codes"])
def test_kernel_tiles_per_cta_give_the_same_bytes(case):
    """1, 2 or 4 weight tiles per CTA (4 up to 8 rows: its stages do not fit from 9): the same bytes, the launcher's
    own choice among them too, within one rounding of the reference; N off the 64-row tile groups."""
    packed, w, s = case(200, 1536, seed=7)
    op = torch.ops.cublade.mxfp8_gemm_sm80
    for M in (1, 8, 9, 16, 17, 40):
        x = torch.randn(M, 1536, device="cuda").to(torch.bfloat16)
        ys = [op(x, packed, s, 200, True, tiles) for tiles in ((0, 1, 2, 4) if M <= 8 else (0, 1, 2))]
        check(x, packed, w, s)
        for y in ys[2:] + ys[:1]:
            assert torch.equal(y, ys[1]), M


@SM80
def test_kernel_refuses_with_a_message():
    packed, _, s = fp8_case(32, 256)
    op = torch.ops.cublade.mxfp8_gemm_sm80
    x = torch.randn(2, 256, device="cuda").to(torch.bfloat16)
    cases = [
        (NotImplementedError, "mxfp8_gemm_sm80: x must be bfloat16", (x.half(), packed, s, 32)),
        (ValueError, "mxfp8_gemm_sm80: in_features K=240 must be a positive multiple of 32",
         (x[:, :240], packed, s, 32)),
        (ValueError, r"mxfp8_gemm_sm80: packed must be a contiguous int32 \[2, 1, 4, 2112\]",
         (x, packed, None, 80)),
        (ValueError, r"mxfp8_gemm_sm80: row_scale must be a contiguous float32 \[32\]", (x, packed, s[:16], 32)),
        (ValueError, r"mxfp8_gemm_sm80: tiles=4 does not fit a CTA's 99 KB of shared memory from 9 rows",
         (torch.randn(9, 256, device="cuda").to(torch.bfloat16), packed, s, 32, True, 4)),
    ]
    for exc, msg, args in cases:
        with pytest.raises(exc, match=msg):
            op(*args)


@SM80
@pytest.mark.parametrize("strategy,activations", [("channel", "dynamic-token"), ("tensor", "static-tensor")])
@pytest.mark.parametrize("N,K,M", [(256, 128, 5), (4096, 1024, 1), (1000, 2048, 16), (200, 4096, 100)])
def test_fp8_w8a16_kernel_class(strategy, activations, N, K, M):
    """cublade-fp8-w8a16 on a stand-in layer: the exact-code W8A16 model (one rounding; from 64 rows the scaled weight
    rounded once, as the prefill path does) and the W8A8 reference within w8a16_vs_w8a8_bound."""
    from cublade.config import Fp8Scheme
    from cublade.numerics.fp8 import quantize_per_tensor, quantize_per_token
    from cublade.numerics.linear import w8a16_vs_w8a8_bound
    from cublade.vllm.kernels import CubladeFp8W8A16
    from stand_in import stand_in_layer

    scheme = Fp8Scheme(strategy, activations)
    g = torch.Generator().manual_seed(N + M)
    t = scheme.quantize(torch.randn(N, K, generator=g) * torch.linspace(0.05, 1.0, N).unsqueeze(1) * 0.1)
    if scheme.static:
        t["input_scale"] = torch.tensor([0.004])
    layer = stand_in_layer(scheme, t, N, K)
    ok, why = CubladeFp8W8A16.can_implement(layer)
    assert ok, why
    impl = CubladeFp8W8A16(layer)
    x = (torch.randn(M, K, generator=g) * torch.linspace(0.05, 4.0, K)).to(torch.bfloat16).cuda()
    y = impl.apply(layer, x, None)
    q, ws = t["weight"].cuda(), t["weight_scale"].float().reshape(-1).expand(N).cuda()
    if M < 64:
        assert_one_rounding(y, (x.float() @ q.float().t()) * ws, BAR)
    else:
        torch.testing.assert_close(y, x @ (q.float() * ws[:, None]).to(torch.bfloat16).t(), rtol=0, atol=0)
    tc = {k: v.cuda() for k, v in t.items()}
    x2 = x.float()
    xq, xs = (quantize_per_token(x2) if activations == "dynamic-token" else quantize_per_tensor(x2, tc["input_scale"]))
    bound = w8a16_vs_w8a8_bound(x, tc["weight"], tc["weight_scale"], xq.float() * xs.float())
    assert ((y.float() - scheme.linear_ref(x, tc).float()).abs() <= bound).all()
