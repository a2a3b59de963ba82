"""fp4_gemm: repack (round trip to the checkpoint's FP4 dequant), reference GEMM (dense and grouped over
experts), and the CUDA kernel.

Tolerance classes: the repack is exact for MXFP4 and for NVFP4's e2m1 * block scale; the NVFP4 global scale is
applied after that product ((v * s) * g), where the checkpoint reference computes v * (s * g): one fp32
rounding apart (rtol 2^-23). The kernel is a GEMM: mean|C - ref| / mean|ref| <= 2e-3 against the fp32 product
with the checkpoint-dequantized weights (its weights are exact in bf16, so the error is the final bf16
rounding, ~1.4e-3 on this metric, plus fp32 summation order).
"""
from __future__ import annotations

import pytest
import torch

from cublade.numerics.fp4 import fp4_dequant_weight, fp4_quant_weight, nvfp4_dequant_weight
from cublade.ops.fp4_gemm import NVFP4_ROW_LOG2 as NV_ROW
from cublade.ops.fp4_gemm import fp4_dequant_repacked, fp4_gemm, fp4_gemm_ref, fp4_repack
from accuracy import rel_err
from profiling import kernels_run

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 device)")
BAR = 2e-3
FMTS = ["mxfp4", "nvfp4"]


def experts(E: int, N: int, K: int, fmt: str, seed: int = 0, parts: int = 1):
    """Quantized stacked experts [E, N, K] and their fp32 dequantized weights. parts=2: the rows are two
    tensors (w1; w3) with their own NVFP4 global scales, as vLLM's fused w13."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, N, K, generator=g) * 0.05
    w[:, N // 2] = 0.0
    w[0, 0, K // 3] = 2.5  # outlier
    packed, scale, gs, deq = [], [], [], []
    for e in range(E):
        rows = []
        for p in range(parts):
            t = fp4_quant_weight(w[e, p * N // parts:(p + 1) * N // parts], fmt)
            rows.append(t)
            deq.append(fp4_dequant_weight(t, fmt))
        packed.append(torch.cat([t["weight_packed"] for t in rows]))
        scale.append(torch.cat([t["weight_scale"] for t in rows]))
        if fmt == "nvfp4":
            gs.append(torch.cat([t["weight_global_scale"] for t in rows]))
    W = torch.cat(deq).reshape(E, N, K)
    return torch.stack(packed), torch.stack(scale), (torch.stack(gs) if gs else None), W


def grouped_ref(x, offsets, W):
    y = torch.zeros(x.shape[0], W.shape[1], dtype=torch.float32, device=x.device)
    o = offsets.tolist()
    for e in range(W.shape[0]):
        y[o[e]:o[e + 1]] = x[o[e]:o[e + 1]].float() @ W[e].t()
    return y


# ---- CPU ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("E,N,K", [(1, 16, 64), (3, 40, 96), (2, 37, 160), (4, 24, 256)])
def test_repack_round_trip(fmt, E, N, K):
    wp, ws, gs, W = experts(E, N, K, fmt, seed=N * K)
    rp = fp4_repack(wp, ws, fmt, gs)
    assert rp.packed.dtype == torch.int32 and rp.packed.shape == (E, -(-N // 64), -(-K // 512), 4, 1152)
    if fmt == "mxfp4":
        assert rp.row_scale is None
        torch.testing.assert_close(fp4_dequant_repacked(rp.packed, None, fmt, N, K), W, rtol=0, atol=0)
    else:
        # e2m1 * block scale * 2^-9: exact; the global scale * 2^9 per row: exact
        unscaled = torch.stack([nvfp4_dequant_weight(wp[e], ws[e], torch.ones(1)) for e in range(E)])
        torch.testing.assert_close(fp4_dequant_repacked(rp.packed, None, fmt, N, K), unscaled * 2.0**-NV_ROW,
                                   rtol=0, atol=0)
        torch.testing.assert_close(rp.row_scale[:, :N], gs.reshape(E, 1).expand(E, N) * 2.0**NV_ROW, rtol=0, atol=0)
        assert rp.row_scale.shape == (E, -(-N // 64) * 64) and (rp.row_scale[:, N:] == 0).all()
        torch.testing.assert_close(fp4_dequant_repacked(rp.packed, rp.row_scale, fmt, N, K), W,
                                   rtol=2**-23, atol=0)


def test_repack_w13_two_global_scales():
    wp, ws, gs, W = experts(3, 32, 128, "nvfp4", parts=2)
    assert gs.shape == (3, 2)
    rp = fp4_repack(wp, ws, "nvfp4", gs)
    torch.testing.assert_close(rp.row_scale[:, :16], gs[:, :1].expand(3, 16) * 2.0**NV_ROW, rtol=0, atol=0)
    torch.testing.assert_close(rp.row_scale[:, 16:32], gs[:, 1:].expand(3, 16) * 2.0**NV_ROW, rtol=0, atol=0)
    torch.testing.assert_close(fp4_dequant_repacked(rp.packed, rp.row_scale, "nvfp4", 32, 128), W,
                               rtol=2**-23, atol=0)


def mxfp4_with_scales(E: int, N: int, K: int, e8m0_hi: list[int], seed: int = 0):
    """Random MXFP4 codes; expert e's block scales (E8M0) drawn from [e8m0_hi[e] - 12, e8m0_hi[e]], one block
    each of the largest value and of 255 (NaN) in expert 0; and the fp32 dequantized weights."""
    g = torch.Generator().manual_seed(seed)
    wp = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
    ws = torch.stack([torch.randint(h - 12, h + 1, (N, K // 32), generator=g) for h in e8m0_hi]).to(torch.uint8)
    for e, h in enumerate(e8m0_hi):
        ws[e, 0, 0] = h
    ws[0, 1, 0] = 255
    W = torch.stack([fp4_dequant_weight({"weight_packed": wp[e], "weight_scale": ws[e]}, "mxfp4") for e in range(E)])
    return wp, ws, W


def test_repack_mxfp4_scales_past_two_use_a_row_factor():
    """A bf16 record holds the block scale times 2^126 (the codes are bf16 patterns worth code * 2^-126), so an
    E8M0 above 128 (scale > 2) needs a per-expert row factor 2^k; the weights stay exact."""
    wp, ws, W = mxfp4_with_scales(3, 24, 128, [120, 131, 128])
    rp = fp4_repack(wp, ws, "mxfp4")
    assert rp.row_scale is not None and rp.row_scale.shape == (3, 64)
    assert rp.row_scale[:, 0].tolist() == [1.0, 8.0, 1.0]
    torch.testing.assert_close(fp4_dequant_repacked(rp.packed, rp.row_scale, "mxfp4", 24, 128), W, rtol=0, atol=0,
                               equal_nan=True)
    assert fp4_repack(wp[[0, 2]], ws[[0, 2]], "mxfp4").row_scale is None  # scales <= 2: no row factor


@pytest.mark.parametrize("fmt", FMTS)
def test_dense_two_dim_input(fmt):
    wp, ws, gs, W = experts(1, 24, 128, fmt)
    rp = fp4_repack(wp[0], ws[0], fmt, None if gs is None else gs[0])
    assert rp.packed.shape[0] == 1
    x = torch.randn(5, 128).to(torch.bfloat16)
    y = fp4_gemm(x, rp.packed, rp.row_scale, fmt, 24)  # CPU: the reference
    ref = (x.float() @ W[0].t()).to(torch.bfloat16)
    tol = dict(rtol=0, atol=0) if fmt == "mxfp4" else dict(rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(y, ref, **tol)


@pytest.mark.parametrize("fmt", FMTS)
def test_grouped_reference(fmt):
    E, N, K = 4, 40, 128
    wp, ws, gs, W = experts(E, N, K, fmt)
    rp = fp4_repack(wp, ws, fmt, gs)
    offsets = torch.tensor([0, 3, 3, 10, 11], dtype=torch.int64)  # expert 1 has no rows; int64 is converted
    x = torch.randn(11, K).to(torch.bfloat16)
    y = fp4_gemm(x, rp.packed, rp.row_scale, fmt, N, offsets)
    assert y.shape == (11, N) and y.dtype == torch.bfloat16
    tol = dict(rtol=0, atol=0) if fmt == "mxfp4" else dict(rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(y, grouped_ref(x, offsets, W).to(torch.bfloat16), **tol)


@pytest.mark.parametrize("call,msg", [
    (lambda wp, ws, gs: fp4_repack(wp, ws, "fp4", gs), "unknown FP4 format 'fp4'"),
    (lambda wp, ws, gs: fp4_repack(wp[..., :8], ws, "nvfp4", gs), "K=16 must be a multiple of 32"),
    (lambda wp, ws, gs: fp4_repack(wp, ws[..., :3], "nvfp4", gs), "weight_scale must be"),
    (lambda wp, ws, gs: fp4_repack(wp, ws, "nvfp4", None), "nvfp4 needs the global scale"),
    (lambda wp, ws, gs: fp4_repack(wp, ws, "nvfp4", torch.ones(2, 3)), "global_scale must hold one value"),
    (lambda wp, ws, gs: fp4_repack(wp.to(torch.int32), ws, "nvfp4", gs), "weight_packed must be uint8"),
])
def test_repack_refuses_with_a_message(call, msg):
    wp, ws, gs, _ = experts(2, 16, 64, "nvfp4")
    with pytest.raises(ValueError, match=msg):
        call(wp, ws, gs)


def test_reference_needs_offsets_for_several_experts():
    wp, ws, _, _ = experts(2, 16, 64, "mxfp4")
    rp = fp4_repack(wp, ws, "mxfp4")
    with pytest.raises(ValueError, match=r"packed holds 2 experts: pass expert_offsets \[3\]"):
        fp4_gemm_ref(torch.randn(2, 64).to(torch.bfloat16), rp.packed, None, "mxfp4", 16)


# ---- GPU ----------------------------------------------------------------------------------------------

def to_cuda(rp):
    return rp._replace(packed=rp.packed.cuda(), row_scale=None if rp.row_scale is None else rp.row_scale.cuda())


@GPU
@pytest.mark.parametrize("fmt", FMTS)
def test_kernel_dense_every_m(fmt):
    for N, K in [(272, 1024), (37, 96), (129, 320)]:
        wp, ws, gs, W = experts(1, N, K, fmt, seed=N)
        rp = to_cuda(fp4_repack(wp, ws, fmt, gs))
        W = W[0].cuda()
        for M in list(range(1, 65)) + [100, 257]:
            if N != 272 and M not in (1, 7, 16, 33, 100):
                continue
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            y = torch.ops.cublade.fp4_gemm(x, rp.packed, rp.row_scale, fmt, N)
            assert y.shape == (M, N) and y.dtype == torch.bfloat16
            err = rel_err(y, x.float() @ W.t())
            assert err <= BAR, f"{fmt} N={N} K={K} M={M}: {err:.2e}"


@GPU
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("split_k", [0, 1, 2, 4, 8])
def test_kernel_grouped_experts(fmt, split_k):
    E, N, K = 8, 96, 512
    wp, ws, gs, W = experts(E, N, K, fmt, parts=2)
    rp = to_cuda(fp4_repack(wp, ws, fmt, gs))
    W = W.cuda()
    g = torch.Generator().manual_seed(split_k)
    for counts in ([1, 0, 2, 0, 0, 1, 0, 0], [5, 9, 0, 17, 3, 40, 1, 2], [0] * 7 + [70]):
        offsets = torch.tensor([0] + counts).cumsum(0).to(torch.int32).cuda()
        T = int(offsets[-1])
        x = torch.randn(T, K, generator=g).to(torch.bfloat16).cuda()
        for max_m in (0, max(counts), 1):  # 1: below the truth, costs passes, stays correct
            y = torch.ops.cublade.fp4_gemm(x, rp.packed, rp.row_scale, fmt, N, offsets, max_m, split_k)
            err = rel_err(y, grouped_ref(x, offsets, W))
            assert err <= BAR, f"{fmt} counts={counts} max_m={max_m} split_k={split_k}: {err:.2e}"


def assert_kernel(fn, name: str) -> None:
    names = kernels_run(fn)
    assert any(name in n for n in names), f"expected {name} among {sorted(names)}"


@GPU
@pytest.mark.parametrize("fmt", FMTS)
def test_kernel_wide_grouped(fmt):
    """From 17 rows per expert (the mean over min(E, M) experts) the wgmma kernel runs. Token windows start on a
    multiple of 8 inside the previous expert's rows; experts with more rows than a pass take several, experts without
    rows none. N = 200 (a partial tile group), K = 544 (a partial chunk), w13-style two global scales (NVFP4)."""
    E, N, K = 4, 200, 544
    wp, ws, gs, W = experts(E, N, K, fmt, seed=11, parts=2)
    rp = to_cuda(fp4_repack(wp, ws, fmt, gs))
    W = W.cuda()
    g = torch.Generator().manual_seed(5)
    # mean rows 63 (96 tokens a pass; 150 rows: 2 passes), 19 (32; 70 rows: 3), 17, 108 (128; 300 rows: 3)
    for counts in ([0, 23, 150, 77], [70, 0, 0, 3], [17, 17, 17, 17], [1, 129, 2, 300]):
        offsets = torch.tensor([0] + counts).cumsum(0).to(torch.int32).cuda()
        x = torch.randn(int(offsets[-1]), K, generator=g).to(torch.bfloat16).cuda()
        y = torch.ops.cublade.fp4_gemm(x, rp.packed, rp.row_scale, fmt, N, offsets)
        err = rel_err(y, grouped_ref(x, offsets, W))
        assert err <= BAR, f"{fmt} counts={counts}: {err:.2e}"
    assert_kernel(lambda: torch.ops.cublade.fp4_gemm(x, rp.packed, rp.row_scale, fmt, N, offsets), "wide_gemm_kernel")
    forced = kernels_run(lambda: torch.ops.cublade.fp4_gemm(x, rp.packed, rp.row_scale, fmt, N, offsets, 0, 1))
    assert not any("wide_gemm_kernel" in n for n in forced), "split_k >= 1 forces the streaming kernel"


@GPU
@pytest.mark.parametrize("fmt", FMTS)
def test_rows_routed_over_more_experts_pick_the_kernel_by_the_true_mean(fmt):
    """Expert parallel: x holds the rows routed to every expert of the model, this rank's sorted first (offsets) and
    the others' after offsets[E], not computed. With routed_experts the mean rows per expert is M over the model's
    experts, not this rank's: 4 of 16 experts here, 128 rows of which 32 are local. Without it the mean reads 32 (the
    wgmma kernel); with it 8 (the streaming kernel). Either way the local rows are their product, the others left
    alone."""
    E, N, K = 4, 256, 512
    wp, ws, gs, W = experts(E, N, K, fmt, seed=3)
    rp = to_cuda(fp4_repack(wp, ws, fmt, gs))
    offsets = torch.tensor([0, 9, 16, 24, 32], dtype=torch.int32, device="cuda")
    x = torch.randn(128, K, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).cuda()
    ref = grouped_ref(x[:32], offsets, W.cuda())
    for routed, kernel in ((0, "wide_gemm_kernel"), (16, None)):
        def run():
            return torch.ops.cublade.fp4_gemm(x, rp.packed, rp.row_scale, fmt, N, offsets, 0, 0, routed)

        assert rel_err(run()[:32], ref) <= BAR, routed
        names = kernels_run(run)
        assert any("wide_gemm_kernel" in n for n in names) == (kernel is not None), (routed, sorted(names))


@GPU
def test_kernel_wide_split_k_and_passes():
    """Few CTAs on a long K: the wide kernel splits K over a cluster (here 4 splits of 8 chunks) and the splits add
    up their partial sums once per pass (2 experts, 150 and 60 rows: 2 + 1 passes of 128 tokens)."""
    E, N, K = 2, 64, 16384
    wp, ws, gs, W = experts(E, N, K, "nvfp4", seed=2)
    rp = to_cuda(fp4_repack(wp, ws, "nvfp4", gs))
    offsets = torch.tensor([0, 150, 210], dtype=torch.int32, device="cuda")
    x = torch.randn(210, K, device="cuda").to(torch.bfloat16)
    y = torch.ops.cublade.fp4_gemm(x, rp.packed, rp.row_scale, "nvfp4", N, offsets)
    assert rel_err(y, grouped_ref(x, offsets, W.cuda())) <= BAR
    assert_kernel(lambda: torch.ops.cublade.fp4_gemm(x, rp.packed, rp.row_scale, "nvfp4", N, offsets),
                  "wide_gemm_kernel")


@GPU
def test_kernel_wide_four_warpgroups_many_experts():
    """32 experts with ~20 rows each fill the SMs: four consumer warpgroups per CTA (256 rows of N, here 200 and a
    partial group), 32 tokens a pass; some experts have no rows, one has 90 (3 passes)."""
    E, N, K = 32, 200, 128
    wp, ws, gs, W = experts(E, N, K, "mxfp4", seed=4)
    rp = to_cuda(fp4_repack(wp, ws, "mxfp4", gs))
    g = torch.Generator().manual_seed(9)
    counts = torch.randint(0, 40, (E,), generator=g)
    counts[[3, 17]] = 0
    counts[20] = 90
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32).cuda()
    x = torch.randn(int(offsets[-1]), K, generator=g).to(torch.bfloat16).cuda()
    y = torch.ops.cublade.fp4_gemm(x, rp.packed, rp.row_scale, "mxfp4", N, offsets)
    assert rel_err(y, grouped_ref(x, offsets, W.cuda())) <= BAR
    assert_kernel(lambda: torch.ops.cublade.fp4_gemm(x, rp.packed, rp.row_scale, "mxfp4", N, offsets),
                  "wide_gemm_kernel")


@GPU
@pytest.mark.parametrize("split_k", [0, 2])
def test_kernel_grid_covers_only_the_experts_with_rows(split_k):
    """The grid has one slice per expert that can have rows (at most T of the E); slice z finds the z-th expert
    with rows, one ballot per 32 experts. 70 experts, rows in experts past 32 and 64, fewer rows than experts,
    and more experts with rows than one ballot covers."""
    E, N, K = 70, 64, 128
    wp, ws, gs, W = experts(E, N, K, "mxfp4", seed=7)
    rp = to_cuda(fp4_repack(wp, ws, "mxfp4", gs))
    W = W.cuda()
    g = torch.Generator().manual_seed(3)
    layouts = [{33: 1}, {0: 2, 31: 1, 32: 1, 69: 3}, {64: 5}, {e: 1 + e % 3 for e in range(1, 70, 2)}]
    for rows in layouts:
        counts = [rows.get(e, 0) for e in range(E)]
        offsets = torch.tensor([0] + counts).cumsum(0).to(torch.int32).cuda()
        x = torch.randn(int(offsets[-1]), K, generator=g).to(torch.bfloat16).cuda()
        y = torch.ops.cublade.fp4_gemm(x, rp.packed, rp.row_scale, "mxfp4", N, offsets, 0, split_k)
        err = rel_err(y, grouped_ref(x, offsets, W))
        assert err <= BAR, f"experts with rows {sorted(rows)[:6]}... split_k={split_k}: {err:.2e}"


@GPU
@pytest.mark.parametrize("counts", [[2, 3, 1], [20, 37, 9]])  # the streaming kernel; the wgmma one (22 rows a mean)
def test_kernel_mxfp4_scales_past_two_and_nan(counts):
    """Block scales up to 2^4 (a row factor 2^3 for expert 1), 2^-19 .. 2^1 elsewhere, one NaN block: the kernel's
    weights are the reference's (NaN where the NaN block feeds, the bf16 GEMM error elsewhere)."""
    wp, ws, W = mxfp4_with_scales(3, 24, 128, [120, 131, 128], seed=1)
    rp = to_cuda(fp4_repack(wp, ws, "mxfp4"))
    offsets = torch.tensor([0] + counts).cumsum(0).to(torch.int32).cuda()
    x = torch.randn(sum(counts), 128, device="cuda").to(torch.bfloat16)
    y = torch.ops.cublade.fp4_gemm(x, rp.packed, rp.row_scale, "mxfp4", 24, offsets)
    ref = grouped_ref(x, offsets, W.cuda())
    assert torch.equal(y.isnan(), ref.isnan()) and ref.isnan().any()
    ok = ~ref.isnan()
    assert rel_err(y[ok], ref[ok]) <= BAR
    wide = any("wide_gemm_kernel" in n for n in kernels_run(
        lambda: torch.ops.cublade.fp4_gemm(x, rp.packed, rp.row_scale, "mxfp4", 24, offsets)))
    assert wide == (sum(counts) >= 16 * 3)


@GPU
def test_kernel_nan_scale_and_inputs():
    wp, ws, gs, W = experts(1, 32, 128, "mxfp4")
    ws = ws.clone()
    ws[0, 3, 1] = 255  # E8M0 NaN code: row 3's outputs are NaN, as in the reference
    rp = to_cuda(fp4_repack(wp, ws, "mxfp4"))
    x = torch.randn(4, 128, device="cuda").to(torch.bfloat16)
    x[2, 5] = float("nan")
    y = torch.ops.cublade.fp4_gemm(x, rp.packed, None, "mxfp4", 32)
    assert torch.isnan(y[:, 3]).all() and torch.isnan(y[2]).all()
    keep = torch.ones(32, dtype=torch.bool)
    keep[3] = False
    assert torch.isfinite(y[[0, 1, 3]][:, keep]).all()
    assert (y[[0, 1, 3], 16] == 0).all()  # the all-zero row


@GPU
def test_kernel_refuses_with_a_message():
    wp, ws, gs, _ = experts(2, 32, 128, "nvfp4")
    rp = to_cuda(fp4_repack(wp, ws, "nvfp4", gs))
    op = torch.ops.cublade.fp4_gemm
    x = torch.randn(3, 128, device="cuda").to(torch.bfloat16)
    offs = torch.tensor([0, 1, 3], dtype=torch.int32, device="cuda")
    cases = [
        (ValueError, "fp4_gemm: format must be 'mxfp4' or 'nvfp4', got 'fp4'",
         (x, rp.packed, rp.row_scale, "fp4", 32, offs)),
        (NotImplementedError, "fp4_gemm: x must be bfloat16", (x.half(), rp.packed, rp.row_scale, "nvfp4", 32, offs)),
        (ValueError, "fp4_gemm: packed holds 2 experts: pass expert_offsets", (x, rp.packed, rp.row_scale, "nvfp4", 32)),
        (ValueError, r"fp4_gemm: expert_offsets must be a contiguous int32 \[3\]",
         (x, rp.packed, rp.row_scale, "nvfp4", 32, offs.long())),
        (ValueError, r"fp4_gemm: packed must be a contiguous int32 \[E, 2, 1, 4, 1152\]",
         (x, rp.packed, rp.row_scale, "nvfp4", 80, offs)),
        (ValueError, "fp4_gemm: in_features K=112 must be a positive multiple of 32",
         (x[:, :112], rp.packed, rp.row_scale, "nvfp4", 32, offs)),
        (ValueError, "fp4_gemm: row_scale must be a contiguous float32", (x, rp.packed, rp.row_scale[:1], "nvfp4", 32, offs)),
        (ValueError, r"fp4_gemm: routed_experts must be >= 0 \(0 = the experts packed holds\), got -1",
         (x, rp.packed, rp.row_scale, "nvfp4", 32, offs, 0, 0, -1)),
    ]
    for exc, msg, args in cases:
        with pytest.raises(exc, match=msg):
            op(*args)


@GPU
@pytest.mark.parametrize("fmt", FMTS)
def test_opcheck(fmt):
    wp, ws, gs, _ = experts(3, 48, 128, fmt)
    rp = to_cuda(fp4_repack(wp, ws, fmt, gs))
    x = torch.randn(6, 128, device="cuda").to(torch.bfloat16)
    offs = torch.tensor([0, 2, 2, 6], dtype=torch.int32, device="cuda")
    torch.library.opcheck(torch.ops.cublade.fp4_gemm.default, (x, rp.packed, rp.row_scale, fmt, 48, offs, 4, 0))
    torch.library.opcheck(torch.ops.cublade.fp4_gemm.default, (x, rp.packed, rp.row_scale, fmt, 48, offs, 4, 0, 6))


@GPU
def test_torch_compile_fullgraph():
    wp, ws, gs, W = experts(4, 64, 256, "nvfp4")
    rp = to_cuda(fp4_repack(wp, ws, "nvfp4", gs))

    class Experts(torch.nn.Module):
        def forward(self, x, offsets):
            return fp4_gemm(x, rp.packed, rp.row_scale, "nvfp4", 64, offsets, 8) + 1

    mod = Experts()
    compiled = torch.compile(mod, fullgraph=True)
    x = torch.randn(5, 256, device="cuda").to(torch.bfloat16)
    offs = torch.tensor([0, 2, 2, 4, 5], dtype=torch.int32, device="cuda")
    torch.testing.assert_close(compiled(x, offs), mod(x, offs), rtol=0, atol=0)
