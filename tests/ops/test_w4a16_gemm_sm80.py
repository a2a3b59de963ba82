"""w4a16_gemm_sm80 (cublade._C_sm80: the int4 GEMM for sm_80 / 86 / 89, run on Hopper through its compute_80 PTX):
the kernel against the fp32 reference for every group size, symmetric and asymmetric, bf16 and fp16, every M from
1 to 40, shapes off the tile grid, NaN / Inf rows; the prefill path (from 64 rows) bit-equal to torch's GEMM on
w4a16_dequant's weights; refusals. The blobs and tolerance classes are tests/ops/test_w4a16_gemm.py's: each output
within one rounding of the fp32 reference."""
from __future__ import annotations

import pytest
import torch

from accuracy import assert_one_rounding
from cublade.ops import _dispatch
from cublade.ops.w4a16_gemm import w4a16_gemm_ref, w4a16_gemm_sm80
from test_w4a16_gemm import BAR, gpu_case, quantized

SM80 = pytest.mark.skipif(not torch.cuda.is_available() or _dispatch.sm80_extension_path() is None,
                          reason="needs a CUDA GPU and cublade._C_sm80 (built by setup.py where nvcc is)")


def check(x, rp, w, kernel_only=True):
    y = torch.ops.cublade.w4a16_gemm_sm80(x, rp.packed, rp.group_size, rp.symmetric, rp.size_n, kernel_only)
    ref = x.reshape(-1, x.shape[-1]).float() @ w.t()
    assert y.shape == (*x.shape[:-1], rp.size_n) and y.dtype == x.dtype
    assert_one_rounding(y.reshape(-1, rp.size_n), ref, BAR)
    return y


def test_cpu_entry_is_the_reference():
    from cublade.ops.w4a16_gemm import w4a16_repack

    wp, ws, wz = quantized(64, 256, 64, False)
    rp = w4a16_repack(wp, ws, wz, 64)
    x = torch.randn(3, 256).to(torch.bfloat16)
    torch.testing.assert_close(w4a16_gemm_sm80(x, rp.packed, 64, False, 64),
                               w4a16_gemm_ref(x, rp.packed, 64, False, 64), rtol=0, atol=0)


@SM80
def test_kernel_every_m_1_to_40():
    rp, w = gpu_case(272, 1024, 128, True)
    for M in list(range(1, 41)) + [63, 100]:
        check(torch.randn(M, 1024, device="cuda").to(torch.bfloat16), rp, w)


@SM80
@pytest.mark.parametrize("G", [32, 64, 128, -1])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_kernel_groups_sym_asym_dtypes(G, sym, dtype):
    rp, w = gpu_case(200, 1536, G, sym, seed=abs(G) + sym)
    for M in (1, 5, 16, 23):
        check(torch.randn(M, 1536, device="cuda").to(dtype), rp, w)


@SM80
@pytest.mark.parametrize("N,K", [(12, 128), (100, 96), (4096, 512), (1000, 14336)])
def test_kernel_shapes(N, K):
    G = 32 if K % 64 else 64
    rp, w = gpu_case(N, K, G, False, seed=N)
    for M in (1, 9):
        check(torch.randn(M, K, device="cuda").to(torch.bfloat16), rp, w)


@SM80
def test_prefill_path_from_64_rows():
    from cublade.ops.w4a16_dequant import w4a16_dequant

    rp, _ = gpu_case(200, 1024, 128, False)
    for M in (64, 150):
        x = torch.randn(M, 1024, device="cuda").to(torch.bfloat16)
        y = torch.ops.cublade.w4a16_gemm_sm80(x, rp.packed, 128, False, 200, False)
        wd = w4a16_dequant(rp.packed, 128, False, 200, 1024, torch.bfloat16)  # the Hopper op; the same kernel
        torch.testing.assert_close(y, x @ wd.t(), rtol=0, atol=0)


@SM80
def test_kernel_nan_inf_rows():
    rp, w = gpu_case(64, 256, 64, True)
    x = torch.randn(12, 256, device="cuda").to(torch.bfloat16)
    x[1, 7] = float("nan")
    x[2, 9] = float("inf")
    for rows in (4, 12):
        y = torch.ops.cublade.w4a16_gemm_sm80(x[:rows], rp.packed, 64, True, 64, True)
        assert torch.isnan(y[1]).all() and not torch.isfinite(y[2]).all()
        assert torch.isfinite(y[0]).all() and torch.isfinite(y[3:]).all()


@SM80
@pytest.mark.parametrize("G,sym", [(128, True), (32, False), (-1, True)])
def test_kernel_tiles_per_cta_give_the_same_bytes(G, sym):
    """1, 2 or 4 weight tiles per CTA: each tile's slices are still added in slice order, so every choice gives the
    same bytes (and the launcher's own choice among them), within one rounding of the reference; N off the 64-row
    tile groups."""
    rp, w = gpu_case(200, 1536, G, sym, seed=7)
    for M in (1, 8, 9, 16, 17, 40):
        x = torch.randn(M, 1536, device="cuda").to(torch.bfloat16)
        ys = [torch.ops.cublade.w4a16_gemm_sm80(x, rp.packed, G, sym, 200, True, tiles) for tiles in (0, 1, 2, 4)]
        assert_one_rounding(ys[1], x.float() @ w.t(), BAR)
        for y in ys[2:] + ys[:1]:
            assert torch.equal(y, ys[1]), M


@SM80
def test_kernel_refuses_with_a_message():
    rp, _ = gpu_case(32, 256, 64, True)
    op = torch.ops.cublade.w4a16_gemm_sm80
    x = torch.randn(2, 256, device="cuda").to(torch.bfloat16)
    cases = [
        (NotImplementedError, "w4a16_gemm_sm80: x must be bfloat16 or float16", (x.float(), rp.packed, 64, True, 32)),
        (ValueError, "w4a16_gemm_sm80: group_size must be 32, 64, 128 or -1", (x, rp.packed, 16, True, 32)),
        (ValueError, r"w4a16_gemm_sm80: packed must be a contiguous int32", (x, rp.packed, 64, True, 80)),
        (ValueError, r"w4a16_gemm_sm80: tiles must be 0 \(the launcher's rule\), 1, 2 or 4, got 3",
         (x, rp.packed, 64, True, 32, True, 3)),
    ]
    for exc, msg, args in cases:
        with pytest.raises(exc, match=msg):
            op(*args)
