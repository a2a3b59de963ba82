"""CUBLADE_W4A16_PREFILL=machete / humming / machete,humming / fp8,machete on a GPU
(cublade.vllm.kernels.cublade_w4a16_measured): a layer keeps cublade's blob and a copy of the same int4 weights per
vLLM kernel that won a token range at load, and runs each call on its range's kernel. Each call's output must be, bit
for bit, what that kernel gives alone on the same checkpoint tensors (cublade-w4a16-gemm, vllm-machete or vllm-humming
built on their own, cublade's FP8 tensor-core op from its first row; Humming's within 1e-2 of it, as Humming reduces
over K in no fixed order), and close to the scheme's reference (the FP8 path within 5e-2: its activations in E4M3);
the measured ranges well formed; the load-time timing a kernel's GPU time, not its host work. Skipped without a CUDA
GPU or vLLM (staged on the device: see README); the Humming cases without the humming-kernels package."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from stand_in import vllm_stand_in_layer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 device)")
HUMMING = pytest.mark.skipif(importlib.util.find_spec("humming") is None,
                             reason="vLLM's Humming needs the humming-kernels package (README: the device's wheels)")


def w4a16_layer(scheme, tensors, N: int, K: int) -> torch.nn.Module:
    return vllm_stand_in_layer(scheme, tensors, N, K, f"test.{N}x{K}")


@pytest.mark.parametrize("kernels", ["machete", pytest.param("humming", marks=HUMMING),
                                     pytest.param("machete,humming", marks=HUMMING), "fp8,machete"])
@pytest.mark.parametrize("group_size,symmetric", [(128, True), (128, False), (-1, True)])
@pytest.mark.parametrize("N,K", [(4096, 4096), (1024, 2048)])
def test_each_call_is_its_kernels_output(vllm_dist, monkeypatch, kernels, group_size, symmetric, N, K):
    """(vllm_dist: vLLM's parameter classes, which the adapters build, read the tensor-parallel rank.)"""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    from cublade.config import W4A16Scheme
    from cublade.vllm.kernels import CubladeW4A16Gemm
    from cublade.vllm.kernels import cublade_w4a16_measured as km
    from cublade.vllm.kernels import measured as mk

    monkeypatch.setenv("CUBLADE_W4A16_PREFILL", kernels)
    scheme = W4A16Scheme(group_size, symmetric)
    tensors = scheme.quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.05)
    layer = w4a16_layer(scheme, tensors, N, K)
    ok, why = km.CubladeW4A16Measured.can_implement(layer)
    assert ok, why
    names = ["cublade", *kernels.split(",")]
    measured, measure = [], mk.kernel_ranges

    def every_kernel_in_a_range(times):  # what this GPU measured, checked below; the calls then cover every kernel
        measured.append((times, measure(times)))
        return [(17, 129, 1), (129, 385, len(names) - 1), (385, mk.NO_END, 1)]

    monkeypatch.setattr(mk, "_measured", {})
    monkeypatch.setattr(mk, "kernel_ranges", every_kernel_in_a_range)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cuda"))):
        impl = km.CubladeW4A16Measured(layer)
        alone = [(km.VLLM_KERNELS.get(n, CubladeW4A16Gemm), w4a16_layer(scheme, tensors, N, K)) for n in names]
        alone = [(cls(l), l) for cls, l in alone]  # "fp8": cublade's blob, run below through the FP8 op
    (times, ranges), = measured
    assert sorted(times) == list(mk.MEASURED_ROWS)
    assert all(len(t) == len(names) and all(0 < v < 1e5 for v in t) for t in times.values()), times
    assert all(lo == mk.MEASURED_ROWS[0] or lo - 1 in mk.MEASURED_ROWS for lo, _, _ in ranges)  # start past a point
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))
    ranges = impl.ranges
    assert all(getattr(layer, f"cublade_{n}") is not None for n in names[1:] if n != "fp8")  # each won: copy kept
    ran = []
    for k, adapter in enumerate(impl.adapters):
        if adapter is not None:  # which vLLM kernel a call ran: Humming's outputs alone cannot tell (below)
            monkeypatch.setattr(adapter, "apply", lambda *a, k=k, f=adapter.apply: (ran.append(k), f(*a))[1])
    for m in (1, 17, 64, 100, 128, 300, 384, 1000):
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16).cuda()
        ran.clear()
        y = impl.apply(layer, x, None)
        k = mk.kernel_at(m, ranges)
        assert ran == ([k] if impl.adapters[k] is not None else []), (m, ranges, ran)
        kernel, alone_layer = alone[k]
        if names[k] == "fp8":  # the FP8 tensor-core op alone, from its first row
            want = torch.ops.cublade.w4a16_gemm_fp8(x, alone_layer.weight_packed, kernel.group_size, kernel.symmetric,
                                                    N, 0)
        else:
            want = kernel.apply(alone_layer, x, None)
        assert y.shape == (m, N), (m, y.shape)
        if names[k] == "humming":  # stream-K: Humming alone gives other last bits run to run (rel 1e-3..4e-3, H200)
            assert (y.float() - want.float()).abs().mean() < 1e-2 * want.float().abs().mean(), (m, ranges)
        else:
            assert torch.equal(y.view(torch.int16), want.view(torch.int16)), (m, ranges)
        ref = scheme.linear_ref(x.cpu(), tensors).float()
        err = (y.float().cpu() - ref).abs().mean() / ref.abs().mean()
        assert err < (5e-2 if names[k] == "fp8" else 1e-2), (m, names[k], err.item())  # fp8: E4M3 activations


def test_load_timing_is_gpu_time_not_host_work():
    """time_rows times each call as one CUDA graph replay: 400 us of Python in a call (a slow launcher on a busy host)
    leaves its time the GEMM's own; timed eagerly, what outlasts the stream hold (about 108 us) would count."""
    import time

    from cublade.vllm.kernels import measured as mk

    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def slow(x):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 400e-6:
            pass
        return torch.nn.functional.linear(x, w)

    times = mk.time_rows({"gemm": lambda x: torch.nn.functional.linear(x, w), "slow": slow}, 4096, torch.bfloat16,
                         torch.device("cuda"), rows=(16, 256))
    assert sorted(times) == [16, 256]
    for m, (gemm, slow_gemm) in times.items():
        assert 0 < gemm < 200 and slow_gemm < 1.25 * gemm + 5, (m, times)
