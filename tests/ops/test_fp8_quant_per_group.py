"""fp8_quant_per_group: dynamic E4M3 per 1 x 128 group of activations (the FP8 tensor-core W4A16 path).

Tolerance class: bit-exact. The kernel computes each group's amax, scale = max(amax / 448, 1/(448*512)) and
q = e4m3(x / scale) with an exact division, as the reference (the per-token rule applied per group) does; codes are
compared as bytes, scales as fp32 bits, and the scale's column-major strides are checked.
"""
from __future__ import annotations

import pytest
import torch

from cublade.numerics.fp8 import quantize_per_token
from cublade.ops.fp8_quant_per_group import fp8_quant_per_group, fp8_quant_per_group_ref

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 device)")


def sample(M: int, K: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Normal values with a few groups scaled far up / down, zero groups and exact ties of the amax."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    if M * K >= 1024:
        x.view(M, -1, 128)[:, ::3] *= 300.0
        x.view(M, -1, 128)[:, 1::5] *= 1e-6
        x.view(M, -1, 128)[0, -1] = 0.0
    return x.to(dtype)


def test_reference_is_the_per_token_rule_per_group():
    x = sample(5, 384, torch.bfloat16)
    q, s = fp8_quant_per_group_ref(x)
    assert s.shape == (5, 3) and s.stride() == (1, 5)
    for j in range(3):
        qj, sj = quantize_per_token(x[:, 128 * j:128 * (j + 1)])
        assert torch.equal(q[:, 128 * j:128 * (j + 1)].view(torch.uint8), qj.view(torch.uint8))
        assert torch.equal(s[:, j:j + 1], sj)


def test_refuses_k_not_a_multiple_of_128():
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8_quant_per_group(torch.zeros(2, 200, dtype=torch.bfloat16))


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K", [(1, 128), (3, 4096), (17, 14336), (256, 8192), (1000, 4096), (4096, 1024)])
def test_kernel_bit_exact(M, K, dtype):
    x = sample(M, K, dtype, seed=M + K)
    q, s = fp8_quant_per_group(x.cuda())
    rq, rs = fp8_quant_per_group_ref(x)
    assert s.stride() == (1, M) and s.shape == (M, K // 128)
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)), "codes differ"
    assert torch.equal(s.cpu().contiguous().view(torch.int32), rs.contiguous().view(torch.int32)), "scales differ"


@GPU
def test_kernel_strided_rows_and_nan():
    x = sample(64, 1024, torch.bfloat16)
    x[3, 130] = float("nan")
    big = torch.zeros(64, 1152, dtype=torch.bfloat16)
    big[:, 64:1088] = x
    view = big.cuda()[:, 64:1088]  # rows 2304 bytes apart, starting 128 bytes in
    q, s = fp8_quant_per_group(view)
    rq, rs = fp8_quant_per_group_ref(x)
    assert torch.isnan(s[3, 1]).item() and torch.isnan(rs[3, 1]).item()
    nan_q = rq.float().isnan()
    assert torch.equal(q.cpu().float().isnan(), nan_q)
    assert torch.equal(q.cpu().view(torch.uint8)[~nan_q], rq.view(torch.uint8)[~nan_q])
    ok = ~rs.isnan()
    assert torch.equal(s.cpu()[ok], rs[ok])
