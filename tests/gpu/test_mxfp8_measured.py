"""CUBLADE_MXFP8_PREFILL=humming on a GPU (cublade.vllm.kernels.cublade_mxfp8_measured): a layer keeps cublade's blob
and, where vLLM's Humming won a token range at load, a copy of the checkpoint's MXFP8 tensors in Humming's layout, and
runs each call on its range's kernel. Each call's output must be what that kernel gives alone on the same checkpoint
tensors (cublade-mxfp8-gemm bit for bit; vllm-humming-mxfp8 within 1e-2, as Humming reduces over K in no fixed order),
and close to the scheme's reference; the measured ranges well formed. Skipped without a CUDA GPU, vLLM or the
humming-kernels package (staged on the device: see README)."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from stand_in import vllm_stand_in_layer

HUMMING = "vLLM's Humming needs the humming-kernels package (README: the device's wheels)"
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 device)"),
              pytest.mark.skipif(importlib.util.find_spec("humming") is None, reason=HUMMING)]


def mxfp8_layer(scheme, tensors, N: int, K: int) -> torch.nn.Module:
    return vllm_stand_in_layer(scheme, tensors, N, K, f"test.mxfp8.{N}x{K}")


@pytest.mark.parametrize("N,K", [(4096, 4096), (4096, 14336), (1024, 2048)])
def test_each_call_is_its_kernels_output(vllm_dist, monkeypatch, N, K):
    """(vllm_dist: vLLM's parameter classes read the tensor-parallel rank.)"""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    from cublade.config import MXFP8Scheme
    from cublade.vllm.kernels import CubladeMxfp8Gemm
    from cublade.vllm.kernels import cublade_mxfp8_measured as kx
    from cublade.vllm.kernels import measured as mk

    monkeypatch.setenv("CUBLADE_MXFP8_PREFILL", "humming")
    scheme = MXFP8Scheme()
    tensors = scheme.quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.05)
    layer = mxfp8_layer(scheme, tensors, N, K)
    ok, why = kx.CubladeMxfp8Measured.can_implement(layer)
    assert ok, why
    measured, measure = [], mk.kernel_ranges

    def both_kernels_in_a_range(times):  # what this GPU measured, checked below; the calls then cover both kernels
        measured.append((times, measure(times)))
        return [(129, 385, 1), (1025, mk.NO_END, 1)]

    monkeypatch.setattr(mk, "_measured", {})
    monkeypatch.setattr(mk, "kernel_ranges", both_kernels_in_a_range)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cuda"))):
        impl = kx.CubladeMxfp8Measured(layer)
        alone = [(CubladeMxfp8Gemm, mxfp8_layer(scheme, tensors, N, K)),
                 (kx.VLLM_KERNELS["humming"], mxfp8_layer(scheme, tensors, N, K))]
        alone = [(cls(l), l) for cls, l in alone]
    (times, ranges), = measured
    assert sorted(times) == list(mk.MEASURED_ROWS)
    assert all(len(t) == 2 and all(0 < v < 1e5 for v in t) for t in times.values()), times
    assert all(lo == mk.MEASURED_ROWS[0] or lo - 1 in mk.MEASURED_ROWS for lo, _, _ in ranges)
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))
    assert layer.cublade_humming is not None
    ran = []
    humming = impl.adapters[1]
    monkeypatch.setattr(humming, "apply", lambda *a, f=humming.apply: (ran.append(1), f(*a))[1])
    for m in (1, 16, 128, 129, 300, 384, 1000, 1100):
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16).cuda()
        ran.clear()
        y = impl.apply(layer, x, None)
        k = mk.kernel_at(m, impl.ranges)
        assert ran == ([k] if k else []), (m, impl.ranges, ran)
        kernel, alone_layer = alone[k]
        want = kernel.apply(alone_layer, x, None)
        assert y.shape == (m, N), (m, y.shape)
        if k:  # stream-K: Humming alone gives other last bits run to run
            assert (y.float() - want.float()).abs().mean() < 1e-2 * want.float().abs().mean(), m
        else:
            assert torch.equal(y.view(torch.int16), want.view(torch.int16)), m
        ref = scheme.linear_ref(x.cpu(), tensors).float()
        err = (y.float().cpu() - ref).abs().mean() / ref.abs().mean()
        assert err < 1e-2, (m, k, err.item())
