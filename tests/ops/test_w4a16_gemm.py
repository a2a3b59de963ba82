"""w4a16_gemm: repack (exact round trip to the checkpoint's dequant), reference GEMM, and the CUDA kernel.

Tolerance classes: the repack and the reference are exact (rtol=0, atol=0: same fp32 weights, same matmul);
the kernel is a GEMM (fp32 sums in another order, one rounding to bf16/fp16 at the end), so every output is held
to one rounding of the fp32 product with the dequantized weights (|C - ref| <= 2^-8 |ref|, bf16's half ulp, plus
1e-4 mean|ref| for the summation order), and outputs of 4096 elements or more also to mean|C - ref| / mean|ref|
<= 2e-3 (the accuracy bar; the final bf16 rounding alone is ~1.4e-3 on this metric, fp16's ~2e-4; on a few dozen
outputs the mean is sample noise around that, 2.1e-3 was seen for 37). x is random but seeded per test. The
kernels apply each group's scale to an fp32 partial sum, so the weights themselves are never rounded, except in the
wide kernel's rounded passes (bf16 x at group size 128, from 160 rows, passes of up to 256: ROUNDED_MIN_ROWS), which
multiply the weights rounded once to bf16 (the prefill path's): their rows are held to one rounding of the product
with those weights. From prefill_rows (128 rows; 448 at group size 128 or per channel, where the wide kernel runs
from 17, 640 on weights of 2^27 elements or more; with the rounded passes 257, 640 or 1024 by the weight's size) the
op takes its prefill path instead (w4a16_dequant to x's dtype, then cuBLAS): held to one rounding of the product
with the weights rounded to x's dtype, bit-equal to that product in torch, and to <= 4e-3 against the fp32 product
(the weight's rounding to bf16 adds ~0.7e-3).
"""
from __future__ import annotations

import itertools
import re

import pytest
import torch

from cublade.numerics.int4 import int4_dequant_weight, int4_quant_weight, pack_int4
from cublade.numerics.linear import w4a16_linear_ref
from cublade.ops.w4a16_gemm import (record_words, w4a16_dequant_repacked, w4a16_gemm, w4a16_gemm_ref,
                                    w4a16_repack)
from accuracy import assert_one_rounding, rel_err
from profiling import kernels_run, stream_k_slices

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 device)")
BAR = 2e-3


def quantized(N: int, K: int, G: int, sym: bool, seed: int = 0, zero_row: bool = True, outlier: bool = True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    if zero_row:
        w[N // 2] = 0.0  # all-zero rows exist in real (padded) checkpoints
    if outlier:
        w[0, K // 3] = 3.0  # one huge outlier: its group's scale is large, the rest of the group rounds to 0
    q = int4_quant_weight(w, G, sym)
    return q["weight_packed"], q["weight_scale"], q.get("weight_zero_point")


# ---- CPU: repack and reference ------------------------------------------------------------------------

# (N, K, G): tile multiples and not (N % 16, K % 64), per-channel with K % 64 != 0, G = 32 with K % 64 = 32
SHAPES = [(32, 128, 128), (40, 256, 128), (37, 96, 32), (16, 200, -1), (33, 192, 64), (1, 64, 64), (50, 320, 32)]


@pytest.mark.parametrize("N,K,G", SHAPES)
@pytest.mark.parametrize("sym", [True, False])
def test_repack_round_trip_is_exact(N, K, G, sym):
    wp, ws, wz = quantized(N, K, G, sym, seed=N + K)
    rp = w4a16_repack(wp, ws, wz, G)
    assert rp.packed.dtype == torch.int32 and rp.symmetric == sym
    assert rp.packed.shape == (-(-N // 64), -(-K // 512), 4, 1024 + record_words(G, sym))
    ref = int4_dequant_weight(wp, ws, wz, G)
    torch.testing.assert_close(w4a16_dequant_repacked(rp.packed, G, sym, N, K), ref, rtol=0, atol=0)


def test_repack_places_each_nibble():
    """One nonzero weight at a time lands at the documented (tile group, chunk, tile, lane, word, nibble), and
    its group's scale record right after the tile block's 1024 words."""
    N, K = 80, 1024
    for row, k in [(0, 0), (3, 1), (8, 0), (11, 5), (2, 2), (9, 3), (5, 37), (15, 63), (70, 700), (33, 1023)]:
        u = torch.zeros(N, K, dtype=torch.int64)
        u[row, k] = 5
        s = torch.ones(N, K // 128, dtype=torch.bfloat16)
        s[row, k // 128] = 3.0
        rp = w4a16_repack(pack_int4(u), s, None, 128)
        tg, r, rr = row // 64, (row % 64) // 16, row % 16
        g, rh = rr % 8, rr // 8
        c, kk = divmod(k, 512)
        p, kk = divmod(kk, 64)
        h, kk = divmod(kk, 32)
        t, kk = divmod(kk, 8)
        sl, koff = divmod(kk, 4)
        j = {(0, 0): 0, (0, 1): 4, (1, 0): 1, (1, 1): 5, (0, 2): 2, (0, 3): 6, (1, 2): 3, (1, 3): 7}[(rh, koff)]
        w = (p * 32 + g * 4 + t) * 4 + 2 * h + sl
        nz = (rp.packed[..., :1024] != 0).nonzero().tolist()
        assert nz == [[tg, c, r, w]]
        assert (rp.packed[tg, c, r, w].item() >> (4 * j)) & 0xF == 5
        rec = rp.packed[tg, c, r, 1024 + ((k % 512) // 128) * 8 + g].item() & 0xFFFFFFFF
        assert (rec >> (16 * rh)) & 0xFFFF == 0x4040  # bf16 3.0 in the half of row g (+8 rh)


@pytest.mark.parametrize("G,sym", [(128, True), (32, False), (-1, True)])
def test_reference_equals_linear_reference(G, sym):
    N, K = 40, 256
    wp, ws, wz = quantized(N, K, G, sym)
    rp = w4a16_repack(wp, ws, wz, G)
    x = torch.randn(3, 5, K).to(torch.bfloat16)
    y = w4a16_gemm_ref(x, rp.packed, G, sym, N)
    assert y.shape == (3, 5, N) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, w4a16_linear_ref(x, wp, ws, wz, G), rtol=0, atol=0)
    # and the fp32 product with the dequantized weights, rounded once
    ref = (x.float().reshape(-1, K) @ int4_dequant_weight(wp, ws, wz, G).t()).to(torch.bfloat16).reshape(3, 5, N)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)


def test_cpu_entry_is_the_reference():
    wp, ws, wz = quantized(24, 128, 64, False)
    rp = w4a16_repack(wp, ws, wz, 64)
    x = torch.randn(4, 128, dtype=torch.float16)
    torch.testing.assert_close(w4a16_gemm(x, rp.packed, 64, False, 24),
                               w4a16_gemm_ref(x, rp.packed, 64, False, 24), rtol=0, atol=0)


@pytest.mark.parametrize("bad,msg", [
    (dict(group_size=256), "group_size must be one of"),
    (dict(group_size=128, K=192), "not a multiple of group_size=128"),
    (dict(scale_shape=(8, 3)), "weight_scale must be [8, 2]"),
    (dict(packed_dtype=torch.int64), "weight_packed must be int32"),
])
def test_repack_refuses_with_a_message(bad, msg):
    K = bad.get("K", 128)
    wp = torch.zeros(8, K // 8, dtype=bad.get("packed_dtype", torch.int32))
    ws = torch.ones(bad.get("scale_shape", (8, K // 64)), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        w4a16_repack(wp, ws, None, bad.get("group_size", 64))


# ---- GPU: the kernel --------------------------------------------------------------------------------------

def gpu_case(N, K, G, sym, seed=0):
    wp, ws, wz = quantized(N, K, G, sym, seed=seed)
    w = int4_dequant_weight(wp, ws, wz, G).cuda()
    rp = w4a16_repack(wp.cuda(), ws.cuda(), None if wz is None else wz.cuda(), G)
    return rp, w


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # the random x of every test (CPU and CUDA generators)


# gemm_plan.cuh's kRoundedMinRows and kRoundedPassRows: with bf16 x at group size 128 (and prefill=True) the wide
# kernel runs passes of up to 256 rows from 160 rows left (192 tokens up to 192 rows), on the weights rounded once to
# bf16
ROUNDED_MIN_ROWS, ROUNDED_PASS_ROWS = 160, 256


def wide_pass_rows(left: int, N: int, K: int, rounded: bool) -> int:
    """gemm_plan.cuh's wide::pass_rows: rows of the next wide pass (0: the streaming kernel takes the rest)."""
    if rounded and left >= ROUNDED_MIN_ROWS:
        return min(left, ROUNDED_PASS_ROWS)
    return min(left, 128) if left >= 17 else left if left >= 9 and N * K >= 96 << 20 else 0


def prefill_rows(N: int, K: int, G: int, rounded: bool) -> int:
    """w4a16_gemm.h's w4a16_gemm_prefill_rows: rows from which the op takes its prefill path. rounded: bf16 x with
    prefill=True (the rounded passes, at group size 128)."""
    if G not in (128, -1):
        return 128
    if rounded and G == 128:
        return 257 if N * K < 1 << 25 else 640 if N * K < 1 << 26 else 1024
    return 640 if N * K >= 1 << 27 else 448


def rounded_rows_of(M: int, rp, dtype, split_k: int = 0, prefill: bool = True) -> torch.Tensor:
    """Which rows of an M-row call the op multiplies with the weights rounded to x's dtype: every row on the prefill
    path, else the rows of its rounded passes (more than 128 rows; bf16 x at group size 128)."""
    mask = torch.zeros(M, dtype=torch.bool)
    if split_k or not prefill:
        return mask
    if M >= prefill_rows(rp.size_n, rp.size_k, rp.group_size, dtype == torch.bfloat16):
        return ~mask
    if dtype != torch.bfloat16 or rp.group_size != 128:
        return mask
    m0 = 0
    while p := wide_pass_rows(M - m0, rp.size_n, rp.size_k, True):
        mask[m0:m0 + p] = p > 128
        m0 += p
    return mask


def check(x, rp, w, split_k=0, prefill=True):
    """The op within one rounding of the fp32 product with the weights it multiplies (exact, or rounded once to x's
    dtype in its rounded passes and on its prefill path)."""
    y = torch.ops.cublade.w4a16_gemm(x, rp.packed, rp.group_size, rp.symmetric, rp.size_n, split_k, prefill)
    x2 = x.reshape(-1, x.shape[-1]).float()
    ref = x2 @ w.t()
    rounded = rounded_rows_of(x2.shape[0], rp, x.dtype, split_k, prefill).to(x.device)
    ref[rounded] = x2[rounded] @ w.to(x.dtype).float().t()
    assert y.shape == (*x.shape[:-1], rp.size_n) and y.dtype == x.dtype
    assert_one_rounding(y.reshape(-1, rp.size_n), ref, BAR)
    return y


@GPU
def test_kernel_every_m_1_to_64_and_large():
    rp, w = gpu_case(272, 1024, 128, True)
    for M in list(range(1, 65)) + [100, 127, 128, 200, 255, 319, 447]:  # from 17 the wide kernel (257: deq + mm)
        check(torch.randn(M, 1024, device="cuda").to(torch.bfloat16), rp, w)
    check(torch.randn(257, 1024, device="cuda").to(torch.bfloat16), rp, w, split_k=1)  # forced: 9 passes


def check_wide(x, rp, w):
    """check(), and close to the streaming kernel forced (split_k=1) on the same input (4e-3 where the op rounded the
    weights: their rounding adds ~0.7e-3 to the outputs' two roundings)."""
    y = check(x, rp, w)
    y1 = torch.ops.cublade.w4a16_gemm(x, rp.packed, rp.group_size, rp.symmetric, rp.size_n, 1)
    rounded = rounded_rows_of(y.reshape(-1, rp.size_n).shape[0], rp, x.dtype).any()
    assert rel_err(y.float(), y1.float()) <= (4e-3 if rounded else 2e-3)


@GPU
@pytest.mark.parametrize("G,sym,dtype", [(128, True, torch.bfloat16), (128, False, torch.float16),
                                         (-1, True, torch.float16), (-1, False, torch.bfloat16)])
def test_wide_kernel_passes_and_remainder(G, sym, dtype):
    """From 17 rows at group size 128 or per channel the op runs the wide (wgmma) kernel, 32, 48, 64, 96 or 128
    tokens per pass and up to 128 rows a pass, and a last pass of up to 16 rows on the streaming kernel: every row
    count lands within one rounding of the reference, and close to the streaming kernel forced on the same input."""
    rp, w = gpu_case(200, 1024, G, sym, seed=7)
    for M in (17, 31, 32, 33, 48, 49, 64, 65, 96, 97, 128, 129, 144, 145, 161, 255, 256, 300):
        check_wide(torch.randn(M, 1024, device="cuda").to(dtype), rp, w)


@GPU
def test_wide_kernel_four_warpgroups_on_large_n():
    """Up to 32 rows per pass, when CTAs of 4 tile groups still fill 3/4 of the SMs the wide kernel runs 4 consumer
    warpgroups per CTA (about 256 rows per SM here; the last CTA has 3 tile groups, the last of them partial); 2 from 33
    rows: within the bars, and close to the streaming kernel forced on the same input."""
    N = 256 * torch.cuda.get_device_properties(0).multi_processor_count - 100
    rp, w = gpu_case(N, 1024, 128, True, seed=3)
    for M in (17, 32, 40, 64, 100):  # 17, 32: 4 warpgroups; 40: 48 tokens per pass, 64: 64; 100: 128 tokens
        check_wide(torch.randn(M, 1024, device="cuda").to(torch.bfloat16), rp, w)


@GPU
@pytest.mark.parametrize("G,dtype", [(128, torch.bfloat16), (-1, torch.float16)])
def test_wide_kernel_takes_9_to_16_rows_on_large_weights(G, dtype):
    """At 9-16 rows (a call's, or the last pass's of a larger call) the wide kernel runs 16 tokens a pass when the
    weight has 96 Mi elements or more (4096 x 32768 and Llama-3-8B's gate_up 4096 x 28672 here), the streaming kernel
    below that (the same rows on 4096 x 16384) and at 1-8 rows: the kernels launched say which, and every output is
    within the bars."""
    K = 4096
    big, w_big = gpu_case(32768, K, G, True, seed=11)
    small, w_small = gpu_case(16384, K, G, True, seed=12)
    gate_up, w_gate_up = gpu_case(28672, K, G, True, seed=13)
    for rp, w, M, wide in [(big, w_big, 9, True), (big, w_big, 16, True), (big, w_big, 8, False),
                           (big, w_big, 128 + 12, True), (small, w_small, 16, False), (gate_up, w_gate_up, 12, True)]:
        x = torch.randn(M, K, device="cuda").to(dtype)
        names = kernels_run(lambda: check_wide(x, rp, w))
        gemm = [n for n in names if "cublade" in n and "gemm_kernel" in n]  # in launch order
        assert gemm, f"no cublade GEMM kernel among {names}"
        # check_wide also runs the streaming kernel forced (split_k=1): the automatic call's launches come first
        assert ("wide_gemm_kernel" in gemm[0]) == wide, (M, rp.size_n, gemm)
        if M > 128:  # the 12-row remainder: a second wide pass, 16 tokens
            # the template's tokens per pass, after the int4 batch policy: demangled or not
            assert re.search(r"wide_gemm_kernel(<[^<>]*<[^<>]*>, 16,|I\w+?Li16E)", gemm[1]), gemm


@GPU
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("N", [200, 150])
def test_wide_kernel_rounded_passes_from_160_rows(N, sym):
    """bf16 x at group size 128: from 160 rows the wide kernel runs passes of up to 256 rows on Int4PrescaledBatch
    (the weights rounded once to bf16 in the A fragments, 2 warpgroups: 192 tokens for a pass of up to 192 rows, else
    256; stream-K where the tile groups pair up, the split-K form where they do not), the rest in exact passes; fp16 x
    and prefill=False keep every pass exact. The rounded weights are w4a16_dequant's bf16 weights (the prefill path's),
    so those rows are held to one rounding of the product with them. A weight under 2^25 elements takes the prefill
    path from 257 rows, so the calls of more than one pass run on one of 2^25 or more (K 8192, N 4224 or 4160: 66 or
    65 tile groups)."""
    small, mid = (N, 1024), (4224 if N == 200 else 4160, 8192)
    bf16, fp16 = torch.bfloat16, torch.float16
    # (weight, M, dtype, prefill, the rounded passes' tokens in launch order, wide launches in all)
    cases = [(small, 159, bf16, True, [], 2), (small, 160, bf16, True, [192], 1), (small, 192, bf16, True, [192], 1),
             (small, 193, bf16, True, [256], 1), (small, 256, bf16, True, [256], 1), (small, 256, fp16, True, [], 2),
             (small, 300, bf16, False, [], 3), (mid, 300, bf16, True, [256], 2), (mid, 384, bf16, True, [256], 2),
             (mid, 448, bf16, True, [256, 192], 2)]
    for (n, k), group in itertools.groupby(cases, key=lambda c: c[0]):
        rp, w = gpu_case(n, k, 128, sym, seed=n)
        wq = torch.ops.cublade.w4a16_dequant(rp.packed, 128, sym, n, k, torch.bfloat16)
        torch.testing.assert_close(wq.float(), w.to(torch.bfloat16).float(), rtol=0, atol=0)
        for _, M, dtype, prefill, tokens, launches in group:
            x = torch.randn(M, k, device="cuda").to(dtype)
            names = kernels_run(lambda: check(x, rp, w, prefill=prefill))
            wide = [name for name in names if "wide_gemm_kernel" in name]
            pre = [name for name in wide if "PrescaledBatch" in name]
            assert [rounded_tokens(name) for name in pre] == tokens, (n, k, M, dtype, prefill, wide)
            assert len(wide) == launches, (n, k, M, wide)
            assert all(bool(stream_k(name)) == (N == 200) for name in pre), (n, pre)
    rp, w = gpu_case(N, 1152, 128, sym, seed=N + 1)  # K past the blob's last whole chunk of 512
    check(torch.randn(256, 1152, device="cuda").to(torch.bfloat16), rp, w)


def rounded_tokens(kernel_name):
    """The tokens of a rounded pass's wide_gemm_kernel launch (Int4PrescaledBatch, 2 warpgroups, stage K 128),
    demangled or not."""
    m = re.search(r"PrescaledBatch<(?:true|false)>, (\d+), 2, 128,|PrescaledBatch\w+?Li(\d+)ELi2ELi128E",
                  kernel_name)
    return int(m.group(1) or m.group(2)) if m else None


def stream_k(kernel_name):
    """Whether a wide_gemm_kernel launch is stream-K (its last template argument), demangled or not."""
    return re.search(r"wide_gemm_kernel<.*, (false|true), true>\(|wide_gemm_kernel\w*Lb[01]ELb1EEEv", kernel_name)


@GPU
@pytest.mark.parametrize("G,dtype", [(128, torch.bfloat16), (-1, torch.float16)])
def test_wide_kernel_stream_k_when_the_last_wave_is_short(G, dtype):
    """With N = 128 x SMs the wide kernel's CTAs (2 tile groups each, one per SM) fill one wave: split-K. 128 rows more
    make one CTA more, a last wave of one: stream-K instead, one CTA per SM sharing out the (tile, stage) units, tiles
    cut between CTAs added up by their owners. Both within the bars, and stream-K gives the same bits on every call
    (the owner adds the partial sums in a fixed order)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for N, want_sk in [(128 * sms, False), (128 * sms + 128, True)]:
        rp, w = gpu_case(N, 2048, G, True, seed=N)
        for M in (20, 100):  # 32 and 128 tokens per pass, 2 warpgroups
            x = torch.randn(M, 2048, device="cuda").to(dtype)
            ys = []
            names = kernels_run(lambda: ys.append(check(x, rp, w)))
            wide = [n for n in names if "wide_gemm_kernel" in n]
            assert wide and all(bool(stream_k(n)) == want_sk for n in wide), (N, M, wide)
            assert torch.equal(ys[0], check(x, rp, w))


@GPU
@pytest.mark.parametrize("K,splits", [(8192, 2), (16384, 4)])
def test_wide_kernel_splits_k_on_small_grids(K, splits):
    """The wide kernel splits K (thread-block clusters) when its CTAs fill under half the SMs and every split keeps
    >= 8 chunks of 512 K, if it cannot run stream-K (an odd number of tile groups here: 150 rows, 3 groups in 2
    CTAs); K = 8192 -> 2 splits, 16384 -> 4. The sums stay within the bars (128 tokens per pass: the splits' partial
    sums fill 64 KB of the ring's memory)."""
    rp, w = gpu_case(150, K, 128, True, seed=K)
    for M in (20, 40, 64, 90, 100, 128):
        check(torch.randn(M, K, device="cuda").to(torch.bfloat16), rp, w)


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("G,rows", [(64, 128), (128, 448)])
def test_large_m_dequantizes_then_runs_a_dense_gemm(dtype, G, rows):
    """From 128 rows (448 at group size 128 or per channel, 257 there with bf16 x on this small weight) the op
    dequantizes the weight to x's dtype (w4a16_dequant) and multiplies with cuBLAS: the same bits as that product
    in torch, and within the error of a dense GEMM on the rounded weight."""
    rp, w = gpu_case(200, 1024, G, False)
    wq = torch.ops.cublade.w4a16_dequant(rp.packed, rp.group_size, rp.symmetric, rp.size_n, 1024, dtype)
    for shape in [(rows, 1024), (3, 150, 1024)]:
        x = torch.randn(shape, device="cuda").to(dtype)
        y = torch.ops.cublade.w4a16_gemm(x, rp.packed, rp.group_size, rp.symmetric, rp.size_n, 0)
        assert y.shape == (*shape[:-1], rp.size_n) and y.dtype == dtype
        torch.testing.assert_close(y.reshape(-1, rp.size_n), x.reshape(-1, 1024) @ wq.t(), rtol=0, atol=0)
        err = rel_err(y.reshape(-1, rp.size_n), x.reshape(-1, 1024).float() @ w.t())
        assert err <= 4e-3, f"mean|C-ref|/mean|ref| = {err:.2e}"  # bf16 weight + output rounding: ~2.1e-3


@GPU
def test_prefill_switch_by_weight_size_and_passes():
    """At group size 128 the op runs its wide kernel below prefill_rows and its prefill path (w4a16_dequant, then
    cuBLAS) from there: with bf16 x (the rounded passes of 256 rows) from 257 rows on weights under 2^25 elements
    (200 x 1024 here), 640 under 2^26 (4160 x 8192), 1024 from 2^26 (16384 x 8192); with fp16 x (passes of 128, the
    weights exact) from 448, 640 from 2^27 (benchmarks/tuning/prefill_switch.py). The kernels launched say which, and
    the outputs hold to check()'s bars on both sides."""
    for N, K, dtype, switch in [(200, 1024, torch.bfloat16, 257), (200, 1024, torch.float16, 448),
                                (4160, 8192, torch.bfloat16, 640), (16384, 8192, torch.bfloat16, 1024),
                                (16384, 8192, torch.float16, 640)]:
        assert prefill_rows(N, K, 128, dtype == torch.bfloat16) == switch
        rp, w = gpu_case(N, K, 128, True, seed=N)
        for M in (switch - 1, switch):
            x = torch.randn(M, K, device="cuda").to(dtype)
            names = kernels_run(lambda: check(x, rp, w))
            ran = (any("w4a16_dequant_kernel" in n for n in names), any("wide_gemm_kernel" in n for n in names))
            assert ran == (M >= switch, M < switch), (N, K, dtype, M, names)
        rp = w = None
        torch.cuda.empty_cache()


@GPU
@pytest.mark.parametrize("G", [64, 128, -1])
def test_without_prefill_every_m_runs_the_kernels(G):
    """prefill=False (VLLM_BATCH_INVARIANT=1's w4a16 layers): from the prefill rows on the op stays on its kernels
    (streaming at group size 64, the wide kernel in passes of 128 otherwise), no dequantize launch, and keeps their
    numerics: within one rounding of the fp32 reference, where the prefill path rounds the weights first."""
    rp, w = gpu_case(200, 1024, G, False)
    for M in (448, 700):
        x = torch.randn(M, 1024, device="cuda").to(torch.bfloat16)
        names = kernels_run(lambda: torch.ops.cublade.w4a16_gemm(x, rp.packed, G, False, 200, 0, False))
        assert not any("w4a16_dequant_kernel" in n for n in names), names
        check(x, rp, w, prefill=False)


@GPU
@pytest.mark.parametrize("G,sym,dtype", list(itertools.product([32, 64, 128, -1], [True, False],
                                                                [torch.bfloat16, torch.float16])))
def test_kernel_groups_sym_asym_dtypes(G, sym, dtype):
    for N, K in [(304, 2048), (37, 320), (129, 192 if G != 128 else 256)]:
        if G != -1 and K % G:
            continue
        rp, w = gpu_case(N, K, G, sym, seed=N)
        for M in (1, 3, 8, 9, 16, 19, 33, 64):
            check(torch.randn(M, K, device="cuda").to(dtype), rp, w)


@GPU
def test_kernel_per_channel_k_not_a_packet_multiple():
    rp, w = gpu_case(48, 200, -1, False)  # K % 64 = 8: the last packet is partial
    for M in (1, 7, 20):
        check(torch.randn(M, 200, device="cuda").to(torch.bfloat16), rp, w)


@GPU
@pytest.mark.parametrize("split_k", [1, 2, 3, 4, 8])  # 3: chunks do not divide evenly
def test_kernel_split_k(split_k):
    for G in (32, 128, -1):
        rp, w = gpu_case(160, 4096, G, G == 32)
        for M in (1, 16, 40):
            check(torch.randn(M, 4096, device="cuda").to(torch.bfloat16), rp, w, split_k)


@GPU
def test_kernel_real_decode_shapes():
    for K, N in [(4096, 14336), (8192, 28672 // 4)]:
        rp, w = gpu_case(N, K, 128, True)
        for M in (1, 4, 16):
            check(torch.randn(M, K, device="cuda").to(torch.bfloat16), rp, w)


@GPU
@pytest.mark.parametrize("groups_per_sm,K,splits", [(1, 8192, 2), (1, 4096, 1), (2, 8192, 1), (0.5, 4096, 2),
                                                    (0.5, 2048, 1)])
def test_automatic_splits(groups_per_sm, K, splits):
    """The launcher splits K in 2 when the grid has under 1.5 tile groups per SM and each split keeps >= 8 chunks
    of 512 K, or >= 4 while the split grid still has at most 1.5 tile groups per SM (up to 16 rows: the 0.5 cases,
    half as many groups as SMs), else not: the automatic call equals that split_k bit for bit (and stays within the
    bars). More rows than 16 keep the 8-chunk rule (group size 64, which the wide kernel does not take, at 32 rows)."""
    N = int(64 * groups_per_sm * torch.cuda.get_device_properties(0).multi_processor_count)
    rp, w = gpu_case(N, K, 128, True)
    # 9-16 rows take the wide kernel on weights of 96 Mi elements or more (the (2, 8192) case): 16 only below that
    for M in (1, 8) if N * K >= 96 * 2**20 else (1, 8, 16):
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        y = check(x, rp, w)
        torch.testing.assert_close(y, torch.ops.cublade.w4a16_gemm(x, rp.packed, 128, True, N, splits), rtol=0,
                                   atol=0)
    if groups_per_sm == 0.5 and splits == 2:
        rp, w = gpu_case(N, K, 64, True)
        x = torch.randn(32, K, device="cuda").to(torch.bfloat16)
        y = check(x, rp, w)
        torch.testing.assert_close(y, torch.ops.cublade.w4a16_gemm(x, rp.packed, 64, True, N, 1), rtol=0, atol=0)


@GPU
@pytest.mark.parametrize("groups_per_sm,G,M,slices", [(0.5, 128, 1, 2), (0.5, 64, 8, 2), (0.5, -1, 1, 1),
                                                      (0.5, 128, 16, 2), (3, 128, 1, 1)])
def test_small_grids_take_two_k_slices(groups_per_sm, G, M, slices):
    """When the streaming kernel's grid has at most 2 CTAs per SM (0.5 tile groups per SM in 2 splits here) and up
    to 8 rows, it runs two K slices per chunk (8 consumer warps: stream_gemm_kernel<..., TPW 1, KSL 2>) and a ring of
    3 stages; per-channel scales keep one slice; 16 rows keep their 2 tiles per warp (KSL 2 = TPW 2); 3 tile groups
    per SM keep one slice. The kernel launched says which, and the outputs stay within the bars."""
    N = int(64 * groups_per_sm * torch.cuda.get_device_properties(0).multi_processor_count)
    rp, w = gpu_case(N, 4096, G, True)
    x = torch.randn(M, 4096, device="cuda").to(torch.bfloat16)
    names = kernels_run(lambda: check(x, rp, w))
    assert stream_k_slices(names) == [slices], names


@GPU
def test_kernel_strided_and_batched_inputs():
    rp, w = gpu_case(96, 512, 64, True)
    big = torch.randn(12, 640, device="cuda").to(torch.bfloat16)
    check(big[:, 64:576], rp, w)  # row stride 640, offset 64 elements (16-byte aligned)
    check(big[:, 8:520], rp, w)  # offset 8 elements
    check(big[:, 1:513], rp, w)  # misaligned start: the op copies
    check(torch.randn(512, 7, device="cuda").to(torch.bfloat16).t(), rp, w)  # column-strided
    check(torch.randn(2, 3, 512, device="cuda").to(torch.bfloat16), rp, w)  # [B, S, K]


@GPU
def test_kernel_zero_rows_nan_and_inf():
    rp, w = gpu_case(64, 256, 128, True)
    x = torch.randn(4, 256, device="cuda").to(torch.bfloat16)
    y = check(x, rp, w)
    assert (y[:, 32] == 0).all()  # the all-zero weight row (N // 2)
    x[1, 7] = float("nan")
    x[2, 9] = float("inf")
    y = torch.ops.cublade.w4a16_gemm(x, rp.packed, 128, True, 64)
    assert torch.isnan(y[1]).all()
    assert not torch.isfinite(y[2]).all()
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[3]).all()
    xw = torch.cat([x, torch.randn(20, 256, device="cuda").to(torch.bfloat16)])  # 24 rows: the wide kernel
    y = torch.ops.cublade.w4a16_gemm(xw, rp.packed, 128, True, 64)
    assert torch.isnan(y[1]).all() and not torch.isfinite(y[2]).all()
    assert torch.isfinite(y[[0, 3]]).all() and torch.isfinite(y[4:]).all()


@GPU
def test_kernel_writes_every_output():
    rp, w = gpu_case(33, 128, 32, False)
    for _ in range(3):  # the output is fresh memory each call; garbage would show as a large error or NaN
        y = check(torch.randn(5, 128, device="cuda").to(torch.bfloat16), rp, w)
        assert torch.isfinite(y).all()


@GPU
def test_kernel_refuses_with_a_message():
    rp, _ = gpu_case(32, 256, 128, True)
    op = torch.ops.cublade.w4a16_gemm
    x = torch.randn(2, 256, device="cuda").to(torch.bfloat16)
    cases = [
        (NotImplementedError, "w4a16_gemm: x must be bfloat16 or float16", (x.float(), rp.packed, 128, True, 32)),
        (ValueError, "w4a16_gemm: group_size must be 32, 64, 128 or -1", (x, rp.packed, 256, True, 32)),
        (ValueError, "w4a16_gemm: in_features K=252 must be a positive multiple of 8",
         (x[:, :252], rp.packed, 128, True, 32)),
        (ValueError, r"w4a16_gemm: packed must be a contiguous int32 \[2, 1, 4, 1056\]", (x, rp.packed, 128, True, 80)),
        (ValueError, r"w4a16_gemm: packed must be a contiguous int32 \[1, 1, 4, 1088\]",
         (x, rp.packed, 128, False, 32)),
        (ValueError, "w4a16_gemm: in_features K=192 is not a multiple of group_size=128",
         (x[:, :192], rp.packed, 128, True, 32)),
    ]
    for exc, msg, args in cases:
        with pytest.raises(exc, match=msg):
            op(*args)
    with pytest.raises(ValueError, match="w4a16_gemm: split_k must be in"):
        op(x, rp.packed, 128, True, 32, 9)


@GPU
def test_opcheck():
    rp, _ = gpu_case(48, 256, 64, False)
    for M in (3, 130):  # the streaming kernel and the prefill path
        x = torch.randn(M, 256, device="cuda").to(torch.bfloat16)
        torch.library.opcheck(torch.ops.cublade.w4a16_gemm.default, (x, rp.packed, 64, False, 48, 0))


@GPU
def test_torch_compile_fullgraph():
    rp, w = gpu_case(64, 512, 128, True)

    class Layer(torch.nn.Module):
        def forward(self, x):
            return torch.relu(w4a16_gemm(x, rp.packed, 128, True, 64)) * 2

    layer = Layer()
    compiled = torch.compile(layer, fullgraph=True)
    for M in (1, 5):
        x = torch.randn(M, 512, device="cuda").to(torch.bfloat16)
        torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)
