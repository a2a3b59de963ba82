"""vLLM's FP8 Marlin as the `fp8` kernel vllm-marlin-fp8 (W8A16: the path for GPUs without FP8 tensor cores, run here
on any GPU by constructing the kernel directly): against cublade.numerics.linear.fp8_w8a16_linear_ref (the same
weights, fp32 sums in another order, one rounding of the output) and against the W8A8 reference within
w8a16_vs_w8a8_bound, for channel / tensor weight scales, dynamic / static activations, bf16 / fp16, shapes off
Marlin's tiles (padded) and a bias. Skipped without a CUDA GPU and vLLM."""
from __future__ import annotations

import pytest
import torch
from stand_in import stand_in_layer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 device)")


def fp8_layer(scheme, N: int, K: int, dtype, amax: float = 0.3, seed: int = 0) -> tuple[torch.nn.Module, dict]:
    """A stand-in for a vLLM linear layer after loading (cublade's fp8 tensors), and a copy of its checkpoint
    tensors."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * torch.linspace(0.05, 1.0, N).unsqueeze(1)
    t = scheme.quantize(w * (amax / w.abs().max()))
    if scheme.static:
        t["input_scale"] = torch.tensor([0.004])
    return stand_in_layer(scheme, t, N, K, dtype), {k: v.cuda() for k, v in t.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("strategy,activations", [("channel", "dynamic-token"), ("tensor", "static-tensor"),
                                                  ("tensor", "dynamic-tensor")])
@pytest.mark.parametrize("N,K,M", [(256, 128, 5), (4096, 1024, 1), (1000, 2056, 37), (200, 4096, 300)])
def test_marlin_fp8_matches_w8a16_reference(dtype, strategy, activations, N, K, M):
    pytest.importorskip("vllm.model_executor", reason="vLLM is not installed (staged on the device: see README)")
    from cublade.config import Fp8Scheme
    from cublade.numerics.linear import fp8_w8a16_linear_ref, w8a16_vs_w8a8_bound
    from cublade.vllm.kernels import VllmMarlinFp8

    scheme = Fp8Scheme(strategy, activations)
    layer, t = fp8_layer(scheme, N, K, dtype)
    ok, why = VllmMarlinFp8.can_implement(layer)
    assert ok, why
    impl = VllmMarlinFp8(layer)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(M, K, generator=g) * torch.linspace(0.05, 4.0, K)).to(dtype).cuda()
    bias = torch.randn(N, generator=g).to(dtype).cuda()
    y = impl.apply(layer, x, bias)
    assert y.dtype == dtype and y.shape == (M, N)
    want = fp8_w8a16_linear_ref(x, t["weight"], t["weight_scale"], bias)
    # fp32 sums in another order, one rounding of the output: ~1 ulp (2^-7 bf16, 2^-10 fp16), tiny outputs aside
    u = 2**-7 if dtype == torch.bfloat16 else 2**-10
    tol = want.float().abs() * u + want.float().abs().mean() * 2**-10
    ratio = ((y.float() - want.float()).abs() / tol).max().item()
    print(f"RATIO {dtype} {strategy} {activations} {N}x{K} M={M}: max |y - w8a16 model| / 1-ulp tolerance {ratio:.2f}")
    # and against the checkpoint's W8A8 reference, within the stated bound (the bias is common to both)
    from cublade.numerics.fp8 import quantize_per_tensor, quantize_per_token

    x2 = x.float()
    q, s = (quantize_per_token(x2) if activations == "dynamic-token" else
            quantize_per_tensor(x2, t["input_scale"] if scheme.static else None))
    ref = scheme.linear_ref(x, t, bias)
    bound = w8a16_vs_w8a8_bound(x, t["weight"], t["weight_scale"], q.float() * s.float())
    assert ((y.float() - ref.float()).abs() <= bound + u * bias.float().abs()).all()
    if dtype == torch.bfloat16 and ratio > 1.0:
        # Measured on an H100: with bf16 activations Marlin's outputs were up to 3.1x this tolerance from the model
        # (fp16: within it), on small outputs; where Marlin's bf16 path rounds beyond the model is not yet known.
        pytest.xfail(f"Marlin FP8 bf16 differs from the W8A16 model by {ratio:.2f}x the 1-ulp tolerance")
    assert ratio <= 1.0, ratio


def test_marlin_fp8_small_fp16_scales():
    """fp8 scales under 2^-14 (weights' abs-max under ~0.03): the kernel's fp16 scales keep their precision."""
    pytest.importorskip("vllm.model_executor", reason="vLLM is not installed (staged on the device: see README)")
    from cublade.config import Fp8Scheme
    from cublade.numerics.linear import fp8_w8a16_linear_ref
    from cublade.vllm.kernels import VllmMarlinFp8

    layer, t = fp8_layer(Fp8Scheme("channel"), 512, 1024, torch.float16, amax=0.01)
    impl = VllmMarlinFp8(layer)
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(2)).half().cuda()
    y = impl.apply(layer, x, None)
    want = fp8_w8a16_linear_ref(x, t["weight"], t["weight_scale"])
    tol = want.float().abs() * 2**-10 + want.float().abs().mean() * 2**-10
    assert ((y.float() - want.float()).abs() <= tol).all()
