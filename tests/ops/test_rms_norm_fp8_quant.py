"""RMSNorm + FP8 quantization in one op: the reference is vLLM's native norm followed by cublade's quantization (CPU),
and on the GPU the kernel reproduces it — bit for bit where mean(h^2) is exact in fp32 whatever the summation order
(values on a coarse grid), and elsewhere up to that order: the new residual exact, at most 1 in 1000 E4M3 bytes one
code apart, the scales within a bf16 step of the abs-max."""
from __future__ import annotations

import pytest
import torch

from cublade.ops.fp8_quant_per_tensor import fp8_quant_per_tensor_ref
from cublade.ops.fp8_quant_per_token import fp8_quant_per_token_ref
from cublade.ops.rms_norm_fp8_quant import (
    fused_add_rms_norm_fp8_quant, fused_add_rms_norm_fp8_quant_ref, rms_norm_fp8_quant, rms_norm_fp8_quant_ref,
    rms_norm_ref)

from fp8_testing import assert_fp8_equal, gpu


def _inputs(M, K, dtype, seed=0, grid=False, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    if grid:  # multiples of 1/8 up to 1.5: h^2 sums are exact in fp32 in any order (K <= 16384)
        x, r = (torch.randint(-12, 13, (M, K), generator=g) / 8 for _ in range(2))
    else:
        x, r = torch.randn(M, K, generator=g) * 3, torch.randn(M, K, generator=g)
    w = 1 + torch.rand(K, generator=g)
    return tuple(t.to(dtype).to(device) for t in (x, r, w))


# ---- reference, CPU ---------------------------------------------------------------------------------------

def test_reference_is_vllms_native_norm():
    vllm_ops = pytest.importorskip("vllm.ir.ops")
    x, r, w = _inputs(5, 64, torch.bfloat16)
    assert torch.equal(rms_norm_ref(x, w, 1e-5)[0], vllm_ops.rms_norm(x, w, 1e-5))
    y, new_r = rms_norm_ref(x, w, 1e-6, r)
    vy, vr = vllm_ops.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    assert torch.equal(y, vy) and torch.equal(new_r, vr)


def test_reference_by_hand():
    x = torch.tensor([[3.0, -4.0, 0.0, 0.0]], dtype=torch.bfloat16)
    w = torch.tensor([1.0, 1.0, 2.0, 1.0], dtype=torch.bfloat16)
    y, _ = rms_norm_ref(x, w, 0.0)  # rms = sqrt(25 / 4) = 2.5
    assert y.float().tolist() == [[1.203125, -1.6015625, 0.0, 0.0]]  # 1.2 and -1.6 in bf16
    q, s = rms_norm_fp8_quant_ref(x, w, 0.0)
    assert s.item() == pytest.approx(1.6015625 / 448, rel=1e-7)
    assert q.float()[0, 1].item() == -448.0


@pytest.mark.parametrize("static", [False, True])
def test_reference_composes_norm_and_quantization(static):
    x, r, w = _inputs(7, 40, torch.float16, seed=1)
    scale = torch.tensor([0.01]) if static else None
    q, s, new_r = fused_add_rms_norm_fp8_quant_ref(x, r, w, 1e-5, scale)
    y = rms_norm_ref(x, w, 1e-5, r)[0]
    eq, es = fp8_quant_per_tensor_ref(y, scale) if static else fp8_quant_per_token_ref(y)
    assert_fp8_equal(q, eq)
    assert torch.equal(s, es) and s.shape == ((1,) if static else (7, 1))
    assert torch.equal(new_r, (x.float() + r.float()).to(torch.float16))


def test_cpu_tensors_run_the_reference():
    x, r, w = _inputs(3, 24, torch.bfloat16)
    for a, b in zip(fused_add_rms_norm_fp8_quant(x, r, w, 1e-5), fused_add_rms_norm_fp8_quant_ref(x, r, w, 1e-5)):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


# ---- kernel, GPU ------------------------------------------------------------------------------------------

def _run(residual, static, x, r, w, eps=1e-5):
    scale = torch.tensor([0.0123], device=x.device) if static else None
    if residual:
        return (torch.ops.cublade.fused_add_rms_norm_fp8_quant(x, r, w, eps, scale),
                fused_add_rms_norm_fp8_quant_ref(x, r, w, eps, scale))
    return torch.ops.cublade.rms_norm_fp8_quant(x, w, eps, scale), rms_norm_fp8_quant_ref(x, w, eps, scale)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("M, K", [(1, 8), (3, 2048), (1, 4096), (17, 4096), (2, 8192), (5, 16384), (64, 5120)])
def test_kernel_bit_exact_where_the_sum_is_exact(dtype, residual, static, M, K):
    x, r, w = _inputs(M, K, dtype, seed=M + K, grid=True, device="cuda")
    got, want = _run(residual, static, x, r, w)
    assert_fp8_equal(got[0], want[0])
    assert got[1].shape == want[1].shape and torch.equal(got[1].cpu(), want[1].cpu())
    if residual:
        assert torch.equal(got[2], want[2])


@gpu
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("M, K", [(1, 4096), (256, 4096), (33, 8192), (8, 5120)])
def test_kernel_matches_up_to_summation_order(residual, static, M, K):
    x, r, w = _inputs(M, K, torch.bfloat16, seed=7 * M + K, device="cuda")
    got, want = _run(residual, static, x, r, w)
    a, b = got[0].view(torch.uint8).cpu().int(), want[0].view(torch.uint8).cpu().int()
    differ = a != b
    assert differ.float().mean().item() <= 1e-3, f"{int(differ.sum())} of {a.numel()} bytes differ"
    assert ((a - b).abs()[differ] == 1).all()  # one E4M3 code apart (same sign)
    torch.testing.assert_close(got[1], want[1], rtol=2 ** -7, atol=0)
    if residual:
        assert torch.equal(got[2], want[2])


@gpu
def test_kernel_takes_3d_and_strided_rows():
    x, r, w = _inputs(6, 4096 * 2, torch.bfloat16, seed=3, grid=True, device="cuda")
    xs = x[:, :4096]  # rows 8192 elements apart
    q, s = torch.ops.cublade.rms_norm_fp8_quant(xs, w[:4096], 1e-6)
    eq, es = rms_norm_fp8_quant_ref(xs, w[:4096], 1e-6)
    assert_fp8_equal(q, eq)
    assert torch.equal(s, es)
    x3, r3 = x[:, :4096].reshape(2, 3, 4096), r[:, :4096].reshape(2, 3, 4096)
    q, s, nr = torch.ops.cublade.fused_add_rms_norm_fp8_quant(x3, r3, w[:4096], 1e-6)
    eq, es, enr = fused_add_rms_norm_fp8_quant_ref(x3, r3, w[:4096], 1e-6)
    assert q.shape == (2, 3, 4096) and s.shape == (2, 3, 1)
    assert_fp8_equal(q, eq)
    assert torch.equal(s, es) and torch.equal(nr, enr)


@gpu
@pytest.mark.parametrize("bad, message", [
    (lambda x, w: (x[:, :12], w[:12]), "multiple of 8"),
    (lambda x, w: (x, w.half()), "weight must be BFloat16"),
    (lambda x, w: (x.float(), w.float()), "bfloat16 or float16"),
    (lambda x, w: (x, w[:8]), "weight must have shape"),
])
def test_kernel_errors_name_the_op(bad, message):
    x, _, w = _inputs(2, 64, torch.bfloat16, device="cuda")
    with pytest.raises((ValueError, NotImplementedError), match=message) as e:
        torch.ops.cublade.rms_norm_fp8_quant(*bad(x, w), 1e-5)
    assert "cublade.rms_norm_fp8_quant" in str(e.value)


@gpu
def test_entry_point_uses_the_kernel_and_falls_back_for_odd_widths():
    x, r, w = _inputs(2, 4096, torch.bfloat16, grid=True, device="cuda")
    assert_fp8_equal(rms_norm_fp8_quant(x, w, 1e-5)[0], rms_norm_fp8_quant_ref(x, w, 1e-5)[0])
    x, r, w = _inputs(2, 20, torch.bfloat16, device="cuda")  # K % 8 != 0: the reference
    assert_fp8_equal(fused_add_rms_norm_fp8_quant(x, r, w, 1e-5)[0], fused_add_rms_norm_fp8_quant_ref(x, r, w, 1e-5)[0])
