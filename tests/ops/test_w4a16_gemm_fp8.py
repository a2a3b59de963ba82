"""w4a16_gemm_fp8: W4A16 on FP8 tensor cores from `min_rows` rows (int4 values as exact E4M3 codes with 1 x 128
weight scales, activations quantized to E4M3 per 1 x 128 group, one blockwise-scaled FP8 GEMM).

Tolerance classes. Below min_rows: bit-exact to w4a16_gemm (the op calls it). From min_rows: the quantized operands
are bit-exact (their ops' own tests), and the GEMM sums the same products in fp32 in another order: compared with the
reference by mean relative error (< 2e-3: fp32 reassociation plus one bf16 rounding of the output). Against the
bf16-activation product the FP8 activations cost a few percent (bounded below), which is the path's documented
numerics change.
"""
from __future__ import annotations

import pytest
import torch

from accuracy import rel_err
from cublade.ops.w4a16_gemm import w4a16_gemm, w4a16_gemm_ref, w4a16_repack
from cublade.ops.w4a16_gemm_fp8 import blockwise_fp8_supported, w4a16_gemm_fp8, w4a16_gemm_fp8_ref
from test_w4a16_dequant import checkpoint

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 device)")


def layer(N: int, K: int, G: int, sym: bool, device: str = "cpu", seed: int = 0):
    wp, ws, wz = checkpoint(N, K, G, sym, seed=seed)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return w4a16_repack(to(wp), to(ws), to(wz), G)


def test_torch_has_the_blockwise_fp8_gemm():
    assert blockwise_fp8_supported()


@pytest.mark.parametrize("G,sym", [(128, True), (-1, False)])
def test_reference_below_min_rows_is_w4a16_gemm(G, sym):
    rp = layer(80, 512, G, sym)
    x = torch.randn(7, 512).to(torch.bfloat16)
    assert torch.equal(w4a16_gemm_fp8(x, rp.packed, G, sym, 80, 8), w4a16_gemm_ref(x, rp.packed, G, sym, 80))


@pytest.mark.parametrize("G,sym", [(128, True), (128, False), (-1, True)])
def test_reference_fp8_activations_cost_a_few_percent(G, sym):
    rp = layer(256, 1024, G, sym)
    x = torch.randn(64, 1024).to(torch.bfloat16)
    y = w4a16_gemm_fp8(x, rp.packed, G, sym, 256, 16)
    exact = w4a16_gemm_ref(x, rp.packed, G, sym, 256)
    err = rel_err(y, exact.float())
    assert 1e-3 < err < 4e-2, err  # E4M3 rounding of x: nonzero, and within FP8 W8A8's usual error


def test_refuses_n_not_a_multiple_of_16():
    rp = layer(200, 256, 128, True)
    with pytest.raises(NotImplementedError, match="size_n=200 must be a multiple of 16"):
        w4a16_gemm_fp8(torch.zeros(4, 256, dtype=torch.bfloat16), rp.packed, 128, True, 200, 1)


def test_compiles_as_one_opaque_op():
    rp = layer(64, 256, 128, True)
    f = torch.compile(lambda x: w4a16_gemm_fp8(x, rp.packed, 128, True, 64, 16), fullgraph=True, dynamic=True)
    for m in (4, 40):  # both sides of min_rows through one graph
        x = torch.randn(m, 256).to(torch.bfloat16)
        assert torch.equal(f(x), w4a16_gemm_fp8_ref(x, rp.packed, 128, True, 64, 16))


@GPU
@pytest.mark.parametrize("G,sym", [(128, True), (128, False), (-1, True), (-1, False)])
@pytest.mark.parametrize("M,N,K", [(1, 4096, 4096), (300, 4096, 4096), (777, 6144, 4096), (2048, 1024, 14336),
                                   (1000, 208, 640),
                                   (258, 4096, 4096)])
def test_kernel_against_reference(M, N, K, G, sym):
    rp = layer(N, K, G, sym, device="cuda", seed=M)
    x = torch.randn(M, K).to(torch.bfloat16)
    min_rows = 256
    y = w4a16_gemm_fp8(x.cuda(), rp.packed, G, sym, N, min_rows)
    if M < min_rows:
        assert torch.equal(y, w4a16_gemm(x.cuda(), rp.packed, G, sym, N))
        return
    ref = w4a16_gemm_fp8_ref(x, rp.packed.cpu(), G, sym, N, min_rows)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    assert rel_err(y.cpu(), ref.float()) < 2e-3


@GPU
def test_kernel_fp16_and_3d_input():
    rp = layer(512, 1024, 128, True, device="cuda")
    x = torch.randn(2, 300, 1024).to(torch.float16)
    y = w4a16_gemm_fp8(x.cuda(), rp.packed, 128, True, 512, 128)
    ref = w4a16_gemm_fp8_ref(x, rp.packed.cpu(), 128, True, 512, 128)
    assert y.shape == (2, 300, 512) and y.dtype == torch.float16
    assert rel_err(y.cpu(), ref.float()) < 2e-3


@pytest.mark.parametrize("G,sym", [(128, True), (-1, False)])
def test_scheme_reference_follows_the_switch(monkeypatch, G, sym):
    """The scheme's reference linear (what `cublade ppl` computes) takes the FP8 path's numerics with
    CUBLADE_W4A16_PREFILL=fp8 from the same row count, and bf16 activations otherwise."""
    from cublade.numerics.linear import W4A16_FP8_MIN_ROWS, w4a16_linear_ref

    N, K = 64, 256
    wp, ws, wz = checkpoint(N, K, G, sym, seed=3)
    rp = w4a16_repack(wp, ws, wz, G)
    for rows in (W4A16_FP8_MIN_ROWS - 1, W4A16_FP8_MIN_ROWS):
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        monkeypatch.setenv("CUBLADE_W4A16_PREFILL", "fp8")
        got = w4a16_linear_ref(x, wp, ws, wz, G)
        assert torch.equal(got, w4a16_gemm_fp8_ref(x, rp.packed, G, sym, N, W4A16_FP8_MIN_ROWS))
        monkeypatch.delenv("CUBLADE_W4A16_PREFILL")
        plain = w4a16_linear_ref(x, wp, ws, wz, G)
        assert torch.equal(got, plain) == (rows < W4A16_FP8_MIN_ROWS)
