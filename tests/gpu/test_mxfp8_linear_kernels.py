"""The kernels an MXFP8 linear layer can run on a GPU (cublade.vllm.kernels): cublade's MXFP8 GEMM, vLLM's MXFP8
Marlin GEMM (the vllm-marlin-mxfp8 fallback) and cublade's dequantize + dense GEMM, each against the scheme's
reference linear on the same checkpoint tensors. All multiply the same exact bf16 weights (e4m3 times a power of
two) and sum in fp32, so they may differ from the reference only by summation order before the bf16 rounding. Run
on the H200 (vLLM staged for Marlin); skipped without a CUDA GPU (or, for Marlin, vLLM)."""
from __future__ import annotations

import pytest
import torch
from stand_in import stand_in_layer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 device)")


def mxfp8_layer(N: int, K: int, seed: int = 0) -> torch.nn.Module:
    """A stand-in for a vLLM linear layer after loading: cublade's MXFP8 tensors and what the kernels read."""
    from cublade.config import MXFP8Scheme

    scheme = MXFP8Scheme()
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05 * torch.linspace(0.2, 2.0, N).unsqueeze(1)
    return stand_in_layer(scheme, scheme.quantize(w), N, K)


@pytest.mark.parametrize("kernel", ["cublade-mxfp8-gemm", "cublade-mxfp8-gemm-sm80", "cublade-mxfp8-dequant-matmul",
                                    "vllm-marlin-mxfp8"])
@pytest.mark.parametrize("N,K,M", [(256, 128, 5), (4096, 1024, 1), (1000, 2048, 37), (512, 4096, 300),
                                   (768, 512, 400)])
def test_mxfp8_kernel_matches_reference(kernel, N, K, M):
    if kernel.startswith("vllm"):
        # a real vLLM module: tests/vllm (a namespace package when tests/ is on sys.path) also imports as "vllm"
        pytest.importorskip("vllm.model_executor", reason="vLLM is not installed (staged on the device: see README)")
    from cublade.vllm import kernels

    cls = next(k for k in kernels.CANDIDATES[kernels.MXFP8Scheme] if k.name == kernel)
    layer = mxfp8_layer(N, K)
    ref_tensors = {"weight": layer.weight.data.clone(), "weight_scale": layer.weight_scale.data.clone()}
    ok, why = cls.can_implement(layer)
    assert ok, why
    impl = cls(layer)  # repacks the layer (Marlin: its own weight layout)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).cuda()
    y = impl.apply(layer, x, None)
    ref = layer.cublade_scheme.linear_ref(x, ref_tensors)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    # fp32 sums in another order, one bf16 rounding: at most ~1 ulp apart (2^-7 relative), tiny outputs aside
    tol = ref.float().abs() * 2**-7 + ref.float().abs().mean() * 2**-10
    assert ((y.float() - ref.float()).abs() <= tol).all()


def test_cublade_mxfp8_gemm_says_what_it_cannot_run():
    from cublade.vllm.kernels import CubladeMxfp8Gemm

    layer = mxfp8_layer(64, 256)
    layer.params_dtype = torch.float16
    assert CubladeMxfp8Gemm.can_implement(layer) == (False, "takes bf16 activations, the model runs in torch.float16")
    layer = mxfp8_layer(64, 256)
    layer.weight_scale.data[5, 2] = 140
    ok, why = CubladeMxfp8Gemm.can_implement(layer)
    assert not ok and "scale code of 140" in why
