"""MoE experts: the expert layouts and their checks against config.json (cublade.config.experts; errors name the
tensor), the fused 3-D split the converter uses and the router-policy refusal (cublade.convert_experts), and the
reference experts (cublade.reference_experts.QuantExpertsRef over cublade.numerics.moe)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from cublade.checkpoint import iter_tensors, tensor_infos
from cublade.config import Policy, Rule, preset
from cublade.config.experts import ExpertLayout
from cublade.config.schemes import FP4Scheme
from cublade.convert_experts import check_router_policy, expert_tensor_infos, expert_tensors
from cublade.numerics.moe import experts_forward_ref
from cublade.reference_experts import QuantExpertsRef, prepare_moe_reference

MIXTRAL = {"model_type": "mixtral", "num_local_experts": 8, "hidden_size": 128, "intermediate_size": 256,
           "num_experts_per_tok": 2}


@pytest.fixture
def layout():
    return ExpertLayout.from_config(MIXTRAL)


def test_layout_from_config(layout):
    assert (layout.num_experts, layout.hidden_size, layout.intermediate_size, layout.top_k) == (8, 128, 256, 2)
    assert layout.parse_expert("model.layers.3.block_sparse_moe.experts.5.w3.weight_scale") == \
        ("model.layers.3.block_sparse_moe.experts", 5, "up", "weight_scale")
    assert layout.parse_expert("model.layers.3.self_attn.q_proj.weight") is None
    assert ExpertLayout.from_config({"model_type": "llama", "hidden_size": 128}) is None
    qwen = ExpertLayout.from_config({"model_type": "qwen3_moe", "num_experts": 4, "hidden_size": 64,
                                     "moe_intermediate_size": 32, "num_experts_per_tok": 2})
    assert qwen.expert_name("model.layers.0.mlp.experts", 1, "down") == "model.layers.0.mlp.experts.1.down_proj"
    with pytest.raises(NotImplementedError, match="model_type='grok'"):
        ExpertLayout.from_config({"model_type": "grok", "num_experts": 8})
    with pytest.raises(ValueError, match="num_local_experts=None"):
        ExpertLayout.from_config({**MIXTRAL, "num_local_experts": None})


def test_fused_split_equals_per_expert_layout(moe_fixture):
    """The converter's view of the fused fixture (3-D gate_up_proj/down_proj) is, name for name and byte for
    byte, the per-expert fixture (router renamed to Mixtral's block_sparse_moe.gate too)."""
    fused, per_expert = moe_fixture("exact", "fused"), moe_fixture("exact", "mixtral")
    layout = ExpertLayout.from_config(json.loads((fused / "config.json").read_text()))
    want = load_file(str(per_expert / "model.safetensors"))
    infos = {n: (tuple(s), d) for _, n, s, d in expert_tensor_infos(tensor_infos(fused), layout)}
    got = dict(expert_tensors(iter_tensors(fused), layout))
    assert set(got) == set(want) == set(infos)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
        assert infos[name][0] == tuple(t.shape), name


def _infos(tensors: dict[str, tuple]):
    return [("model.safetensors", n, s, "F32") for n, s in tensors.items()]


def _per_expert_shapes(E=8, layers=1):
    shapes = {}
    for l in range(layers):
        for e in range(E):
            pre = f"model.layers.{l}.block_sparse_moe.experts.{e}"
            shapes.update({f"{pre}.w1.weight": (256, 128), f"{pre}.w3.weight": (256, 128),
                           f"{pre}.w2.weight": (128, 256)})
    return shapes


@pytest.mark.parametrize("edit, match", [
    (lambda s: s.update({"model.layers.0.block_sparse_moe.experts.8.w1.weight": (256, 128)}),
     r"experts\.8\.w1\.weight: expert id 8, but config.json says 8 experts"),
    (lambda s: s.pop("model.layers.0.block_sparse_moe.experts.7.w2.weight"),
     r"experts\.7\.w2\.weight: missing from the checkpoint"),
    (lambda s: s.update({"model.layers.0.block_sparse_moe.experts.2.w3.weight": (255, 128)}),
     r"experts\.2\.w3\.weight: shape \[255, 128\], expected \[256, 128\]"),
    (lambda s: s.update({"model.layers.0.mlp.experts.gate_up_proj": (7, 512, 128)}),
     r"mlp\.experts\.gate_up_proj: 7 experts, but config.json says 8"),
    (lambda s: s.update({"model.layers.0.mlp.experts.gate_up_proj": (8, 128, 512)}),
     r"gate_up_proj: shape \[8, 128, 512\] is the transposed fused layout"),
    (lambda s: s.update({"model.layers.0.mlp.experts.down_proj": (8, 128, 255)}),
     r"down_proj: shape \[8, 128, 255\], expected \[8, 128, 256\]"),
])
def test_bad_expert_tensors_are_named(layout, edit, match):
    shapes = _per_expert_shapes()
    edit(shapes)
    with pytest.raises(ValueError, match=match):
        list(expert_tensor_infos(_infos(shapes), layout))


def test_router_policy(layout):
    routers = [f"model.layers.{i}.block_sparse_moe.gate" for i in range(2)]
    check_router_policy(preset("fp4-experts-fp8-dense"), layout, False, routers)  # router ignored by default
    everything = Policy(preset="all-fp8", schemes=preset("fp8-dynamic").schemes, rules=(Rule(".*", "fp8"),),
                        ignore=(r".*embed_tokens", r"(.*\.)?lm_head"))
    with pytest.raises(ValueError, match=r"quantizes the MoE router model.layers.0.block_sparse_moe.gate "
                                         r"\(scheme fp8\).*allow_quantized_router"):
        check_router_policy(everything, layout, False, routers)
    with pytest.raises(ValueError, match=r"router model.layers.4.mlp.gate"):
        check_router_policy(everything, layout, False, ["model.layers.4.mlp.gate", "model.layers.4.x"])
    check_router_policy(everything, layout, True, routers)  # asked for
    check_router_policy(everything, None, False, routers)  # a dense model has no router


def _quant_block(scheme, layout, seed=0):
    """Random per-expert weights of one block and their scheme tensors, keyed (e, proj)."""
    g = torch.Generator().manual_seed(seed)
    w, t = {}, {}
    for e in range(layout.num_experts):
        for proj in ("gate", "up", "down"):
            w[(e, proj)] = torch.randn(layout.shape(proj), generator=g) * 0.05
            t[(e, proj)] = scheme.quantize(w[(e, proj)])
    return w, t


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_quant_experts_ref_matches_dequantized_moe(layout, fmt):
    """QuantExpertsRef (from the FP4 tensors) == an independent dense computation over every expert with the
    dequantized weights, gathered by the routing (fp32: same products, different order -> tight bound)."""
    scheme = FP4Scheme(format=fmt)
    _, t = _quant_block(scheme, layout)
    prefix = "model.layers.0.block_sparse_moe.experts"
    mod = QuantExpertsRef(prefix, layout, {k: scheme for k in t}, t)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 128, generator=g)
    logits = torch.randn(37, 8, generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    y = mod(x, ids, w)
    deq = {k: scheme.dequantize(v) for k, v in t.items()}
    all_e = torch.stack([F.linear(F.silu(x @ deq[(e, "gate")].t()) * (x @ deq[(e, "up")].t()), deq[(e, "down")])
                         for e in range(8)], dim=1)  # [T, E, H]
    want = (all_e.gather(1, ids[..., None].expand(-1, -1, 128)) * w[..., None]).sum(1)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    # expert-parallel ids (-1: expert on another rank) are skipped
    ids_ep = ids.clone()
    ids_ep[:, 1] = -1
    y_ep = experts_forward_ref(x, ids_ep, w, mod.expert_linear, 8)
    torch.testing.assert_close(y_ep, all_e.gather(1, ids[:, :1, None].expand(-1, -1, 128))[:, 0] * w[:, :1],
                               rtol=1e-5, atol=1e-6)


def test_quant_experts_ref_errors_name_the_tensor(layout):
    scheme = FP4Scheme()
    _, t = _quant_block(scheme, layout)
    prefix = "model.layers.0.block_sparse_moe.experts"
    bad = {k: dict(v) for k, v in t.items()}
    bad[(3, "up")]["weight_scale"] = bad[(3, "up")]["weight_scale"][:, :2]  # an NVFP4-like or wrong layout
    with pytest.raises(ValueError, match=r"experts\.3\.w3\.weight_scale: expected shape \[256, 4\] torch.uint8, "
                                         r"found \[256, 2\]"):
        QuantExpertsRef(prefix, layout, {k: scheme for k in t}, bad)
    bad = {k: dict(v) for k, v in t.items()}
    del bad[(6, "down")]["weight_packed"]
    with pytest.raises(ValueError, match=r"experts\.6\.w2\.weight_packed: missing from the checkpoint"):
        QuantExpertsRef(prefix, layout, {k: scheme for k in t}, bad)
    bad = {k: dict(v) for k, v in t.items()}
    bad[(0, "gate")]["weight_scale"] = bad[(0, "gate")]["weight_scale"].float()
    with pytest.raises(ValueError, match=r"experts\.0\.w1\.weight_scale: .*found \[256, 4\] torch.float32"):
        QuantExpertsRef(prefix, layout, {k: scheme for k in t}, bad)


def test_prepare_moe_reference(layout):
    """On a transformers Mixtral built from config: quantized per-expert tensors become a QuantExpertsRef,
    the router is renamed; an expert id beyond config.json is refused by name."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = {**MIXTRAL, "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16,
           "vocab_size": 64}
    model = MixtralForCausalLM(MixtralConfig(**cfg))
    policy = preset("fp4-experts-fp8-dense")
    scheme = policy.scheme_map["fp4"]
    _, t = _quant_block(scheme, layout)
    tensors = {f"{layout.expert_name('model.layers.0.block_sparse_moe.experts', e, p)}.{s}": v
               for (e, p), d in t.items() for s, v in d.items()}
    tensors["model.layers.0.block_sparse_moe.gate.weight"] = torch.randn(8, 128)
    extra = dict(tensors)
    assert prepare_moe_reference(model, tensors, policy, cfg) == 1
    assert isinstance(model.model.layers[0].mlp.experts, QuantExpertsRef)
    assert set(tensors) == {"model.layers.0.mlp.gate.weight"}
    extra["model.layers.0.block_sparse_moe.experts.9.w1.weight_packed"] = torch.zeros(256, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"experts\.9\.w1\.weight_packed: expert id 9, but config.json says 8"):
        prepare_moe_reference(MixtralForCausalLM(MixtralConfig(**cfg)), extra, policy, cfg)


@pytest.mark.parametrize("ep", [False, True])
def test_fp4_moe_sizes_its_passes_by_the_experts_rows_are_routed_over(monkeypatch, ep):
    """cublade-fp4-moe's two grouped GEMMs get the model's expert count as the experts the rows were routed over
    (max_m, twice the mean rows per expert, from it too): under expert parallelism this rank holds 4 of 8 experts
    but x carries every routed row, so dividing by the 4 would read twice the mean (a wider wgmma pass than the
    rows need). (fp4_gemm stood in for: it records its arguments; the routing and the combine run their
    references.)"""
    from cublade.vllm.kernels import cublade_fp4_moe as km

    E_local, H, I, T, k = 4, 64, 32, 64, 2
    calls = []

    def fp4_gemm(x, packed, row_scale, fmt, size_n, offsets, max_m, split_k, routed_experts):
        calls.append((max_m, split_k, routed_experts, int(offsets[-1])))
        return x.new_zeros((x.shape[0], size_n))

    monkeypatch.setattr(km, "fp4_gemm", fp4_gemm)
    layer = torch.nn.Module()
    layer.w13_fp4_packed = layer.w2_fp4_packed = torch.zeros(1)
    layer.global_num_experts = 8 if ep else E_local
    if ep:  # global ids 0-3 are this rank's, 4-7 another's
        layer.expert_map = torch.tensor([0, 1, 2, 3, -1, -1, -1, -1], dtype=torch.int32)
    kernel = object.__new__(km.CubladeFp4MoE)  # its repack needs FP4 weights; apply needs only these
    kernel.num_experts, kernel.I, kernel.H, kernel.fmt = E_local, I, H, "mxfp4"
    n = layer.global_num_experts
    ids = torch.stack([torch.arange(T) % n, (torch.arange(T) + 3) % n], dim=1)  # T k / n rows for every expert
    kernel.apply(layer, torch.randn(T, H).to(torch.bfloat16), torch.full((T, k), 0.5), ids)
    # EP: 16 rows for each of the 8 experts, 64 of them this rank's; else 32 for each of 4, all local
    want = (32, 0, 8, 64) if ep else (64, 0, 4, T * k)
    assert calls == [want, want]
