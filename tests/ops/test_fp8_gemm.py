"""fp8_gemm (FP8 W8A8 decode GEMM on the E4M3 weight as stored) and its activations op fp8_quant_per_token_bf16.

CPU: the kernel's fragment map, modelled: each lane's K runs cover a chunk once, and its shared-memory loads of the
swizzled weight rows and the staged x rows are free of bank conflicts. The quantization to bf16 values is the per-token quantization's E4M3 values, exactly; quantizing that way and
then fp8_gemm_ref is the `fp8` scheme's W8A8 reference (fp8_linear_ref) bit for bit, and so is the layer's custom op
cublade::fp8_linear on its CPU path. GPU: the quant kernel bit-exact against its reference; the GEMM kernel against
the fp32 reference held to one bf16 rounding (its products are exact, its fp32 sums run in another order), over token
counts across the passes of 8 / 16 / 32 rows, N and K off the 64-row / 512-K tiles (TMA zero-fills past N and K), K
splits, a per-tensor activation scale, and row independence (a row's output does not depend on the other rows of
its pass)."""
from __future__ import annotations

import pytest
import torch

from accuracy import assert_one_rounding
from cublade.numerics.linear import fp8_linear_ref
from cublade.numerics.fp8 import fp8_quant_weight
from cublade.ops.fp8_gemm import fp8_gemm, fp8_gemm_ref
from cublade.ops.fp8_quant_per_token import (fp8_quant_per_token_bf16, fp8_quant_per_token_bf16_ref,
                                             fp8_quant_per_token_ref)
from fp8_testing import gpu


def weights(N: int, K: int, seed: int = 0, per_channel: bool = True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * torch.linspace(0.01, 0.2, N).unsqueeze(1)
    w[N // 2] = 0.0  # an all-zero row
    q, s = fp8_quant_weight(w, per_channel)
    return q, s.float().reshape(-1).expand(N).contiguous()


def activations(M: int, K: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.linspace(0.5, 4.0, K)
    x[:, K // 3] = 30.0  # an outlier channel
    return x.to(torch.bfloat16)


# ---- CPU ----------------------------------------------------------------------------------------------------

def test_bf16_values_are_the_e4m3_values():
    x = activations(5, 96)
    q, s = fp8_quant_per_token_ref(x)
    v, s2 = fp8_quant_per_token_bf16_ref(x)
    assert v.dtype == torch.bfloat16 and torch.equal(s, s2)
    assert torch.equal(v.float(), q.float())  # every E4M3 value is exact in bf16


@pytest.mark.parametrize("M,N,K", [(1, 64, 512), (7, 100, 96), (33, 130, 1056)])
def test_reference_is_the_schemes_w8a8(M, N, K):
    w, ws = weights(N, K)
    x = activations(M, K)
    y = fp8_gemm_ref(*fp8_quant_per_token_bf16_ref(x), w, ws)
    assert torch.equal(y, fp8_linear_ref(x, w, ws))


def test_layer_op_on_cpu_is_the_reference():
    """cublade::fp8_linear (the layer's custom op, cublade.vllm.kernels.cublade_fp8_gemm) on the CPU path: the
    quantization to bf16 values and fp8_gemm's reference."""
    pytest.importorskip("vllm")
    from cublade.vllm.kernels.cublade_fp8_gemm import fp8_linear

    w, ws = weights(64, 256)
    x = activations(6, 256)
    assert torch.equal(fp8_linear(x, w, ws, 16), fp8_linear_ref(x, w, ws))


# The kernel's plain-rows fragment map (csrc/w4a16_gemm.cuh, kPlainRows), modelled: packet pk of a 512-K chunk, half
# h, lane t -> the lane's 8 K from kc (bytes 0-3 one k-step, 4-7 the next); the weight row's bytes sit in a TMA box of
# 64 rows x 128 bytes with the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)); x rows are staged
# X_ROW_BYTES apart.
X_ROW_BYTES = 8 * 64 * 2 + 64  # lowbit::kXRowBytes


def lane_k(pk: int, h: int, t: int) -> int:
    a = 2 * (pk & 1) + h
    ch = a ^ 5 if t >> 1 else a
    return (pk >> 1) * 128 + ch * 16 + (t & 1) * 8


def weight_address(row: int, pk: int, h: int, t: int) -> int:
    """Byte offset of the lane's 8 weight bytes in the stage (row 0..63 of the tile group)."""
    k = lane_k(pk, h, t)
    box, c, within = k // 128, (k % 128) // 16, k % 16
    return box * 64 * 128 + row * 128 + ((c ^ (row % 8)) << 4) + within


def banks(address: int, size: int) -> set[int]:
    return {(address // 4 + i) % 32 for i in range(size // 4)}


def test_plain_rows_lanes_cover_each_k_once():
    """Over a chunk's 8 packets, 2 halves and 4 lanes t, the lanes' 8-K runs cover the 512 K exactly once (A's and
    B's fragments take the same runs, so the mma's sum is the dot product)."""
    ks = sorted(k + i for pk in range(8) for h in range(2) for t in range(4) for i in range(8)
                for k in [lane_k(pk, h, t)])
    assert ks == list(range(512))


def test_plain_rows_shared_loads_have_no_bank_conflict():
    """Each weight load (8 bytes, rows g and g + 8 of a tile) of a half-warp touches 32 distinct banks, and each x
    load (16 bytes, token row g) of a quarter-warp 32 distinct banks: the minimum number of shared-memory
    wavefronts."""
    for tile in range(4):
        for pk in range(8):
            for h in range(2):
                for plus in (0, 8):
                    for half in range(2):  # lanes 0-15, 16-31: g = 4 half .. 4 half + 3
                        got = [banks(weight_address(16 * tile + g + plus, pk, h, t), 8)
                               for g in range(4 * half, 4 * half + 4) for t in range(4)]
                        assert len(set().union(*got)) == 32, (tile, pk, h, plus, half)
                for quarter in range(4):  # lanes 8q .. 8q + 7: g = 2q, 2q + 1
                    got = [banks(g * X_ROW_BYTES + 2 * lane_k(pk, h, t), 16)
                           for g in (2 * quarter, 2 * quarter + 1) for t in range(4)]
                    assert len(set().union(*got)) == 32, (pk, h, quarter)


# ---- GPU ----------------------------------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("M,K", [(1, 4096), (16, 14336), (3, 96), (300, 8192), (5, 1000)])
def test_quant_bf16_kernel_is_bit_exact(M, K):
    x = activations(M, K, seed=M + K).cuda()
    v, s = fp8_quant_per_token_bf16(x)
    rv, rs = fp8_quant_per_token_bf16_ref(x.cpu())
    assert v.dtype == torch.bfloat16 and v.shape == x.shape and s.shape == (M, 1)
    assert torch.equal(v.cpu(), rv) and torch.equal(s.cpu(), rs)


@gpu
def test_quant_bf16_kernel_takes_bf16_only():
    with pytest.raises(NotImplementedError, match=r"cublade\.fp8_quant_per_token_bf16: x must be bfloat16"):
        torch.ops.cublade.fp8_quant_per_token_bf16(torch.zeros(2, 64, device="cuda", dtype=torch.float16))


def _gpu_case(M, N, K, seed=0, per_channel=True):
    w, ws = weights(N, K, seed, per_channel)
    x = activations(M, K, seed + 1)
    xv, xs = fp8_quant_per_token_bf16_ref(x)
    ref = (xv.float() @ w.float().t()) * xs * ws.reshape(1, -1)  # fp32, the scales in the epilogue's order
    return xv.cuda(), xs.cuda(), w.cuda(), ws.cuda(), ref.cuda()


@gpu
@pytest.mark.parametrize("N,K", [(4096, 4096), (6144, 4096), (4096, 14336), (100, 96), (130, 1056), (64, 512),
                                 (1000, 2064)])
@pytest.mark.parametrize("M", [1, 2, 8, 9, 16, 17, 32, 33, 64])
def test_gemm_matches_the_reference(M, N, K):
    xv, xs, w, ws, ref = _gpu_case(M, N, K, seed=N + K)
    y = fp8_gemm(xv, xs, w, ws)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    assert_one_rounding(y, ref)


@gpu
@pytest.mark.parametrize("split_k", [1, 2, 4, 8])
@pytest.mark.parametrize("M", [1, 12, 24])
def test_gemm_k_splits(M, split_k):
    xv, xs, w, ws, ref = _gpu_case(M, 512, 8192, seed=split_k)
    assert_one_rounding(fp8_gemm(xv, xs, w, ws, split_k), ref)


@gpu
def test_gemm_per_tensor_scales():
    """One activation scale (x_scale of one element) and a per-tensor weight scale repeated per channel."""
    xv, xs, w, ws, _ = _gpu_case(8, 256, 1024, per_channel=False)
    s = xs[3:4].reshape(1)
    ref = (xv.float() @ w.float().t()) * s * ws.reshape(1, -1)
    assert_one_rounding(fp8_gemm(xv, s, w, ws), ref)


@gpu
@pytest.mark.parametrize("M", [5, 16, 30])
def test_gemm_rows_are_independent(M):
    """Each row's output is the same whatever the other rows of its pass hold (same pass size)."""
    xv, xs, w, ws, _ = _gpu_case(M, 1024, 4096)
    y = fp8_gemm(xv, xs, w, ws)
    xv2 = xv.clone()
    xv2[1:] = xv2[1:].flip(1)  # other rows, same count
    assert torch.equal(fp8_gemm(xv2, xs, w, ws)[0], y[0])


@gpu
@pytest.mark.parametrize("M", [1, 8, 16])
def test_gemm_right_after_the_quant_kernel(M):
    """The quantization kernel and then fp8_gemm on one stream, as a layer runs them (fp8_gemm is a programmatic
    dependent launch of it: it streams weights before the quantized activations are ready), repeated back to back."""
    N, K = 4096, 4096
    w, ws = weights(N, K)
    w, ws = w.cuda(), ws.cuda()
    x = activations(M, K).cuda()
    xv, xs = fp8_quant_per_token_bf16_ref(x.cpu())
    ref = ((xv.float() @ w.float().t().cpu()) * xs * ws.cpu().reshape(1, -1)).cuda()
    for _ in range(3):
        y = fp8_gemm(*fp8_quant_per_token_bf16(x), w, ws)
    torch.cuda.synchronize()
    assert_one_rounding(y, ref)


@gpu
def test_gemm_errors_name_the_op():
    xv, xs, w, ws, _ = _gpu_case(2, 64, 512)
    with pytest.raises(ValueError, match=r"cublade\.fp8_gemm: weight has K=512, x has K=256"):
        fp8_gemm(xv[:, :256].contiguous(), xs, w, ws)
    with pytest.raises(ValueError, match=r"cublade\.fp8_gemm: weight_scale must be float32 with one element per "
                                         r"output channel \(64\)"):
        fp8_gemm(xv, xs, w, ws[:8].contiguous())
    with pytest.raises(ValueError, match=r"cublade\.fp8_gemm: in_features K=40 must be a positive multiple of 16"):
        fp8_gemm(xv[:, :40].contiguous(), xs, w[:, :40].contiguous(), ws)
    with pytest.raises(ValueError, match=r"cublade\.fp8_gemm: weight must be a contiguous float8_e4m3fn"):
        fp8_gemm(xv, xs, w.float(), ws)
