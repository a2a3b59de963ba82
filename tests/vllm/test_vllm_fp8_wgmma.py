"""CUBLADE_FP8_WGMMA=1 (cublade.vllm.kernels.cublade_fp8_wgmma): when the selection picks the kernel class (GPU mocked:
tests/gpu_mock.py), and, given the times a load measured, which GEMM each call runs (the timing and both GEMMs stood
in for: they need the GPU). The kernel itself: tests/ops/test_fp8_gemm_wgmma.py; the shared timing and ranges:
tests/vllm/test_vllm_w4a16_measured.py."""
from __future__ import annotations

import pytest
import torch
from gpu_mock import mocked_gpu
from stand_in import stand_in_layer
from test_vllm_kernels_by_gpu import choice, loaded_layer
from vllm_layers import KINDS

from cublade.config import Fp8Scheme
from cublade.numerics.fp8 import fp8_quant_weight
from cublade.vllm.kernels import cublade_fp8_wgmma as kw
from cublade.vllm.kernels import measured as mk

REASON = ("cublade's fp8_gemm_wgmma at the token counts where it measured faster than vLLM's CUTLASS at load, CUTLASS "
          "at the rest (the same weight tensor); activations by cublade's fp8_quant_per_token")


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_picked_on_hopper_when_asked_for(vllm_ctx, monkeypatch, strategy):
    layer = loaded_layer(Fp8Scheme(strategy, "dynamic-token"), KINDS["gate_up"], monkeypatch)
    with mocked_gpu(monkeypatch, 90):
        assert choice(layer)[0] == "vllm-cutlass-scaled-mm"  # not asked for
        monkeypatch.setenv("CUBLADE_FP8_WGMMA", "1")
        assert choice(layer) == ("cublade-fp8-wgmma", REASON,
                                 ["cublade-fp8-gemm: runs when asked for (CUBLADE_FP8_GEMM=1; not faster than vLLM's "
                                  "CUTLASS where measured)"])


def test_static_activations_too(vllm_ctx, monkeypatch):
    monkeypatch.setenv("CUBLADE_FP8_WGMMA", "1")
    layer = loaded_layer(Fp8Scheme("tensor", "static-tensor"), KINDS["down"], monkeypatch)
    with mocked_gpu(monkeypatch, 90):
        got, reason, _ = choice(layer)
    assert got == "cublade-fp8-wgmma"
    assert reason.endswith("activations by cublade's fp8_quant_per_tensor")


def test_refusals(vllm_ctx, monkeypatch):
    """sm_89 (no wgmma), fp16 models, vLLM's batch-invariant mode and an off-alignment shape keep CUTLASS or what
    follows it, each with its reason."""
    monkeypatch.setenv("CUBLADE_FP8_WGMMA", "1")
    layer = loaded_layer(Fp8Scheme(), KINDS["qkv"], monkeypatch)
    with mocked_gpu(monkeypatch, 89):
        assert kw.CubladeFp8Wgmma.can_implement(layer) == (False, "fp8_gemm_wgmma: cublade's kernels are built for "
                                                                  "sm_90a, this GPU is sm_89")
    with mocked_gpu(monkeypatch, 90):
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
        assert kw.CubladeFp8Wgmma.can_implement(layer) == (False, "VLLM_BATCH_INVARIANT=1 asks for one kernel at "
                                                                  "every batch size")
        monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    half = loaded_layer(Fp8Scheme(), KINDS["qkv"], monkeypatch, dtype=torch.float16)
    with mocked_gpu(monkeypatch, 90):
        assert kw.CubladeFp8Wgmma.can_implement(half) == (False, "writes bf16 outputs, the model runs in "
                                                                 "torch.float16")


def fp8_layer(N=256, K=512, prefix="model.layers.0.mlp.down_proj"):
    scheme = Fp8Scheme()
    w, ws = fp8_quant_weight(torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.05, True)
    layer = stand_in_layer(scheme, {"weight": w, "weight_scale": ws.reshape(-1, 1)}, N, K, device="cpu")
    layer.prefix = prefix
    return layer


# Times a load measured, us [CUTLASS, wgmma] (quantization included): wgmma faster at 8-128 tokens, by 1% only at
# 256 (CUTLASS's there), CUTLASS faster from 512.
TIMES = {1: [10.0, 10.1], 8: [10.0, 9.0], 16: [11.0, 9.5], 128: [20.0, 15.0], 256: [30.0, 29.7], 512: [50.0, 60.0]}


def test_each_call_runs_on_its_ranges_gemm(vllm_ctx, monkeypatch):
    monkeypatch.setenv("CUBLADE_FP8_WGMMA", "1")
    said, timed = [], []
    monkeypatch.setattr(kw.logger, "info", lambda msg, *args: said.append(msg % args))
    monkeypatch.setattr(mk, "time_rows", lambda kernels, K, dtype, device, rows: timed.append((list(kernels), K, rows))
                        or TIMES)
    monkeypatch.setattr(kw, "_ranges", {})
    layer = fp8_layer()
    impl = kw.CubladeFp8Wgmma(layer)  # on the CPU: the quantization's reference
    assert timed == [(kw.LABELS, 512, kw.MEASURED_ROWS)]
    assert impl.ranges == [(2, 129, 1)]  # 2-8, 9-16 and 17-128 tokens merged; 1 and from 129 CUTLASS
    assert layer.weight_scale.shape == (256,) and layer.weight_scale.dtype == torch.float32
    assert said == [f"cublade: fp8 layers of N=256, K=512 run on cublade's fp8_gemm_wgmma at 2-128 tokens, vLLM's "
                    f"CUTLASS scaled-mm at the rest (measured at load in {said[0].split('in ')[1].split(' s')[0]} s, "
                    f"us CUTLASS / wgmma, quantization included: M=1 10.0/10.1, M=8 10.0/9.0, M=16 11.0/9.5, "
                    f"M=128 20.0/15.0, M=256 30.0/29.7, M=512 50.0/60.0)"]
    ran = []
    impl.gemms = (lambda xq, xs: ran.append("cutlass") or torch.zeros(xq.shape[0], 256),
                  lambda xq, xs: ran.append("wgmma") or torch.ones(xq.shape[0], 256))
    for m in (1, 2, 128, 129, 4096):
        xq = torch.zeros(m, 512, dtype=torch.float8_e4m3fn)
        y = torch.ops.cublade.fp8_wgmma_linear(xq, torch.ones(m, 1), 256, impl.layer_name)
        assert y.shape == (m, 256)
    assert ran == ["cutlass", "wgmma", "wgmma", "cutlass", "cutlass"]
    kw.CubladeFp8Wgmma(fp8_layer(prefix="model.layers.1.mlp.down_proj"))  # a second layer of the shape: timed once
    assert len(timed) == 1
