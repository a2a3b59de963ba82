"""Reference quantized linears: each scheme's layer against the fp32 product of its dequantized weight, and
the FP8 W8A8 path against an explicit quantize-both-sides computation."""
import pytest
import torch

from cublade.config import FP4Scheme, Fp8Scheme, MXFP8Scheme, W4A16Scheme
from cublade.numerics.fp8 import quantize_per_token


def _data(N=48, K=128, M=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * 0.05, torch.randn(N, generator=g)


@pytest.mark.parametrize("scheme", [W4A16Scheme(128), W4A16Scheme(32, False), MXFP8Scheme(), MXFP8Scheme("floor"),
                                    FP4Scheme("mxfp4"), FP4Scheme("nvfp4")])
def test_weight_only_schemes_equal_dequantized_product(scheme):
    x, w, b = _data()
    t = scheme.quantize(w)
    y = scheme.linear_ref(x, t, b)
    expect = x @ scheme.dequantize(t).t() + b
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-5)
    # and the quantization itself is close to the float layer
    rel = ((y - (x @ w.t() + b)).norm() / (x @ w.t()).norm()).item()
    assert rel < (0.15 if scheme.kind in ("w4a16", "fp4") else 0.04)


@pytest.mark.parametrize("weight_strategy", ["channel", "tensor"])
def test_fp8_dynamic_token_is_quantized_product(weight_strategy):
    x, w, b = _data()
    s = Fp8Scheme(weight_strategy=weight_strategy)
    t = s.quantize(w)
    xq, xs = quantize_per_token(x)
    expect = (xq.float() @ t["weight"].float().t()) * xs * t["weight_scale"].reshape(1, -1) + b
    assert torch.equal(s.linear_ref(x, t, b), expect)
    assert ((s.linear_ref(x, t) - x @ w.t()).norm() / (x @ w.t()).norm()).item() < 0.05


def test_fp8_static_uses_the_given_input_scale():
    x, w, _ = _data()
    s = Fp8Scheme(activations="static-tensor")
    t = s.quantize(w)
    t["input_scale"] = torch.tensor([x.abs().max().item() / 448])
    y = s.linear_ref(x, t)
    assert ((y - x @ w.t()).norm() / (x @ w.t()).norm()).item() < 0.06
    with pytest.raises(ValueError, match="input_scale"):
        s.linear_ref(x, {k: v for k, v in t.items() if k != "input_scale"})


def test_output_keeps_input_dtype_and_leading_dims():
    x, w, _ = _data()
    s = Fp8Scheme()
    y = s.linear_ref(x.reshape(5, 1, 128).bfloat16(), s.quantize(w))
    assert y.dtype == torch.bfloat16 and y.shape == (5, 1, 48)
