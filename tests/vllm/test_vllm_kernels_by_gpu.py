"""Which kernel runs each scheme on each GPU family, with the device capability mocked (tests/gpu_mock.py): real vLLM
layers built and loaded on CPU, then the selection's candidates asked, as on a GPU of capability 8.0 (A100), 8.6
(A10, RTX 3090), 8.9 (L40S, RTX 4090) and 9.0 (H100, H200). No scheme lands on the fp32 reference on a GPU unless
CUBLADE_ALLOW_REFERENCE=1 asks for it; without it a layer no other kernel takes stops the load with every
candidate's reason."""
from __future__ import annotations

import pytest
import torch
from gpu_mock import mocked_gpu
from vllm_layers import KINDS, load, random_weights, single_scheme_config

from cublade.config import Fp8Scheme, MXFP8Scheme, W4A16Scheme

CAPS = (80, 86, 89, 90)
# scheme -> the kernel chosen at each of CAPS (bf16 activations, the extension built)
EXPECTED = {
    Fp8Scheme("channel", "dynamic-token"): ("vllm-marlin-fp8",) * 2 + ("vllm-cutlass-scaled-mm",) * 2,
    Fp8Scheme("tensor", "static-tensor"): ("vllm-marlin-fp8",) * 2 + ("vllm-cutlass-scaled-mm",) * 2,
    W4A16Scheme(128, True): ("vllm-marlin",) * 3 + ("cublade-w4a16-gemm",),
    W4A16Scheme(64, False): ("vllm-marlin",) * 3 + ("cublade-w4a16-gemm",),
    W4A16Scheme(-1, True): ("vllm-marlin",) * 3 + ("cublade-w4a16-gemm",),
    W4A16Scheme(32, True): ("vllm-marlin",) * 3 + ("cublade-w4a16-gemm",),
    MXFP8Scheme(): ("vllm-marlin-mxfp8",) * 3 + ("cublade-mxfp8-gemm",),
}


def loaded_layer(scheme, kind, monkeypatch, dtype=torch.bfloat16):
    """A layer after loading and the linear method's post-load steps, its kernel not yet chosen."""
    from cublade.vllm import linear

    torch.set_default_dtype(dtype)
    tensors = {m: scheme.quantize(w) for m, w in random_weights(kind).items()}
    for t in tensors.values():
        if getattr(scheme, "static", False):
            t["input_scale"] = torch.tensor([0.01], dtype=torch.float32)
    layer = kind.build(single_scheme_config(scheme))
    load(layer, kind, tensors)
    with monkeypatch.context() as m:
        m.setattr(linear, "select_kernel", lambda layer, prefix: None)
        layer.quant_method.process_weights_after_loading(layer)
    return layer


def choice(layer):
    from cublade.vllm.kernels import CANDIDATES, first_runnable

    k, reason, skipped = first_runnable(CANDIDATES[type(layer.cublade_scheme)], lambda k: k.can_implement(layer))
    return (None if k is None else k.name), reason, skipped


@pytest.mark.parametrize("scheme", list(EXPECTED), ids=[s.describe() for s in EXPECTED])
def test_kernel_per_gpu(vllm_ctx, monkeypatch, scheme):
    layer = loaded_layer(scheme, KINDS["qkv"], monkeypatch)
    for cap, want in zip(CAPS, EXPECTED[scheme]):
        with mocked_gpu(monkeypatch, cap):
            got, reason, _ = choice(layer)
        assert got == want, (cap, got, reason)


def test_fp8_marlin_reason_says_w8a16(vllm_ctx, monkeypatch):
    layer = loaded_layer(Fp8Scheme(), KINDS["down"], monkeypatch)
    with mocked_gpu(monkeypatch, 86):
        got, reason, skipped = choice(layer)
    assert got == "vllm-marlin-fp8"
    assert reason == "W8A16 on sm_86: e4m3 weights decoded to torch.bfloat16 in the kernel, activations not quantized"
    assert skipped == ["vllm-cutlass-scaled-mm: vLLM's CUTLASS FP8 GEMM does not run on sm_86"]


@pytest.mark.parametrize("cap", CAPS)
def test_fp8_shapes_cutlass_refuses_run_on_marlin(vllm_ctx, monkeypatch, cap):
    """A per-rank shape off CUTLASS's 16-alignment (N = 200 here) runs W8A16 on Marlin, which pads its tiles."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    torch.set_default_dtype(torch.bfloat16)
    layer = ColumnParallelLinear(128, 200, bias=False, quant_config=single_scheme_config(Fp8Scheme()),
                                 prefix="model.layers.0.mlp.odd_proj")
    with mocked_gpu(monkeypatch, cap):
        got, _, skipped = choice(layer)
    assert got == "vllm-marlin-fp8"
    if cap >= 89:
        assert skipped == ["vllm-cutlass-scaled-mm: N=200, K=128 are not multiples of 16"]


def test_w4a16_without_cublade_on_hopper_runs_machete(vllm_ctx, monkeypatch):
    monkeypatch.setenv("CUBLADE_DISABLED_KERNELS", "cublade-w4a16-gemm")
    layer = loaded_layer(W4A16Scheme(128, True), KINDS["gate_up"], monkeypatch)
    with mocked_gpu(monkeypatch, 90):
        assert choice(layer)[0] == "vllm-machete"
    with mocked_gpu(monkeypatch, 89):
        assert choice(layer)[0] == "vllm-marlin"


def test_mxfp8_fp16_activations_on_hopper_run_marlin(vllm_ctx, monkeypatch):
    layer = loaded_layer(MXFP8Scheme(), KINDS["gate_up"], monkeypatch, dtype=torch.float16)
    with mocked_gpu(monkeypatch, 90):
        got, _, skipped = choice(layer)
    assert got == "vllm-marlin-mxfp8"
    assert skipped == ["cublade-mxfp8-gemm: takes bf16 activations, the model runs in torch.float16"]


@pytest.mark.parametrize("cap", CAPS)
def test_reference_on_a_gpu_only_when_asked_for(vllm_ctx, monkeypatch, caplog, cap):
    """fp32 activations: no tensor-core kernel takes them. On a GPU the load stops, naming the layer and every
    candidate's reason, unless CUBLADE_ALLOW_REFERENCE=1; then the reference runs and the log says it was asked for."""
    from cublade.vllm import kernels

    scheme, kind = W4A16Scheme(128, True), KINDS["down"]
    layer = loaded_layer(scheme, kind, monkeypatch, dtype=torch.float32)
    with mocked_gpu(monkeypatch, cap):
        with pytest.raises(NotImplementedError) as e:
            kernels.select_kernel(layer, kind.prefix)
        msg = str(e.value)
        assert "\n" not in msg
        assert msg.startswith(f"{kind.prefix}: no kernel can run scheme w4a16(group_size=128, symmetric=True) [N=128, "
                              f"K=256, torch.float32]: cublade-w4a16-gemm: takes bf16/fp16 activations")
        for name in ("vllm-machete", "vllm-marlin"):
            assert f"; {name}: takes bf16/fp16 activations, the model runs in torch.float32" in msg
        assert msg.endswith("; reference: fp32 reference math, on a GPU only when asked for with "
                            "CUBLADE_ALLOW_REFERENCE=1 (many times slower than a tensor-core kernel)")
        monkeypatch.setenv("CUBLADE_ALLOW_REFERENCE", "1")
        kernels._logged.clear()
        with caplog.at_level("INFO", logger="vllm.cublade"):
            kernel = kernels.select_kernel(layer, kind.prefix)
        monkeypatch.delenv("CUBLADE_ALLOW_REFERENCE")
    assert kernel.name == "reference"
    assert f"run on reference: pure-PyTorch reference on sm_{cap}, asked for with CUBLADE_ALLOW_REFERENCE=1" in \
        caplog.text


def test_reference_stays_the_cpu_path(vllm_ctx, monkeypatch):
    layer = loaded_layer(Fp8Scheme(), KINDS["qkv"], monkeypatch)
    assert choice(layer)[:2] == ("reference", "pure-PyTorch reference (cublade.ops), the CPU path")


@pytest.mark.parametrize("cap", (80, 89))
def test_only_reference_left_stops_the_load(vllm_ctx, monkeypatch, cap):
    """Taking the tensor-core kernels out (CUBLADE_DISABLED_KERNELS) does not fall back to the reference on a GPU."""
    monkeypatch.setenv("CUBLADE_DISABLED_KERNELS", "vllm-cutlass-scaled-mm,vllm-marlin-fp8")
    layer = loaded_layer(Fp8Scheme(), KINDS["qkv"], monkeypatch)
    with mocked_gpu(monkeypatch, cap):
        got, _, skipped = choice(layer)
    assert got is None and skipped[-1].startswith("reference: fp32 reference math, on a GPU only when asked for")
