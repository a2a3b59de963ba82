"""cublade's linear method inside real vLLM layers (QKVParallelLinear, MergedColumnParallelLinear,
RowParallelLinear) on CPU: create_weights, loading through vLLM's loaders, process_weights_after_loading,
apply().

Tolerance classes:
  * vs the reference quantized linear (scheme.linear_ref of each checkpoint module, concatenated): bit-exact
    (torch.equal). On CPU the layer runs the reference kernel, i.e. the same ops on the same tensors; any
    difference means a tensor was loaded, placed or reconciled wrongly.
  * vs the unquantized layer (fp32 weights, the same bf16 input): mean |y - y_fp| / mean |y_fp| under a bound
    per scheme, from the format's rounding error with margin. E4M3 keeps 3 mantissa bits: relative step 2^-3,
    RMS error ~2^-3/sqrt(12) = 3.6% per operand. int4 RTN on Gaussian rows: step = amax/7 ~ 0.4 sigma for
    groups of 128-256, RMS error step/sqrt(12) ~ 12% of sigma. MXFP8: E4M3 steps under power-of-two block
    scales, ~3%. Measured on these weights (tests/vllm/vllm_layers.random_weights, qkv/gate_up/down):
    fp8 0.035-0.040, w4a16 0.083-0.131, mxfp8 0.025-0.031; bounds 0.06 / 0.2 / 0.05.
"""
from __future__ import annotations

import pytest
import torch
from accuracy import rel_err
from vllm_layers import KINDS, lm_head, load, random_weights, reference, single_scheme_config

from cublade.config import Fp8Scheme, MXFP8Scheme, W4A16Scheme

SCHEMES = [
    Fp8Scheme("channel", "dynamic-token"), Fp8Scheme("tensor", "dynamic-token"),
    Fp8Scheme("channel", "dynamic-tensor"), Fp8Scheme("tensor", "static-tensor"),
    Fp8Scheme("channel", "static-tensor"),
    W4A16Scheme(32, True), W4A16Scheme(64, False), W4A16Scheme(128, True), W4A16Scheme(128, False),
    W4A16Scheme(-1, True), W4A16Scheme(-1, False),
    MXFP8Scheme("rceil"), MXFP8Scheme("floor"),
]
TOLERANCE = {"fp8": 0.06, "w4a16": 0.2, "mxfp8": 0.05}


def quantized(scheme, weights, x):
    """module -> the scheme's checkpoint tensors (plus a static input scale from x's abs-max)."""
    out = {m: scheme.quantize(w) for m, w in weights.items()}
    if getattr(scheme, "static", False):
        s = (x.float().abs().amax() / 448.0).reshape(1)
        for t in out.values():
            t["input_scale"] = s.clone()
    return out


def build_and_load(scheme, kind, tensors, **kw):
    cfg = single_scheme_config(scheme)
    layer = kind.build(cfg)
    load(layer, kind, tensors, **kw)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("kind", list(KINDS.values()), ids=list(KINDS))
@pytest.mark.parametrize("scheme", SCHEMES, ids=[s.describe() for s in SCHEMES])
def test_layer_matches_reference(vllm_ctx, scheme, kind):
    from cublade.vllm.linear import CubladeLinearMethod

    x = torch.randn(5, kind.K, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    weights = random_weights(kind)
    tensors = quantized(scheme, weights, x)
    cfg = single_scheme_config(scheme)
    layer = kind.build(cfg)
    assert isinstance(layer.quant_method, CubladeLinearMethod)
    # create_weights: the scheme's tensors, as vLLM parameters of the fused shape
    N = sum(rows for _, _, rows in kind.shards)
    for suffix, (shape, dtype) in scheme.tensor_specs(N, kind.K).items():
        p = getattr(layer, suffix)
        assert p.dtype == dtype, suffix
        if suffix not in ("weight_scale", "input_scale") or len(shape) == 2 or shape == (N,):
            assert tuple(p.shape) == shape, suffix
    load(layer, kind, tensors)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.quant_method.kernel.name == "reference"

    y, _ = layer(x)
    ref = reference(scheme, kind, tensors, x)
    assert y.dtype == torch.bfloat16 and y.shape == (5, N)
    assert torch.equal(y, ref)
    fp = torch.cat([x.float() @ weights[m].t() for _, m, _ in kind.shards], dim=-1)
    assert rel_err(y, fp) < TOLERANCE[scheme.kind]


def test_fused_per_tensor_scales_are_reconciled_exactly(vllm_ctx):
    """q/k/v with different per-tensor weight scales run as one GEMM with each shard's own scale."""
    scheme, kind = Fp8Scheme("tensor", "dynamic-token"), KINDS["qkv"]
    weights = random_weights(kind)
    weights[kind.shards[1][1]] *= 7.0  # k_proj: a much larger scale than q and v
    x = torch.randn(4, kind.K, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    tensors = quantized(scheme, weights, x)
    scales = [tensors[m]["weight_scale"].item() for _, m, _ in kind.shards]
    assert len(set(scales)) == 3
    layer = build_and_load(scheme, kind, tensors)
    # one scale per output channel, each shard's own; the fp8 weights untouched (no requantization)
    expect = torch.cat([tensors[m]["weight_scale"].expand(rows) for _, m, rows in kind.shards])
    assert torch.equal(layer.weight_scale, expect)
    assert torch.equal(layer.weight.view(torch.uint8),
                       torch.cat([tensors[m]["weight"] for _, m, _ in kind.shards]).view(torch.uint8))
    assert torch.equal(layer(x)[0], reference(scheme, kind, tensors, x))


def test_equal_per_tensor_scales_stay_one_scalar(vllm_ctx):
    scheme, kind = Fp8Scheme("tensor", "dynamic-token"), KINDS["gate_up"]
    x = torch.randn(2, kind.K, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    tensors = quantized(scheme, random_weights(kind), x)
    same = tensors[kind.shards[0][1]]["weight_scale"]
    for _, m, _ in kind.shards:
        tensors[m]["weight_scale"] = same.clone()
    layer = build_and_load(scheme, kind, tensors)
    assert layer.weight_scale.shape == (1,) and torch.equal(layer.weight_scale, same)


def test_static_input_scales_of_fused_shards_take_the_max(vllm_ctx):
    scheme, kind = Fp8Scheme("channel", "static-tensor"), KINDS["qkv"]
    x = torch.randn(3, kind.K, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    tensors = quantized(scheme, random_weights(kind), x)
    for i, (_, m, _) in enumerate(kind.shards):
        tensors[m]["input_scale"] = tensors[m]["input_scale"] * (1 + i)
    layer = build_and_load(scheme, kind, tensors)
    top = tensors[kind.shards[-1][1]]["input_scale"]
    assert torch.equal(layer.input_scale, top)
    for _, m, _ in kind.shards:
        tensors[m]["input_scale"] = top
    assert torch.equal(layer(x)[0], reference(scheme, kind, tensors, x))


# ---- bad checkpoints: errors name the tensor ---------------------------------------------------------

def test_missing_scale_tensor_names_it(vllm_ctx):
    scheme, kind = Fp8Scheme(), KINDS["qkv"]
    tensors = quantized(scheme, random_weights(kind), None)
    cfg = single_scheme_config(scheme)
    layer = kind.build(cfg)
    load(layer, kind, tensors, skip={"model.layers.0.self_attn.k_proj.weight_scale"})
    with pytest.raises(ValueError, match=r"checkpoint has no model\.layers\.0\.self_attn\.k_proj\.weight_scale"):
        layer.quant_method.process_weights_after_loading(layer)


def test_missing_zero_point_of_asymmetric_w4a16_names_it(vllm_ctx):
    scheme, kind = W4A16Scheme(128, False), KINDS["down"]
    tensors = quantized(scheme, random_weights(kind), None)
    layer = kind.build(single_scheme_config(scheme))
    load(layer, kind, tensors, skip={"model.layers.0.mlp.down_proj.weight_zero_point"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight_zero_point"):
        layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("scheme,suffix,bad,match", [
    (Fp8Scheme(), "weight_scale", lambda t: t[:-1], r"up_proj\.weight_scale: shape \[255\] .* expects \[256\]"),
    (W4A16Scheme(64), "weight_scale", lambda t: t[:, :1], r"up_proj\.weight_scale: shape \[256, 1\] .* expects "
                                                          r"\[256, 2\]"),
    (MXFP8Scheme(), "weight_scale", lambda t: t.t(), r"up_proj\.weight_scale: shape \[4, 256\]"),
    (Fp8Scheme(), "weight", lambda t: t.to(torch.bfloat16), r"up_proj\.weight: dtype torch\.bfloat16 .*"
                                                            r"float8_e4m3fn \(an unquantized checkpoint\?\)"),
    (W4A16Scheme(), "weight_scale", lambda t: t.float(), r"up_proj\.weight_scale: dtype torch\.float32"),
], ids=["fp8-scale-shape", "w4a16-groups", "mxfp8-transposed", "fp8-unquantized-weight", "w4a16-scale-dtype"])
def test_wrong_tensor_is_refused_naming_it(vllm_ctx, scheme, suffix, bad, match):
    kind = KINDS["gate_up"]
    tensors = quantized(scheme, random_weights(kind), None)
    up = "model.layers.0.mlp.up_proj"
    tensors[up][suffix] = bad(tensors[up][suffix])
    layer = kind.build(single_scheme_config(scheme))
    with pytest.raises(ValueError, match=match):
        load(layer, kind, tensors)


def test_w4a16_group_that_does_not_divide_k_is_refused(vllm_ctx):
    from vllm.model_executor.layers.linear import RowParallelLinear

    cfg = single_scheme_config(W4A16Scheme(128))
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.mlp\.down_proj: K=192 breaks a rule of scheme "
                                         r"w4a16\(group_size=128, symmetric=True\): in_features per rank must be a "
                                         r"multiple of the group size 128"):
        RowParallelLinear(192, 128, bias=False, quant_config=cfg, prefix="model.layers.0.mlp.down_proj")


def test_layers_the_policy_ignores_stay_unquantized(vllm_ctx):
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from cublade.config import preset, to_quantization_config
    from cublade.vllm.config import CubladeConfig

    cfg = CubladeConfig.from_config(to_quantization_config(
        preset("fp8-dynamic").with_ignore(r"model\.layers\.0\.mlp\..*")))
    assert isinstance(KINDS["gate_up"].build(cfg).quant_method, UnquantizedLinearMethod)
    assert KINDS["down"].build(cfg).weight.dtype == torch.bfloat16
    assert KINDS["qkv"].build(cfg).weight.dtype == torch.float8_e4m3fn


def test_kernel_choice_is_logged_once_per_distinct_choice(vllm_ctx, caplog):
    from cublade.vllm import kernels

    kernels._logged.clear()
    scheme = MXFP8Scheme()
    with caplog.at_level("INFO", logger="vllm.cublade"):
        for kind in (KINDS["gate_up"], KINDS["gate_up"]):
            build_and_load(scheme, kind, quantized(scheme, random_weights(kind), None))
    lines = [r.getMessage() for r in caplog.records if "run on" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "mxfp8(scale_rule=rceil)" in lines[0] and "run on reference" in lines[0]
    assert ("passed over cublade-mxfp8-measured: runs when asked for (CUBLADE_MXFP8_PREFILL=humming); "
            "cublade-mxfp8-gemm: needs a CUDA device; vllm-marlin-mxfp8: needs a CUDA device; "
            "cublade-mxfp8-gemm-sm80: needs a CUDA device; cublade-mxfp8-dequant-matmul: needs a CUDA device" in lines[0])


def test_kernel_choice_enters_the_compile_cache_key(vllm_ctx):
    """vLLM keys its cache of compiled models by VllmConfig.compute_hash() (plus env and sources): the kernels cublade
    chose while loading must change it, else a model compiled with one kernel is loaded for another."""
    from vllm.config import get_current_vllm_config

    from cublade.vllm.kernels import add_to_compile_key

    config = get_current_vllm_config()
    before = config.compute_hash()
    scheme = MXFP8Scheme()
    build_and_load(scheme, KINDS["gate_up"], quantized(scheme, random_weights(KINDS["gate_up"]), None))
    assert config.additional_config["cublade_kernels"] == ["reference"]
    with_reference = config.compute_hash()
    assert with_reference != before
    add_to_compile_key("vllm-marlin-mxfp8")
    add_to_compile_key("reference")  # once each
    assert config.additional_config["cublade_kernels"] == ["reference", "vllm-marlin-mxfp8"]
    assert config.compute_hash() != with_reference


def test_disabled_kernels_env_and_no_kernel_error(vllm_ctx, monkeypatch):
    monkeypatch.setenv("CUBLADE_DISABLED_KERNELS", "reference")
    scheme, kind = Fp8Scheme(), KINDS["down"]
    layer = kind.build(single_scheme_config(scheme))
    load(layer, kind, quantized(scheme, random_weights(kind), None))
    with pytest.raises(NotImplementedError, match=r"down_proj: no kernel can run scheme fp8.*"
                                                  r"vllm-cutlass-scaled-mm: needs a CUDA device; "
                                                  r"vllm-marlin-fp8: needs a CUDA device; "
                                                  r"cublade-fp8-w8a16: needs a CUDA device; "
                                                  r"reference: disabled by CUBLADE_DISABLED_KERNELS"):
        layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("scheme", [Fp8Scheme(), Fp8Scheme("tensor", "static-tensor"), W4A16Scheme(64, False),
                                    MXFP8Scheme()], ids=lambda s: s.describe())
def test_layer_traces_under_torch_compile_fullgraph(vllm_ctx, scheme):
    """vLLM compiles models with fullgraph=True: apply() must trace without a graph break (Dynamo only here,
    backend 'eager'; the CUDA kernels' own tracing is checked on the GPU by tests/gpu/test_serve.py)."""
    kind = KINDS["qkv"]
    x = torch.randn(3, kind.K, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    tensors = quantized(scheme, random_weights(kind), x)
    layer = build_and_load(scheme, kind, tensors)
    compiled = torch.compile(lambda t: layer(t)[0], fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), reference(scheme, kind, tensors, x))


@pytest.mark.parametrize("scheme", [W4A16Scheme(128, True), W4A16Scheme(32, False), W4A16Scheme(-1, False)],
                         ids=lambda s: s.describe())
@pytest.mark.parametrize("kind", [KINDS["qkv"], KINDS["down"]], ids=["qkv", "down"])
def test_cublade_w4a16_kernel_path_with_its_reference_op(vllm_ctx, monkeypatch, scheme, kind):
    """The cublade-w4a16-gemm kernel's repack and call, run on CPU through the op's reference (on a GPU it
    is chosen by itself; here can_implement is forced): same numbers as the checkpoint's reference linear
    up to fp32 summation order, rounded to bf16 (<= 1 bf16 ulp per output: 2^-7 relative at most)."""
    from cublade.vllm import kernels

    monkeypatch.setattr(kernels.CubladeW4A16Gemm, "can_implement", classmethod(lambda cls, layer: (True, "test")))
    x = torch.randn(5, kind.K, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    tensors = quantized(scheme, random_weights(kind), x)
    layer = build_and_load(scheme, kind, tensors)
    assert layer.quant_method.kernel.name == "cublade-w4a16-gemm"
    assert layer.weight_packed.dim() == 4 and not hasattr(layer, "weight_zero_point")  # the kernel's layout
    y, ref = layer(x)[0].float(), reference(scheme, kind, tensors, x).float()
    assert ((y - ref).abs() <= ref.abs() * 2**-7).all()


@pytest.mark.parametrize("scheme", [W4A16Scheme(128, True), W4A16Scheme(-1, False)], ids=lambda s: s.describe())
def test_w4a16_fp8_prefill_kernel_path(vllm_ctx, monkeypatch, scheme):
    """CUBLADE_W4A16_PREFILL=fp8 selects cublade-w4a16-fp8-prefill (forced here, where no GPU can run it): below its
    row threshold the layer computes what cublade-w4a16-gemm does, from it the FP8 path's reference."""
    from cublade.ops.w4a16_gemm_fp8 import w4a16_gemm_fp8_ref
    from cublade.vllm import kernels

    monkeypatch.setenv("CUBLADE_W4A16_PREFILL", "fp8")
    monkeypatch.setattr(kernels.CubladeW4A16Fp8Prefill, "can_implement",
                        classmethod(lambda cls, layer: (True, "test")))
    kind = KINDS["down"]
    x = torch.randn(5, kind.K, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    tensors = quantized(scheme, random_weights(kind), x)
    layer = build_and_load(scheme, kind, tensors)
    k = layer.quant_method.kernel
    assert k.name == "cublade-w4a16-fp8-prefill"
    for rows in (3, k.min_rows):
        x = torch.randn(rows, kind.K, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        want = w4a16_gemm_fp8_ref(x, layer.weight_packed, k.group_size, k.symmetric, k.size_n, k.min_rows)
        assert torch.equal(layer(x)[0], want)


def test_w4a16_fp8_prefill_needs_asking_for(monkeypatch):
    from cublade.vllm.kernels.cublade_w4a16_fp8_prefill import CubladeW4A16Fp8Prefill

    monkeypatch.delenv("CUBLADE_W4A16_PREFILL", raising=False)
    ok, why = CubladeW4A16Fp8Prefill.can_implement(None)
    assert not ok and "CUBLADE_W4A16_PREFILL=fp8" in why
    monkeypatch.setenv("CUBLADE_W4A16_PREFILL", "fp4")
    with pytest.raises(ValueError, match=r"CUBLADE_W4A16_PREFILL='fp4': expected bf16 or fp8, or vLLM kernels"):
        CubladeW4A16Fp8Prefill.can_implement(None)


@pytest.mark.parametrize("activations", ["dynamic-token", "dynamic-tensor", "static-tensor"])
def test_fp8_fuse_quantizes_with_torch_ops_while_compiling(monkeypatch, activations):
    """CUBLADE_FP8_FUSE=1: while torch.compile traces, vllm-cutlass-scaled-mm quantizes with the reference's torch ops
    (which Inductor can fuse with the op before), never its CUDA op entry; eager calls keep the op entry. Same bytes
    on this CPU path."""
    from cublade.vllm.kernels.vllm_cutlass_scaled_mm import VllmCutlassScaledMM

    monkeypatch.setenv("CUBLADE_FP8_FUSE", "1")
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.zeros(16, 256, dtype=torch.float8_e4m3fn), requires_grad=False)
    layer.cublade_scheme = Fp8Scheme("channel" if activations == "dynamic-token" else "tensor", activations)
    k = VllmCutlassScaledMM(layer)
    op_calls = []
    entry = k.quant_input
    k.quant_input = lambda x, s: (op_calls.append(torch.compiler.is_compiling()), entry(x, s))[1]
    scale = torch.tensor([0.02])
    x = torch.randn(5, 256).to(torch.bfloat16)
    eager = k.quantize(x, scale)
    compiled = torch.compile(lambda t: k.quantize(t, scale), fullgraph=True, backend="eager")(x)
    assert op_calls == [False]  # the eager call only: the traced call took the torch ops
    for a, b in zip(eager, compiled):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    monkeypatch.setenv("CUBLADE_FP8_FUSE", "yes")
    with pytest.raises(ValueError, match=r"CUBLADE_FP8_FUSE='yes': expected 0 or 1"):
        VllmCutlassScaledMM(layer)


@pytest.mark.parametrize("scheme", [W4A16Scheme(128, True), W4A16Scheme(32, False), Fp8Scheme("channel",
                         "dynamic-token"), Fp8Scheme("tensor", "static-tensor"), MXFP8Scheme("rceil")],
                         ids=lambda s: s.describe())
def test_lm_head_with_vocabulary_padding(vllm_ctx, scheme):
    """A quantized lm_head in vLLM's ParallelLMHead: 200 vocabulary rows padded to 256 (vLLM pads to 64). The
    checkpoint's 200 rows load through vLLM's own vocabulary loader, the padding rows hold zeros, and the first 200
    logits equal the reference linear's bit for bit."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from cublade.vllm.linear import CubladeLMHeadMethod

    vocab, K = 200, 128
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    w = torch.randn(vocab, K, generator=torch.Generator().manual_seed(2)) * 0.05
    tensors = quantized(scheme, {"lm_head": w}, x)["lm_head"]
    head = lm_head(scheme, vocab, K, tensors)
    assert isinstance(head.quant_method, CubladeLMHeadMethod) and head.num_embeddings_padded == 256
    y = head.quant_method.apply(head, x)
    assert y.shape == (5, 256) and not y[:, vocab:].any()  # the padding rows: zero logits, dropped by vLLM
    assert torch.equal(y[:, :vocab], scheme.linear_ref(x, tensors))
    bad = {**tensors, "weight_scale": tensors["weight_scale"][:-1]}
    with pytest.raises(ValueError, match="lm_head.weight_scale: shape"):
        fresh = ParallelLMHead(vocab, K, params_dtype=torch.bfloat16, prefix="lm_head",
                               quant_config=single_scheme_config(scheme, lm_head=True))
        fresh.weight_scale.weight_loader(fresh.weight_scale, bad["weight_scale"])
