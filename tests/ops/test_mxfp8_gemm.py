"""mxfp8_gemm: repack (exact round trip), a bit-level model of the kernels' register dequant (CPU), the reference GEMM,
and the CUDA kernels (streaming 1-16 rows, wide from 17, dequantize + cuBLAS from 257 rows on weights under 2^25
elements, 640 under 2^26, 1024 above).

Tolerance classes: the repack, the model and the reference are exact (rtol=0, atol=0). The kernels multiply bf16
weights that are exact (e4m3 times a power of two) and sum in fp32 in another order, so each output is held to one
bf16 rounding of the fp32 reference (|C - ref| <= 2^-8 |ref| plus 1e-4 mean|ref| for the order), and outputs of 4096
elements or more also to mean|C - ref| / mean|ref| <= 2e-3. The dequantize kernel is bit-exact; the prefill path is
bit-equal to torch's GEMM on those weights.
"""
from __future__ import annotations

import re

import pytest
import torch

from cublade.numerics.linear import mxfp8_linear_ref
from cublade.ops.mxfp8_gemm import (MAX_EXPONENT_CODE, mxfp8_dequant_packed, mxfp8_gemm, mxfp8_gemm_ref,
                                    mxfp8_repack, mxfp8_unrepack)
from cublade.ops.mxfp8_quant import mxfp8_dequant_ref, mxfp8_quant_ref
from accuracy import assert_one_rounding

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 device)")
BAR = 2e-3


def quantized(N: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    w[N // 2] = 0.0  # an all-zero row: E8M0 code 0, every code 0
    w[0, K // 3] = 3.0  # an outlier: the rest of its block lands in e4m3's subnormals
    w[-1, :32] = torch.linspace(-1e-3, 1e-3, 32)  # a block of small values, both signs
    return mxfp8_quant_ref(w)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


# ---- CPU: repack, the kernels' bit model, the reference --------------------------------------------------------

SHAPES = [(64, 512), (100, 96), (16, 1056), (130, 2048), (1, 32)]


@pytest.mark.parametrize("N,K", SHAPES)
def test_repack_round_trip_is_exact(N, K):
    q, e = quantized(N, K, seed=N + K)
    packed = mxfp8_repack(q, e)
    assert packed.dtype == torch.int32 and packed.shape == (-(-N // 64), -(-K // 512), 4, 2048 + 64)
    q2, e2 = mxfp8_unrepack(packed, N, K)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(e2, e)


def _bf16_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 16-bit patterns -> their bf16 values as fp32."""
    return (bits.to(torch.int32) << 16).view(torch.float32)


def kernel_model(packed: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """What the kernels' dequant_step computes from the blob, step by step as mxfp8_gemm.cu writes it: for every lane
    vector the 4 words, each word's bf16 pairs by the shift/mask formulas (code * 2^-120), times the bf16 factor
    (e + 120) << 7 of its record, placed at the (row, K) the fragment register stands for. Returns fp32 [N, K]."""
    TG, C = packed.shape[:2]
    blocks = packed.view(torch.uint8).reshape(TG, C, 4, -1)
    b = blocks[..., :8192].reshape(TG, C, 4, 8, 2, 32, 4, 4).long()  # tg, c, tile, p, h, lane, word, byte
    w = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24
    lo = ((w << 4) & 0x07F007F0) | ((w << 8) & 0x80008000)  # bytes 0, 2: (K0, K0+1)
    hi = ((w >> 4) & 0x07F007F0) | (w & 0x80008000)  # bytes 1, 3: (K0+2, K0+3)
    rec = blocks[..., 8192:].reshape(TG, C, 4, 8, 8, 4).long()  # tg, c, tile, p, g, byte
    out = torch.zeros(TG * 64, C * 512)
    for word in range(4):  # (row g, s=2h), (g+8, 2h), (g, 2h+1), (g+8, 2h+1)
        rh, sl = word % 2, word // 2
        for h in range(2):
            e = rec[..., 2 * h + rh]  # [tg, c, tile, p, g]
            f = _bf16_of_bits((e + 120) << 7)
            for pair, reg in ((0, lo), (1, hi)):
                r = reg[:, :, :, :, h, :, word]  # [tg, c, tile, p, lane]
                for half in range(2):  # low / high bf16 of the register: K0 + 2 pair + half
                    v = _bf16_of_bits((r >> (16 * half)) & 0xFFFF)
                    lane = torch.arange(32)
                    g, t = lane // 4, lane % 4
                    val = (v * f[..., g]).to(torch.bfloat16).float()  # HMUL2: one bf16 rounding
                    for tile in range(4):
                        for p in range(8):
                            row = (torch.arange(TG)[:, None, None] * 64 + tile * 16 + 8 * rh + g)
                            k = (torch.arange(C)[None, :, None] * 512 + 64 * p + 32 * h + 8 * t + 4 * sl
                                 + 2 * pair + half)
                            out[row.expand(TG, C, 32), k.expand(TG, C, 32)] = val[:, :, tile, p, :]
    return out[:N, :K]


@pytest.mark.parametrize("N,K", [(64, 512), (100, 96)])
def test_kernel_dequant_model_matches_the_checkpoint_dequant(N, K):
    """The layout contract of mxfp8_gemm.cu: the registers the kernels build from the blob hold exactly the bf16
    weights mxfp8_dequant gives (signs, zeros and e4m3 subnormals included)."""
    q, e = quantized(N, K, seed=3)
    ref = mxfp8_dequant_ref(q, e, torch.bfloat16).float()
    assert (q.float() == 0).any() and (q.view(torch.uint8) & 0x78 == 0).logical_and(q.float() != 0).any()  # subnormals
    torch.testing.assert_close(kernel_model(mxfp8_repack(q, e), N, K), ref, rtol=0, atol=0)


@pytest.mark.parametrize("N,K", SHAPES[:3])
def test_reference_equals_linear_reference(N, K):
    q, e = quantized(N, K, seed=1)
    x = torch.randn(5, K).to(torch.bfloat16)
    packed = mxfp8_repack(q, e)
    torch.testing.assert_close(mxfp8_gemm_ref(x, packed, N), mxfp8_linear_ref(x, q, e), rtol=0, atol=0)
    torch.testing.assert_close(mxfp8_gemm(x, packed, N), mxfp8_gemm_ref(x, packed, N), rtol=0, atol=0)  # CPU entry
    torch.testing.assert_close(mxfp8_dequant_packed(packed, N, K), mxfp8_dequant_ref(q, e, torch.bfloat16),
                               rtol=0, atol=0)


def test_repack_refuses_with_a_message():
    q, e = quantized(16, 64)
    with pytest.raises(ValueError, match="mxfp8_repack: in_features K=48 is not a multiple of 32"):
        mxfp8_repack(q[:, :48], e[:, :1])
    with pytest.raises(ValueError, match=r"mxfp8_repack: weight_scale must be uint8 \[16, 2\]"):
        mxfp8_repack(q, e[:, :1])
    big = e.clone()
    big[3, 1] = MAX_EXPONENT_CODE + 1
    with pytest.raises(ValueError, match="scale code of 135 .* above 134"):
        mxfp8_repack(q, big)
    mxfp8_repack(q, big.clamp(max=MAX_EXPONENT_CODE))  # 134 itself is taken
    with pytest.raises(NotImplementedError, match="mxfp8_gemm: x must be bfloat16"):
        mxfp8_gemm(torch.randn(2, 64).half(), mxfp8_repack(q, e), 16)


# ---- GPU: the CUDA kernels -----------------------------------------------------------------------------------

def gpu_case(N, K, seed=0):
    q, e = quantized(N, K, seed=seed)
    packed = mxfp8_repack(q.cuda(), e.cuda())
    return packed, mxfp8_dequant_ref(q, e).cuda()  # fp32 weights (exact in bf16)


def check(x, packed, w, split_k=0):
    N = w.shape[0]
    y = torch.ops.cublade.mxfp8_gemm(x, packed, N, split_k)
    ref = x.reshape(-1, x.shape[-1]).float() @ w.t()
    assert y.shape == (*x.shape[:-1], N) and y.dtype == torch.bfloat16
    assert_one_rounding(y.reshape(-1, N), ref, BAR)
    return y


@GPU
def test_dequant_kernel_is_bit_exact():
    for N, K in [(272, 1024), (100, 96), (64, 4128)]:
        q, e = quantized(N, K, seed=N)
        packed = mxfp8_repack(q.cuda(), e.cuda())
        got = torch.ops.cublade.mxfp8_dequant_packed(packed, N, K)
        torch.testing.assert_close(got, mxfp8_dequant_ref(q, e, torch.bfloat16).cuda(), rtol=0, atol=0)


@GPU
def test_kernel_every_m_1_to_64_and_large():
    packed, w = gpu_case(272, 1024)
    for M in list(range(1, 65)) + [100, 127, 128, 129, 145, 200, 255, 319, 383]:  # wide from 17, prefill 257
        check(torch.randn(M, 1024, device="cuda").to(torch.bfloat16), packed, w)
    check(torch.randn(100, 1024, device="cuda").to(torch.bfloat16), packed, w, split_k=1)  # forced: 4 passes of 32


@GPU
@pytest.mark.parametrize("N,K", [(100, 96), (16, 1056), (1000, 4096), (4096, 512)])
@pytest.mark.parametrize("M", [1, 7, 16, 24, 48, 96, 128])
def test_kernel_shapes(N, K, M):
    packed, w = gpu_case(N, K, seed=N + M)
    check(torch.randn(M, K, device="cuda").to(torch.bfloat16), packed, w)


@GPU
@pytest.mark.parametrize("split_k", [1, 2, 4, 8])
def test_kernel_split_k(split_k):
    packed, w = gpu_case(128, 8192)
    for M in (1, 9, 30):
        check(torch.randn(M, 8192, device="cuda").to(torch.bfloat16), packed, w, split_k=split_k)


@GPU
@pytest.mark.parametrize("N,K", [(4096, 4096), (8192, 1024)])
def test_wide_kernel_large_n_and_splits(N, K):
    packed, w = gpu_case(N, K)
    for M in (17, 40, 64):
        check(torch.randn(M, K, device="cuda").to(torch.bfloat16), packed, w)


@GPU
@pytest.mark.parametrize("groups_per_sm,K,M,slices", [(0.5, 4096, 1, 2), (0.5, 4096, 4, 2), (0.73, 4096, 8, 2),
                                                        (1.2, 8192, 1, 2), (1.2, 8192, 4, 2), (3.4, 4096, 3, 2),
                                                        (0.5, 4096, 16, 2)])
def test_streaming_kernel_takes_two_k_slices_up_to_8_rows(groups_per_sm, K, M, slices):
    """Up to 8 rows the streaming kernel runs two K slices per chunk (stream_gemm_kernel<..., TPW 1, KSL 2>) on every
    grid: grids that take 2 K splits (0.5 and 1.2 tile groups per SM) and those that keep one (0.73, 3.4), rings of 3
    stages (1 CTA per SM) and of 2 (1.2 groups per SM at 4 rows, 3.4); 16 rows keep their 2 tiles per warp (KSL 2 =
    TPW 2). Outputs within the bars."""
    from profiling import kernels_run, stream_k_slices
    N = 64 * round(groups_per_sm * torch.cuda.get_device_properties(0).multi_processor_count)
    packed, w = gpu_case(N, K)
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    names = kernels_run(lambda: check(x, packed, w))
    assert stream_k_slices(names) == [slices], names


@GPU
@pytest.mark.parametrize("N,K,M,splits", [(4096, 4096, 16, 2), (4096, 4096, 12, 2), (8192, 8192, 16, 2),
                                          (8192, 8192, 9, 2), (8192, 28672, 16, 2), (6144, 4096, 16, 1),
                                          (28672, 4096, 16, 1), (8192, 8192, 8, 1)])
def test_streaming_kernel_splits_at_9_to_16_rows(N, K, M, splits):
    """At 9-16 rows a grid of at most one CTA per SM takes a second K split where each keeps 8 chunks and the doubled
    grid fits one wave (8192 x 8192: 128 tile groups, 16 chunks -> 2 splits; 8 rows keep 1); 4096 x 4096 splits to
    even the SMs' shares; 96 and 448 tile groups keep 1. The split count is the launch's grid.y (132-SM H200 / H100
    SXM; other SM counts skip). Outputs within the bars."""
    from profiling import kernel_grids
    if torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the split counts are for 132 SMs")
    packed, w = gpu_case(N, K, seed=M)
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    grids = [g for n, g in kernel_grids(lambda: check(x, packed, w)) if "stream_gemm_kernel" in n]
    assert grids == [(N // 64, splits, 1)], grids


@GPU
def test_wide_kernel_stream_k_when_the_last_wave_is_short():
    """As for W4A16 (test_w4a16_gemm.py): N = 128 x SMs fills one wave of CTAs (split-K), 128 rows more leave a last
    wave of one CTA, so the wide kernel runs stream-K; both within the bars, stream-K the same bits on every call."""
    from profiling import kernels_run
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for N, want_sk in [(128 * sms, False), (128 * sms + 128, True)]:
        packed, w = gpu_case(N, 2048, seed=N)
        for M in (20, 100):
            x = torch.randn(M, 2048, device="cuda").to(torch.bfloat16)
            ys = []
            names = [n for n in kernels_run(lambda: ys.append(check(x, packed, w))) if "wide_gemm_kernel" in n]
            sk = [bool(re.search(r"wide_gemm_kernel<.*, (false|true), true>\(|wide_gemm_kernel\w*Lb[01]ELb1EEEv", n))
                  for n in names]
            assert names and all(v == want_sk for v in sk), (N, M, names)
            assert torch.equal(ys[0], check(x, packed, w))


@GPU
@pytest.mark.parametrize("N,K,stream_k,cases", [
    (200, 1152, True, [(191, 0, 2), (192, 1, 1), (256, 1, 1)]),  # K past the blob's last whole chunk of 512
    (150, 1152, False, [(191, 0, 2), (192, 1, 1), (256, 1, 1)]),
    (8192, 4096, True, [(300, 1, 2), (383, 1, 2)]),  # 2^25 elements: the kernels up to 639 rows
    (8256, 4096, False, [(300, 1, 2), (383, 1, 2)]),
], ids=["200x1152", "150x1152", "8192x4096", "8256x4096"])
def test_wide_kernel_256_token_passes_from_192_rows(N, K, stream_k, cases):
    """From 192 rows left the wide kernel runs passes of up to 256 rows (256 tokens on 2 warpgroups, one packet per
    issue: Mxfp8Steps; stream-K where the tile groups pair up, the split-K form where they do not), the rest in passes
    of up to 128: within the bars (the weights are exact in bf16 on every pass), and stream-K the same bits on every
    call. (M, passes of 256, launches) per case; two passes where the weight keeps the kernels past 256 rows."""
    from profiling import kernels_run
    packed, w = gpu_case(N, K, seed=N)
    for M, large, launches in cases:
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        ys = []
        names = [n for n in kernels_run(lambda: ys.append(check(x, packed, w))) if "wide_gemm_kernel" in n]
        steps = [n for n in names if "Mxfp8Steps" in n]
        assert len(steps) == large and len(names) == launches, (M, names)
        sk = [bool(re.search(r"wide_gemm_kernel<.*, (false|true), true>\(|wide_gemm_kernel\w*Lb[01]ELb1EEEv", n))
              for n in steps]
        assert all(v == stream_k for v in sk), (N, steps)
        assert torch.equal(ys[0], check(x, packed, w))


@GPU
def test_prefill_path_from_257_640_or_1024_rows_by_weight_size():
    """The op runs its wide kernel below its switch and its prefill path (mxfp8_dequant_packed, then cuBLAS) from it:
    257 rows on weights under 2^25 elements, 640 under 2^26 (8192 x 4096 here), 1024 above (16384 x 8192). The kernels
    launched say which."""
    from profiling import kernels_run
    for N, K, switch in [(200, 1024, 257), (8192, 4096, 640), (16384, 8192, 1024)]:
        q, codes = torch.ops.cublade.mxfp8_quant((torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16), True)
        packed = mxfp8_repack(q, codes)
        for M in (switch - 1, switch):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            names = kernels_run(lambda: torch.ops.cublade.mxfp8_gemm(x, packed, N, 0))
            ran = (any("mxfp8::" in n and "dequant_packed_kernel" in n for n in names), any("wide_gemm_kernel" in n for n in names))
            assert ran == (M >= switch, M < switch), (N, K, M, names)


@GPU
def test_large_m_dequantizes_then_runs_a_dense_gemm():
    packed, w = gpu_case(200, 1024)
    wq = torch.ops.cublade.mxfp8_dequant_packed(packed, 200, 1024)
    for shape in [(384, 1024), (3, 130, 1024)]:
        x = torch.randn(shape, device="cuda").to(torch.bfloat16)
        y = torch.ops.cublade.mxfp8_gemm(x, packed, 200, 0)
        torch.testing.assert_close(y.reshape(-1, 200), x.reshape(-1, 1024) @ wq.t(), rtol=0, atol=0)
        check(x, packed, w)


@GPU
def test_kernel_strided_batched_nan_inf():
    packed, w = gpu_case(64, 256)
    x = torch.randn(3, 5, 512, device="cuda").to(torch.bfloat16)[..., ::2]  # column-strided: the op copies
    check(x, packed, w)
    x = torch.randn(24, 256, device="cuda").to(torch.bfloat16)
    x[1, 7] = float("nan")
    x[2, 9] = float("inf")
    for rows in (4, 24):  # streaming, wide
        y = torch.ops.cublade.mxfp8_gemm(x[:rows], packed, 64)
        assert torch.isnan(y[1]).all() and not torch.isfinite(y[2]).all()
        assert torch.isfinite(y[0]).all() and torch.isfinite(y[3:]).all()
        assert (y[0, 32] == 0).all()  # the all-zero weight row


@GPU
def test_kernel_refuses_with_a_message():
    packed, _ = gpu_case(32, 256)
    op = torch.ops.cublade.mxfp8_gemm
    x = torch.randn(2, 256, device="cuda").to(torch.bfloat16)
    cases = [
        (NotImplementedError, "mxfp8_gemm: x must be bfloat16", (x.half(), packed, 32)),
        (ValueError, "mxfp8_gemm: in_features K=240 must be a positive multiple of 32", (x[:, :240], packed, 32)),
        (ValueError, r"mxfp8_gemm: packed must be a contiguous int32 \[2, 1, 4, 2112\]", (x, packed, 80)),
    ]
    for exc, msg, args in cases:
        with pytest.raises(exc, match=msg):
            op(*args)
    with pytest.raises(ValueError, match="mxfp8_gemm: split_k must be in"):
        op(x, packed, 32, 9)


@GPU
def test_opcheck():
    packed, _ = gpu_case(48, 256)
    for M in (3, 40, 330):  # streaming, wide, prefill
        x = torch.randn(M, 256, device="cuda").to(torch.bfloat16)
        torch.library.opcheck(torch.ops.cublade.mxfp8_gemm.default, (x, packed, 48, 0))
    torch.library.opcheck(torch.ops.cublade.mxfp8_dequant_packed.default, (packed, 48, 256))


@GPU
def test_torch_compile_fullgraph():
    packed, _ = gpu_case(64, 512)

    class Layer(torch.nn.Module):
        def forward(self, x):
            return torch.relu(mxfp8_gemm(x, packed, 64)) * 2

    layer = Layer()
    compiled = torch.compile(layer, fullgraph=True)
    for M in (1, 20):
        x = torch.randn(M, 512, device="cuda").to(torch.bfloat16)
        torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)
