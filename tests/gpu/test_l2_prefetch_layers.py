"""CUBLADE_L2_PREFETCH on a GPU: each kernel class that prefetches (vLLM's CUTLASS for per-token fp8 layers, through
cublade::fp8_linear; cublade-fp8-gemm; cublade-w4a16-gemm) gives, bit for bit, the output it gives without the
setting, at decode and prefill token counts, while its op asks the GPU for the next layer's weight (the op's call
recorded and run). Skipped without a CUDA GPU and vLLM."""
from __future__ import annotations

import pytest
import torch
from stand_in import stand_in_layer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 device)")


def fp8_tensors(scheme, N, K, seed):
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    t = scheme.quantize(w)
    t["weight_scale"] = t["weight_scale"].float().reshape(-1)  # as cublade.vllm.linear leaves a per-channel scale
    return t


def w4a16_tensors(scheme, N, K, seed):
    return scheme.quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05)


CASES = {  # kernel class name -> (scheme, tensors, environment)
    "vllm-cutlass-scaled-mm": ("fp8", fp8_tensors, {}),
    "cublade-fp8-gemm": ("fp8", fp8_tensors, {"CUBLADE_FP8_GEMM": "1"}),
    "cublade-w4a16-gemm": ("w4a16", w4a16_tensors, {}),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("M", [1, 16, 300])
def test_outputs_unchanged_and_next_weight_asked_for(monkeypatch, name, M):
    pytest.importorskip("vllm.model_executor", reason="vLLM is not installed (staged on the device: see README)")
    from cublade.config import Fp8Scheme, W4A16Scheme
    from cublade.vllm.kernels import CANDIDATES, prefetch

    kind, make, env = CASES[name]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    scheme = Fp8Scheme("channel", "dynamic-token") if kind == "fp8" else W4A16Scheme(128, True)
    cls = next(c for c in CANDIDATES[type(scheme)] if c.name == name)
    N, K = 4096, 2048
    layers = [stand_in_layer(scheme, make(scheme, N, K, seed), N, K) for seed in range(3)]
    ok, why = cls.can_implement(layers[0])
    assert ok, why
    kernels = [cls(lay) for lay in layers]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    plain = [k.apply(lay, x, None) for k, lay in zip(kernels, layers)]

    monkeypatch.setattr(prefetch, "_names", {})
    monkeypatch.setattr(prefetch, "_next", {})
    monkeypatch.setattr(prefetch, "_last", [None])
    asked, real = [], prefetch.l2_prefetch
    monkeypatch.setattr(prefetch, "l2_prefetch", lambda t, n: (asked.append((t, n)), real(t, n)))
    for i, (k, lay) in enumerate(zip(kernels, layers)):
        prefetch.link(lay, f"test.{name}.{i}", k, mib=24)
    assert all(k.prefetch_name for k in kernels)
    again = [k.apply(lay, x, None) for k, lay in zip(kernels, layers)]
    torch.cuda.synchronize()
    for a, b in zip(plain, again):
        assert torch.equal(a, b)
    streamed = [getattr(lay, cls.streamed) for lay in layers]
    assert [t is s for (t, _), s in zip(asked, streamed[1:])] == [True, True]
    assert all(n == min(24 << 20, s.numel() * s.element_size()) for (_, n), s in zip(asked, streamed[1:]))
