"""CUBLADE_W4A16_PREFILL=machete on a GPU (cublade.vllm.kernels.cublade_w4a16_machete): a layer keeps cublade's
blob and Machete's copy of the same int4 weights, times both at load, and runs each call on the kernel of its token
range. Each call's output must be, bit for bit, what that kernel gives alone on the same checkpoint tensors
(cublade-w4a16-gemm or vllm-machete built on their own), and the measured ranges well formed. Skipped without a
CUDA GPU or vLLM (staged on the device: see README)."""
from __future__ import annotations

import pytest
import torch
from stand_in import stand_in_layer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 device)")


def w4a16_layer(scheme, N: int, K: int, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    layer = stand_in_layer(scheme, scheme.quantize(w), N, K)
    layer.input_size, layer.output_size = K, N  # what vLLM's Machete adapter reads (full sizes: one rank)
    return layer


@pytest.mark.parametrize("group_size,symmetric", [(128, True), (128, False), (-1, True)])
@pytest.mark.parametrize("N,K", [(4096, 4096), (1024, 2048)])
def test_each_call_is_its_kernels_output(vllm_dist, monkeypatch, group_size, symmetric, N, K):
    """(vllm_dist: vLLM's parameter classes, which the Machete adapter builds, read the tensor-parallel rank.)"""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    from cublade.config import W4A16Scheme
    from cublade.vllm.kernels import CubladeW4A16Gemm, VllmMachete
    from cublade.vllm.kernels import cublade_w4a16_machete as km

    monkeypatch.setenv("CUBLADE_W4A16_PREFILL", "machete")
    scheme = W4A16Scheme(group_size, symmetric)
    layer, alone_c, alone_m = (w4a16_layer(scheme, N, K) for _ in range(3))
    ok, why = km.CubladeW4A16Machete.can_implement(layer)
    assert ok, why
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cuda"))):
        impl = km.CubladeW4A16Machete(layer)
        cub, mach = CubladeW4A16Gemm(alone_c), VllmMachete(alone_m)
    rows = impl.rows
    assert len(rows) % 2 == 0 and rows == sorted(rows)
    assert all(lo == km.MEASURED_ROWS[0] or lo - 1 in km.MEASURED_ROWS for lo in rows[::2])  # start past a point
    if rows:  # both kernels, whatever this GPU measured (without a range the copy is gone: cublade's alone)
        impl.rows = [64, 128, 384, km.NO_END]
    else:
        assert not any(n.startswith("machete_") for n, _ in layer.named_parameters())
    for m in (1, 17, 64, 100, 128, 300, 384, 1000):
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16).cuda()
        y = impl.apply(layer, x, None)
        alone = mach.apply(alone_m, x, None) if km.on_machete(m, impl.rows) else cub.apply(alone_c, x, None)
        assert y.shape == (m, N) and torch.equal(y.view(torch.int16), alone.view(torch.int16)), m
