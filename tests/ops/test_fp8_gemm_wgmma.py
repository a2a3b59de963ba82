"""fp8_gemm_wgmma (FP8 W8A8 on FP8 tensor cores, the E4M3 weight as stored).

CPU: the reference is the `fp8` scheme's W8A8 reference up to the order of its two scale multiplications (one bf16
rounding apart); the launcher's tile and K-split rule on the shapes it was measured on (a host-only driver built with
nvcc). GPU: the kernel against the exact fp32 reference, held to the FP8 accumulation's bound, over token counts
across the tile sizes and passes, N and K off the tiles (TMA zero-fills past N and K), every tile form and K split, a
per-tensor activation scale; unsplit, a row's output bits do not depend on the batch around it (what batch-invariant
serving needs); against vLLM's CUTLASS scaled-mm on the same tensors, where vLLM is installed."""
from __future__ import annotations

import host_driver
import pytest
import torch

from accuracy import assert_one_rounding
from cublade.numerics.linear import fp8_linear_ref
from cublade.ops.fp8_gemm_wgmma import fp8_gemm_wgmma, fp8_gemm_wgmma_ref
from cublade.ops.fp8_quant_per_token import fp8_quant_per_token_ref
from fp8_testing import gpu
from test_fp8_gemm import activations, weights

SMS = 132  # the H200


def exact(xq, xs, w, ws) -> torch.Tensor:
    """The fp32 product of the E4M3 values with both scales, in float64 (no rounding to speak of)."""
    acc = xq.double() @ w.double().t()
    return (xs.double().reshape(-1, 1) * ws.double().reshape(1, -1) * acc).float()


# ---- CPU ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("M,N,K", [(1, 64, 512), (7, 100, 96), (33, 130, 1056)])
def test_reference_is_the_schemes_w8a8_up_to_the_scales_order(M, N, K):
    w, ws = weights(N, K)
    x = activations(M, K)
    xq, xs = fp8_quant_per_token_ref(x)
    y = fp8_gemm_wgmma_ref(xq, xs, w, ws)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    assert_one_rounding(y, fp8_linear_ref(x, w, ws).float(), bar=2e-3)
    assert_one_rounding(y, exact(xq, xs, w, ws))


# (M, N, K, batch_invariant) -> (rows a CTA, tokens a CTA, K split, CTAs an SM), measured with benchmarks/tuning/fp8_wgmma.cu on
# the H200 (every tile form and split at each point; docs/decisions.md, "FP8 wgmma GEMM: tile and K split"): the rule
# picks the fastest form measured at each, but the first (13.6 us for 64 rows split in two, the rule's 14.6).
PLANS = [
    ((16, 4096, 4096, 0), (128, 16, 1, 1)),      # 32 CTAs either way at K 4096: the 128-row form, unsplit
    ((64, 6144, 4096, 0), (64, 64, 1, 1)),       # 48 CTAs of 128 rows fill a third of the SMs: 96 of 64 rows
    ((256, 6144, 4096, 0), (64, 256, 1, 1)),     # 24.0 against 39.3 us
    ((256, 28672, 4096, 0), (128, 256, 1, 1)),   # 224 CTAs of 128 rows: 76.8 against 82.6 us
    ((1024, 6144, 4096, 0), (64, 256, 1, 1)),    # 192 CTAs (1.45 waves) of 128 rows against 384: 65.2 against 76.7 us
    ((1024, 4096, 4096, 0), (128, 256, 1, 1)),   # 128 CTAs (one wave): 42.2 against 45.1 us
    ((1024, 4096, 14336, 0), (128, 256, 1, 1)),  # 95.6 against 108.8 us; no split on a full grid
    ((128, 4096, 14336, 0), (64, 128, 2, 1)),    # K 14336 on 64 CTAs: halved over clusters of two, 30.0 against 34.8 us
    ((16, 4096, 14336, 0), (128, 16, 2, 1)),     # 24.7 against 31.0 us
    ((128, 4096, 14336, 1), (64, 128, 1, 1)),    # batch-invariant: never split
    ((384, 6144, 4096, 0), (128, 192, 1, 1)),    # two passes of 192: 33.3 against 37.0 us
    ((384, 4096, 4096, 0), (64, 192, 1, 1)),     # 21.5 against 32.6 us
    ((1, 28672, 4096, 0), (128, 16, 1, 2)),      # 224 CTAs: two an SM, 34.7 against 37.9 us
    ((128, 28672, 4096, 0), (128, 128, 1, 2)),   # 42.7 against 48.4 us
]


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    exe = host_driver.build(tmp_path_factory, "fp8_wgmma_plan", ("-gencode=arch=compute_90a,code=sm_90a",))
    return lambda cases: [tuple(map(int, line.split())) for line in
                          host_driver.lines(exe, [v for (M, N, K, bi), _ in cases for v in (M, N, K, SMS, bi)])]


def test_plan_on_measured_shapes(plan):
    got = plan(PLANS)
    wrong = [f"M={M} N={N} K={K} batch_invariant={bi}: {g}, want {want}"
             for ((M, N, K, bi), want), g in zip(PLANS, got) if g != want]
    assert not wrong, "; ".join(wrong)


# ---- GPU ----------------------------------------------------------------------------------------------------

def gpu_case(M: int, N: int, K: int, per_tensor: bool = False, seed: int = 0):
    w, ws = weights(N, K, seed)
    x = activations(M, K, seed + 1)
    xq, xs = fp8_quant_per_token_ref(x)
    if per_tensor:
        xs = xs.amax().reshape(1)
        xq = (x.float() / xs).to(torch.float8_e4m3fn)
    return [t.cuda() for t in (xq, xs, w, ws)]


def assert_fp8_accumulation(y: torch.Tensor, ref: torch.Tensor, K: int) -> None:
    """y within the FP8 tensor cores' accumulation of the exact product: the mean relative error under 3e-3 x
    sqrt(K / 4096) (the accumulation drops low bits as it goes, so its error grows with K: measured 1.1e-3 at K 4096 and
    2.4e-3 at 14336 on random data, benchmarks/tuning/fp8_wgmma.cu), and each output within 2^-7 of its value plus
    2e-2 x mean|ref| x sqrt(K / 4096). A wrong tile, fragment or swizzle is off by O(1) on the mean."""
    y, ref = y.float().cpu(), ref.cpu()
    scale = max(1.0, (K / 4096) ** 0.5)
    err = ((y - ref).abs().mean() / ref.abs().mean()).item()
    assert err <= 3e-3 * scale, f"mean|y-ref|/mean|ref| = {err:.2e}"
    torch.testing.assert_close(y, ref, rtol=2.0 ** -7, atol=2e-2 * scale * ref.abs().mean().item())


@gpu
@pytest.mark.parametrize("M", [1, 5, 16, 17, 48, 64, 100, 128, 200, 256, 257, 600])
@pytest.mark.parametrize("N,K", [(4096, 4096), (200, 1040), (6144, 4096), (28672, 1024)])
def test_kernel_against_exact(M, N, K):
    xq, xs, w, ws = gpu_case(M, N, K)
    y = fp8_gemm_wgmma(xq, xs, w, ws)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    assert_fp8_accumulation(y, exact(xq, xs, w, ws), K)


@gpu
@pytest.mark.parametrize("split", [1, 2, 4, 8])
@pytest.mark.parametrize("M", [16, 128, 256])
def test_k_splits(M, split):
    K = 14336
    xq, xs, w, ws = gpu_case(M, 512, K)
    y = fp8_gemm_wgmma(xq, xs, w, ws, split)
    assert_fp8_accumulation(y, exact(xq, xs, w, ws), K)


@gpu
def test_per_tensor_activation_scale():
    xq, xs, w, ws = gpu_case(40, 384, 2048, per_tensor=True)
    assert xs.numel() == 1
    assert_fp8_accumulation(fp8_gemm_wgmma(xq, xs, w, ws), exact(xq, xs, w, ws), 2048)


@gpu
@pytest.mark.parametrize("N,K", [(4096, 4096), (512, 14336)])
def test_unsplit_rows_do_not_depend_on_the_batch(N, K):
    """split_k=1: each row's bits are the same alone and inside batches of 7, 64, 200 and 600 rows (other tiles, other
    passes): what batch-invariant serving needs."""
    xq, xs, w, ws = gpu_case(600, N, K)
    full = fp8_gemm_wgmma(xq, xs, w, ws, 1)
    for rows in (1, 7, 64, 200):
        part = fp8_gemm_wgmma(xq[:rows], xs[:rows], w, ws, 1)
        assert torch.equal(part, full[:rows]), f"{rows} rows: {int((part != full[:rows]).sum())} outputs differ"


@gpu
@pytest.mark.parametrize("M", [1, 16, 64, 128, 256, 1024])
@pytest.mark.parametrize("N,K", [(4096, 4096), (1024, 14336)])
def test_against_vllm_cutlass(M, N, K):
    """The same tensors through vLLM's CUTLASS scaled-mm (the layer's other GEMM): the two accumulate alike, so at most
    at most 1% of the outputs differ, each by at most one bf16 step."""
    ops = pytest.importorskip("vllm._custom_ops")
    xq, xs, w, ws = gpu_case(M, N, K)
    y = fp8_gemm_wgmma(xq, xs, w, ws, 1)
    c = ops.cutlass_scaled_mm(xq, w.t(), scale_a=xs.reshape(-1, 1), scale_b=ws.reshape(-1, 1),
                              out_dtype=torch.bfloat16)
    differ = y != c
    frac = differ.float().mean().item()
    step = (y.float() - c.float()).abs()[differ]
    ulp = c.float().abs()[differ] * 2.0 ** -7
    assert frac <= 1e-2 and bool((step <= ulp + 1e-30).all()), (
        f"{frac:.2%} of outputs differ from CUTLASS's, largest by {step.max().item() if step.numel() else 0:.3g}")


@gpu
@pytest.mark.parametrize("M", [16, 128])
def test_k_split_with_two_ctas_an_sm(M):
    """A 28672-row weight at up to 128 tokens runs two CTAs an SM, whose rings are 3 stages deep: a K split's partial
    sums then overwrite stages the other warpgroup's last mma's may still read, unless both are done first."""
    xq, xs, w, ws = gpu_case(M, 28672, 2048)
    assert_fp8_accumulation(fp8_gemm_wgmma(xq, xs, w, ws, 2), exact(xq, xs, w, ws), 2048)
