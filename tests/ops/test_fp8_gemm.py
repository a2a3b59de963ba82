"""fp8_gemm (FP8 W8A8 decode GEMM on the E4M3 weight as stored) and its activations ops fp8_quant_per_token_bf16 /
fp8_quant_per_token_f16 (the E4M3 values as bf16 or fp16: the two decodes of the kernel).

CPU: the kernel's fragment map, modelled: each lane's K runs cover a chunk once, and its shared-memory loads of the
swizzled weight rows and the staged x rows are free of bank conflicts. The quantization to bf16 / fp16 values is the
per-token quantization's E4M3 values, exactly; quantizing that way and then fp8_gemm_ref is the `fp8` scheme's W8A8
reference (fp8_linear_ref) bit for bit, and so is the layer's custom op cublade::fp8_linear on its CPU path, with
either value form. GPU: the quant kernels bit-exact against their references; the GEMM kernel, on each value form,
against the fp32 reference held to one bf16 rounding (its products are exact, its fp32 sums run in another order),
over token counts across the passes of 8 / 16 / 32 rows, N and K off the 64-row / 512-K tiles (TMA zero-fills past N
and K), K splits, a per-tensor activation scale, and row independence (a row's output does not depend on the other
rows of its pass); the two forms within a bf16 step of each other."""
from __future__ import annotations

import pytest
import torch

from accuracy import assert_one_rounding
from cublade.numerics.linear import fp8_linear_ref
from cublade.numerics.fp8 import fp8_quant_weight
from cublade.ops.fp8_gemm import fp8_gemm, fp8_gemm_ref
from cublade.ops.fp8_quant_per_token import (fp8_quant_per_token_bf16, fp8_quant_per_token_bf16_ref,
                                             fp8_quant_per_token_f16, fp8_quant_per_token_f16_ref,
                                             fp8_quant_per_token_ref)
from fp8_testing import gpu

# The activations' value forms: (dtype, the quant op, its reference). fp8_gemm decodes its weights to match.
VALUES = {"bf16": (torch.bfloat16, fp8_quant_per_token_bf16, fp8_quant_per_token_bf16_ref),
          "f16": (torch.float16, fp8_quant_per_token_f16, fp8_quant_per_token_f16_ref)}
each_form = pytest.mark.parametrize("form", list(VALUES))


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

@each_form
def test_values_are_the_e4m3_values(form):
    dtype, _, ref = VALUES[form]
    x = activations(5, 96)
    x[0, :8] = torch.tensor([448.0, -448.0, 1e-3, -1e-3, 2.0**-9, 0.0, 3.5, -0.0])  # the range's ends, subnormals
    q, s = fp8_quant_per_token_ref(x)
    v, s2 = ref(x)
    assert v.dtype == dtype and torch.equal(s, s2)
    assert torch.equal(v.float(), q.float())  # every E4M3 value is exact in bf16 and in fp16
    assert torch.equal(v.float().to(torch.float8_e4m3fn).view(torch.uint8), q.view(torch.uint8))


@each_form
@pytest.mark.parametrize("M,N,K", [(1, 64, 512), (7, 100, 96), (33, 130, 1056)])
def test_reference_is_the_schemes_w8a8(form, M, N, K):
    w, ws = weights(N, K)
    x = activations(M, K)
    y = fp8_gemm_ref(*VALUES[form][2](x), w, ws)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, fp8_linear_ref(x, w, ws))


@each_form
def test_layer_op_on_cpu_is_the_reference(form):
    """cublade::fp8_linear (the layer's custom op, cublade.vllm.kernels.cublade_fp8_gemm) on the CPU path: the
    quantization to bf16 / fp16 values and fp8_gemm's reference."""
    pytest.importorskip("vllm")
    from cublade.vllm.kernels.cublade_fp8_gemm import fp8_linear

    w, ws = weights(64, 256)
    x = activations(6, 256)
    assert torch.equal(fp8_linear(x, w, ws, 16, form), fp8_linear_ref(x, w, ws))


def test_values_setting(monkeypatch):
    """CUBLADE_FP8_GEMM_VALUES picks the layer's value form (f16 unless set); anything else is one line naming it."""
    pytest.importorskip("vllm")
    from cublade.vllm.kernels.cublade_fp8_gemm import values_form

    monkeypatch.delenv("CUBLADE_FP8_GEMM_VALUES", raising=False)
    assert values_form() == "f16"
    monkeypatch.setenv("CUBLADE_FP8_GEMM_VALUES", "bf16")
    assert values_form() == "bf16"
    monkeypatch.setenv("CUBLADE_FP8_GEMM_VALUES", "fp8")
    with pytest.raises(ValueError, match=r"CUBLADE_FP8_GEMM_VALUES='fp8': expected one of f16, bf16"):
        values_form()


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
@each_form
@pytest.mark.parametrize("M,K", [(1, 4096), (16, 14336), (3, 96), (300, 8192), (5, 1000)])
def test_quant_values_kernel_is_bit_exact(form, M, K):
    dtype, quant, ref = VALUES[form]
    x = activations(M, K, seed=M + K).cuda()
    v, s = quant(x)
    rv, rs = ref(x.cpu())
    assert v.dtype == dtype and v.shape == x.shape and s.shape == (M, 1)
    assert torch.equal(v.cpu(), rv) and torch.equal(s.cpu(), rs)


@gpu
@each_form
def test_quant_values_kernel_takes_bf16_only(form):
    op = f"fp8_quant_per_token_{form}"
    with pytest.raises(NotImplementedError, match=rf"cublade\.{op}: x must be bfloat16"):
        getattr(torch.ops.cublade, op)(torch.zeros(2, 64, device="cuda", dtype=torch.float16))


def _gpu_case(M, N, K, seed=0, per_channel=True, form="bf16"):
    w, ws = weights(N, K, seed, per_channel)
    x = activations(M, K, seed + 1)
    xv, xs = VALUES[form][2](x)
    ref = (xv.float() @ w.float().t()) * xs * ws.reshape(1, -1)  # fp32, the scales in the epilogue's order
    return xv.cuda(), xs.cuda(), w.cuda(), ws.cuda(), ref.cuda()


@gpu
@each_form
@pytest.mark.parametrize("N,K", [(4096, 4096), (6144, 4096), (4096, 14336), (100, 96), (130, 1056), (64, 512),
                                 (1000, 2064)])
@pytest.mark.parametrize("M", [1, 2, 8, 9, 16, 17, 32, 33, 64])
def test_gemm_matches_the_reference(form, M, N, K):
    xv, xs, w, ws, ref = _gpu_case(M, N, K, seed=N + K, form=form)
    y = fp8_gemm(xv, xs, w, ws)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    assert_one_rounding(y, ref)


@gpu
@each_form
@pytest.mark.parametrize("split_k", [1, 2, 4, 8])
@pytest.mark.parametrize("M", [1, 12, 24])
def test_gemm_k_splits(form, M, split_k):
    xv, xs, w, ws, ref = _gpu_case(M, 512, 8192, seed=split_k, form=form)
    assert_one_rounding(fp8_gemm(xv, xs, w, ws, split_k), ref)


@gpu
@each_form
def test_gemm_per_tensor_scales(form):
    """One activation scale (x_scale of one element) and a per-tensor weight scale repeated per channel."""
    xv, xs, w, ws, _ = _gpu_case(8, 256, 1024, per_channel=False, form=form)
    s = xs[3:4].reshape(1)
    ref = (xv.float() @ w.float().t()) * s * ws.reshape(1, -1)
    assert_one_rounding(fp8_gemm(xv, s, w, ws), ref)


@gpu
@each_form
@pytest.mark.parametrize("M", [5, 16, 30])
def test_gemm_rows_are_independent(form, M):
    """Each row's output is the same whatever the other rows of its pass hold (same pass size)."""
    xv, xs, w, ws, _ = _gpu_case(M, 1024, 4096, form=form)
    y = fp8_gemm(xv, xs, w, ws)
    xv2 = xv.clone()
    xv2[1:] = xv2[1:].flip(1)  # other rows, same count
    assert torch.equal(fp8_gemm(xv2, xs, w, ws)[0], y[0])


@gpu
@each_form
@pytest.mark.parametrize("M", [1, 8, 16])
def test_gemm_right_after_the_quant_kernel(form, M):
    """The quantization kernel and then fp8_gemm on one stream, as a layer runs them (fp8_gemm is a programmatic
    dependent launch of it: it streams weights before the quantized activations are ready), repeated back to back."""
    N, K = 4096, 4096
    w, ws = weights(N, K)
    w, ws = w.cuda(), ws.cuda()
    x = activations(M, K).cuda()
    _, quant, quant_ref = VALUES[form]
    xv, xs = quant_ref(x.cpu())
    ref = ((xv.float() @ w.float().t().cpu()) * xs * ws.cpu().reshape(1, -1)).cuda()
    for _ in range(3):
        y = fp8_gemm(*quant(x), w, ws)
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


@gpu
@pytest.mark.parametrize("M,N,K", [(1, 4096, 4096), (16, 6144, 4096), (33, 1000, 2064)])
def test_gemm_forms_agree(M, N, K):
    """The two decodes multiply the same values in the same order (only the mma's input type differs): bf16 and fp16
    activations give outputs at most one bf16 step apart."""
    xb, xs, w, ws, _ = _gpu_case(M, N, K, form="bf16")
    yb = fp8_gemm(xb, xs, w, ws).float()
    yh = fp8_gemm(xb.to(torch.float16), xs, w, ws).float()  # the same E4M3 values (exact in both)
    step = yb.abs() * 2.0**-7 + 1e-30
    assert bool(((yh - yb).abs() <= step).all()), (yh - yb).abs().max().item()
