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
# the same with vLLM's Marlin kernels disabled (CUBLADE_DISABLED_KERNELS): cublade's sm_80 kernels on sm_80-89
MARLIN = "vllm-marlin,vllm-marlin-fp8,vllm-marlin-mxfp8"
EXPECTED_WITHOUT_MARLIN = {
    Fp8Scheme("channel", "dynamic-token"): ("cublade-fp8-w8a16",) * 2 + ("vllm-cutlass-scaled-mm",) * 2,
    W4A16Scheme(128, True): ("cublade-w4a16-gemm-sm80",) * 3 + ("cublade-w4a16-gemm",),
    W4A16Scheme(64, False): ("cublade-w4a16-gemm-sm80",) * 3 + ("cublade-w4a16-gemm",),
    MXFP8Scheme(): ("cublade-mxfp8-gemm-sm80",) * 3 + ("cublade-mxfp8-gemm",),
}
# the same without cublade's extensions: vLLM's kernels, named fallbacks
EXPECTED_WITHOUT_EXTENSION = {
    Fp8Scheme("channel", "dynamic-token"): ("vllm-marlin-fp8",) * 2 + ("vllm-cutlass-scaled-mm",) * 2,
    W4A16Scheme(128, True): ("vllm-marlin",) * 3 + ("vllm-machete",),
    MXFP8Scheme(): ("vllm-marlin-mxfp8",) * 4,
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


@pytest.mark.parametrize("scheme", list(EXPECTED_WITHOUT_MARLIN), ids=[s.describe() for s in EXPECTED_WITHOUT_MARLIN])
def test_kernel_per_gpu_with_marlin_disabled(vllm_ctx, monkeypatch, scheme):
    monkeypatch.setenv("CUBLADE_DISABLED_KERNELS", MARLIN)
    layer = loaded_layer(scheme, KINDS["qkv"], monkeypatch)
    for cap, want in zip(CAPS, EXPECTED_WITHOUT_MARLIN[scheme]):
        with mocked_gpu(monkeypatch, cap):
            got, reason, _ = choice(layer)
        assert got == want, (cap, got, reason)


@pytest.mark.parametrize("scheme", list(EXPECTED_WITHOUT_EXTENSION),
                         ids=[s.describe() for s in EXPECTED_WITHOUT_EXTENSION])
def test_kernel_per_gpu_without_cublade_extensions(vllm_ctx, monkeypatch, scheme):
    layer = loaded_layer(scheme, KINDS["qkv"], monkeypatch)
    for cap, want in zip(CAPS, EXPECTED_WITHOUT_EXTENSION[scheme]):
        with mocked_gpu(monkeypatch, cap, extension=False):
            got, reason, _ = choice(layer)
        assert got == want, (cap, got, reason)


OWN_FP8 = ["cublade-fp8-gemm: runs when asked for (CUBLADE_FP8_GEMM=1; not faster than vLLM's CUTLASS where measured)",
           "cublade-fp8-wgmma: runs when asked for (CUBLADE_FP8_WGMMA=1)"]


def test_fp8_w8a16_reasons(vllm_ctx, monkeypatch):
    monkeypatch.setenv("CUBLADE_DISABLED_KERNELS", "vllm-marlin-fp8")
    layer = loaded_layer(Fp8Scheme(), KINDS["down"], monkeypatch)
    with mocked_gpu(monkeypatch, 86):
        got, reason, skipped = choice(layer)
    assert got == "cublade-fp8-w8a16"
    assert reason == ("W8A16 on sm_86: cublade's CUDA op mxfp8_gemm_sm80 over the e4m3 codes, activations not "
                      "quantized (from 64 tokens dequantize + cuBLAS)")
    assert skipped == [*OWN_FP8, "vllm-cutlass-scaled-mm: vLLM's CUTLASS FP8 GEMM does not run on sm_86",
                       "vllm-marlin-fp8: disabled by CUBLADE_DISABLED_KERNELS"]
    monkeypatch.delenv("CUBLADE_DISABLED_KERNELS")
    with mocked_gpu(monkeypatch, 86, extension=False):
        got, reason, skipped = choice(layer)
    assert got == "vllm-marlin-fp8"
    assert reason == "W8A16 on sm_86: e4m3 weights decoded to torch.bfloat16 in the kernel, activations not quantized"
    assert skipped == [*OWN_FP8, "vllm-cutlass-scaled-mm: vLLM's CUTLASS FP8 GEMM does not run on sm_86"]


@pytest.mark.parametrize("cap", CAPS)
def test_fp8_shapes_cutlass_refuses_run_w8a16(vllm_ctx, monkeypatch, cap):
    """A per-rank shape off CUTLASS's 16-alignment (N = 200 here) runs W8A16: Marlin, which pads its tiles, or with
    Marlin disabled cublade's sm_80 kernel (any N, K % 32)."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    torch.set_default_dtype(torch.bfloat16)
    layer = ColumnParallelLinear(128, 200, bias=False, quant_config=single_scheme_config(Fp8Scheme()),
                                 prefix="model.layers.0.mlp.odd_proj")
    with mocked_gpu(monkeypatch, cap):
        got, _, skipped = choice(layer)
    assert got == "vllm-marlin-fp8"
    if cap >= 89:
        assert skipped[-1] == "vllm-cutlass-scaled-mm: N=200, K=128 are not multiples of 16"
    if cap == 90:  # asked for, cublade's FP8 GEMM still needs CUTLASS for the larger batches
        monkeypatch.setenv("CUBLADE_FP8_GEMM", "1")
        with mocked_gpu(monkeypatch, cap):
            got, _, skipped = choice(layer)
        monkeypatch.delenv("CUBLADE_FP8_GEMM")
        assert got == "vllm-marlin-fp8"
        assert skipped[0] == ("cublade-fp8-gemm: larger batches need vLLM's CUTLASS: N=200, K=128 are not multiples "
                              "of 16")
    monkeypatch.setenv("CUBLADE_DISABLED_KERNELS", "vllm-marlin-fp8")
    assert choice(layer)[0] == "cublade-fp8-w8a16"


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_fp8_gemm_when_asked_for(vllm_ctx, monkeypatch, strategy):
    """CUBLADE_FP8_GEMM=1: per-token dynamic fp8 layers on sm_90 take cublade-fp8-gemm (CUTLASS above 16 tokens);
    static activations, sm_89, fp16 models and CUBLADE_FP8_FUSE=1 keep vLLM's CUTLASS, each with its reason."""
    from cublade.vllm.kernels.cublade_fp8_gemm import CubladeFp8Gemm

    monkeypatch.setenv("CUBLADE_FP8_GEMM", "1")
    layer = loaded_layer(Fp8Scheme(strategy, "dynamic-token"), KINDS["gate_up"], monkeypatch)
    with mocked_gpu(monkeypatch, 90):
        got, reason, skipped = choice(layer)
        assert (got, skipped) == ("cublade-fp8-gemm", [])
        assert reason == ("cublade's fp8_gemm up to 16 tokens, vLLM's CUTLASS scaled-mm above, activations by "
                          "cublade's fp8_quant_per_token")
        monkeypatch.setenv("CUBLADE_FP8_GEMM_VALUES", "bf16")  # the kernel's other decode
        assert CubladeFp8Gemm.can_implement(layer) == (True, reason + " (fp8_gemm on bf16 values: "
                                                             "CUBLADE_FP8_GEMM_VALUES=bf16)")
        monkeypatch.delenv("CUBLADE_FP8_GEMM_VALUES")
        monkeypatch.setenv("CUBLADE_FP8_FUSE", "1")
        assert CubladeFp8Gemm.can_implement(layer) == (
            False, "CUBLADE_FP8_FUSE=1 traces the quantization for Inductor onto vLLM's CUTLASS")
        monkeypatch.delenv("CUBLADE_FP8_FUSE")
    with mocked_gpu(monkeypatch, 89):
        assert choice(layer)[0] == "vllm-cutlass-scaled-mm"
    static = loaded_layer(Fp8Scheme(strategy, "static-tensor"), KINDS["qkv"], monkeypatch)
    with mocked_gpu(monkeypatch, 90):
        got, _, skipped = choice(static)
    assert got == "vllm-cutlass-scaled-mm"
    assert skipped == ["cublade-fp8-gemm: static-tensor activations: the op takes per-token dynamic ones (vLLM's "
                       "CUTLASS runs the layer)", OWN_FP8[1]]
    half = loaded_layer(Fp8Scheme(strategy, "dynamic-token"), KINDS["qkv"], monkeypatch, dtype=torch.float16)
    with mocked_gpu(monkeypatch, 90):
        assert choice(half)[2][0] == "cublade-fp8-gemm: takes bf16 activations, the model runs in torch.float16"
    monkeypatch.setenv("CUBLADE_FP8_GEMM", "yes")
    with pytest.raises(ValueError, match=r"CUBLADE_FP8_GEMM='yes': expected 0 or 1"):
        CubladeFp8Gemm.can_implement(layer)


def test_w4a16_under_vllm_batch_invariant_stays_on_the_kernels(vllm_ctx, monkeypatch):
    """VLLM_BATCH_INVARIANT=1: cublade-w4a16-gemm runs every batch on its kernels (prefill=False: no dequantize +
    cuBLAS path, whose rounded bf16 weights made outputs depend on the batch), and the log says so."""
    from cublade.vllm.kernels.cublade_w4a16_gemm import CubladeW4A16Gemm

    def layer():
        return loaded_layer(W4A16Scheme(128, True), KINDS["down"], monkeypatch)

    # on CPU the kernel's gemm is the reference, called with the arguments the op would get
    assert CubladeW4A16Gemm(layer()).gemm.keywords == {"split_k": 0, "prefill": True}
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert CubladeW4A16Gemm(layer()).gemm.keywords == {"split_k": 0, "prefill": False}
    with mocked_gpu(monkeypatch, 90):
        assert choice(layer())[:2] == ("cublade-w4a16-gemm", "cublade's CUDA op w4a16_gemm (its kernels at every "
                                                             "batch size: VLLM_BATCH_INVARIANT=1)")
        monkeypatch.delenv("VLLM_BATCH_INVARIANT")
        assert choice(layer())[:2] == ("cublade-w4a16-gemm", "cublade's CUDA op w4a16_gemm (decode kernels; from "
                                                             "257-1024 tokens dequantize + cuBLAS)")


def test_w4a16_without_cublade_on_hopper_runs_machete(vllm_ctx, monkeypatch):
    monkeypatch.setenv("CUBLADE_DISABLED_KERNELS", "cublade-w4a16-gemm,cublade-w4a16-gemm-sm80")
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
    assert skipped == ["cublade-mxfp8-measured: runs when asked for (CUBLADE_MXFP8_PREFILL=humming)",
                       "cublade-mxfp8-gemm: takes bf16 activations, the model runs in torch.float16"]


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
                              f"K=256, torch.float32]: cublade-w4a16-fp8-prefill: runs when asked for "
                              f"(CUBLADE_W4A16_PREFILL=fp8); cublade-w4a16-measured: runs when asked for "
                              f"(CUBLADE_W4A16_PREFILL=machete, humming or machete,humming); cublade-w4a16-gemm: "
                              f"takes bf16/fp16 activations")
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
    monkeypatch.setenv("CUBLADE_DISABLED_KERNELS", "vllm-cutlass-scaled-mm,cublade-fp8-w8a16,vllm-marlin-fp8")
    layer = loaded_layer(Fp8Scheme(), KINDS["qkv"], monkeypatch)
    with mocked_gpu(monkeypatch, cap):
        got, _, skipped = choice(layer)
    assert got is None and skipped[-1].startswith("reference: fp32 reference math, on a GPU only when asked for")


def test_asymmetric_w4a16_rows_off_the_zero_point_packing(vllm_ctx, monkeypatch):
    """N per rank not a multiple of 8 (12 here, e.g. 24 rows over 2 ranks) with zero points: cublade's kernels take
    it (sm_90, and sm_80-89 with cublade._C_sm80); vLLM's Marlin packs zero points 8 per int32 along N, so without
    cublade's sm_80 kernel the load stops there with the reasons."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    from cublade.vllm import kernels

    torch.set_default_dtype(torch.bfloat16)
    layer = ColumnParallelLinear(128, 12, bias=False, quant_config=single_scheme_config(W4A16Scheme(64, False)),
                                 prefix="model.layers.0.self_attn.k_proj")
    with mocked_gpu(monkeypatch, 90):
        assert choice(layer)[0] == "cublade-w4a16-gemm"
    with mocked_gpu(monkeypatch, 86):
        assert choice(layer)[0] == "cublade-w4a16-gemm-sm80"
    with mocked_gpu(monkeypatch, 86, extension=False):
        with pytest.raises(NotImplementedError, match=r"^model\.layers\.0\.self_attn\.k_proj: no kernel can run .* "
                                                      r"\[N=12, K=128, torch\.bfloat16\]: .*vllm-marlin: zero points "
                                                      r"pack 8 per int32 along N; N=12; cublade-w4a16-gemm-sm80: cublade\._C_sm80 is "
                                                      r"not installed .*; reference: fp32 reference"):
            kernels.select_kernel(layer, "model.layers.0.self_attn.k_proj")


@pytest.mark.parametrize("strategy,N,K", [("channel", 200, 136), ("tensor", 256, 128)])
def test_fp8_marlin_prepares_weight_and_scales(vllm_ctx, monkeypatch, strategy, N, K):
    """vllm-marlin-fp8's one-time preparation, on CPU with vLLM's repack op recorded instead of run: the e4m3 weight
    zero-padded to the smaller of Marlin's tile families (N % 64 with K % 128, or N % 128 with K % 64) and packed
    4 codes per int32 along K; the scales per channel (a per-tensor scale repeated), padded, in Marlin's order, times
    the exponent bias and rounded once (fp8_w8a16_scale); the static input scale dropped."""
    import vllm._custom_ops as vllm_ops
    from vllm.model_executor.layers.quantization.utils import marlin_utils as mu

    from cublade.numerics.linear import fp8_w8a16_scale
    from cublade.vllm.kernels import VllmMarlinFp8

    scheme = Fp8Scheme(strategy, "static-tensor")
    g = torch.Generator().manual_seed(0)
    t = scheme.quantize(torch.randn(N, K, generator=g) * torch.linspace(0.05, 1.0, N).unsqueeze(1))
    layer = torch.nn.Module()
    for name, v in {**t, "input_scale": torch.tensor([0.01])}.items():
        layer.register_parameter(name, torch.nn.Parameter(v, requires_grad=False))
    layer.output_size_per_partition, layer.input_size_per_partition = N, K
    layer.params_dtype, layer.cublade_scheme = torch.bfloat16, scheme
    calls = []

    def repack(b_q_weight, perm, size_k, size_n, num_bits):
        calls.append((b_q_weight, size_k, size_n, num_bits))
        return torch.zeros(size_k // 16, size_n * 16 // 4, dtype=torch.int32)

    monkeypatch.setattr(vllm_ops, "gptq_marlin_repack", repack)
    monkeypatch.setattr(mu, "marlin_make_workspace_new", lambda device, max_blocks_per_sm=1: torch.zeros(1))
    VllmMarlinFp8(layer)
    pN, pK = mu.marlin_padded_nk(N, K)
    assert (pN % 64, pK % 128) == (0, 0) or (pN % 128, pK % 64) == (0, 0)
    (q, size_k, size_n, bits), = calls
    assert (size_k, size_n, bits) == (pK, pN, 8) and q.shape == (pK // 4, pN)
    codes = q.t().contiguous().view(torch.uint8).reshape(pN, pK)  # back to [N, K] bytes
    assert torch.equal(codes[:N, :K], t["weight"].view(torch.uint8))
    assert not codes[N:].any() and not codes[:, K:].any()
    scale = fp8_w8a16_scale(t["weight_scale"], N, torch.bfloat16)
    want = mu.marlin_permute_scales(torch.nn.functional.pad(scale.reshape(1, N), (0, pN - N)), pK, pN, -1)
    assert layer.weight_scale.dtype == torch.bfloat16 and layer.weight_scale.shape == (1, pN)
    assert torch.equal(layer.weight_scale, want)
    assert not hasattr(layer, "input_scale")


@pytest.mark.parametrize("activations", ["dynamic-token", "static-tensor"])
def test_fp8_activation_quant_per_gpu(vllm_ctx, monkeypatch, activations):
    """CUTLASS FP8 runs from sm_89; the activations are quantized by cublade's op on sm_90 (the arch cublade._C is
    built for) and by vLLM's scaled_fp8_quant on sm_89, never by the PyTorch reference on a GPU."""
    from cublade.vllm.kernels.vllm_cutlass_scaled_mm import input_quant_choice

    scheme = Fp8Scheme("channel" if activations == "dynamic-token" else "tensor", activations)
    layer = loaded_layer(scheme, KINDS["qkv"], monkeypatch)
    op = "fp8_quant_per_token" if activations == "dynamic-token" else "fp8_quant_per_tensor"
    assert input_quant_choice(scheme, layer.weight.device) == (
        "reference", f"activations by the PyTorch reference of {op} (CPU)")  # no GPU: the reference
    for cap, want in ((89, f"activations by vLLM's scaled_fp8_quant ({op}: cublade's kernels are built for sm_90a"),
                      (90, f"activations by cublade's {op}")):
        with mocked_gpu(monkeypatch, cap):
            got, reason, _ = choice(layer)
            words = input_quant_choice(scheme, layer.weight.device)[1]
        assert got == "vllm-cutlass-scaled-mm" and words.startswith(want) and words in reason, (cap, reason)
