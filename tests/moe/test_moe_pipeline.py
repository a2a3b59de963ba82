"""The MoE fixture through the whole CPU pipeline: `cublade convert` (per-expert and fused 3-D sources, router
refusal, bad expert tensors), the reference backend (cublade.reference / cublade.ppl, fp32), and the whole
converted checkpoint loaded by vLLM's own model loader (get_model) with cublade's config, run layer by layer
against the reference backend."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cublade.config import preset
from cublade.convert import convert
from cublade.ppl import evaluate
from vllm_model import load_vllm, vllm_logits

LINES = slice(0, 6)  # 6 lines of the validation text: 4 windows of 512 tokens


@pytest.fixture(scope="module")
def dense_loss(padded_model_dir, valid_text):
    return evaluate(padded_model_dir, valid_text, "reference", lines=LINES).loss


@pytest.mark.parametrize("layout", ["mixtral", "fused"])
def test_reference_backend_exact_moe_equals_dense(moe_fixture, valid_text, dense_loss, layout):
    r = evaluate(moe_fixture("exact", layout), valid_text, "reference", lines=LINES)
    print(f"\nreference backend fp32, {layout} layout: dense {dense_loss:.6f}, MoE {r.loss:.6f} "
          f"(|d| {abs(r.loss - dense_loss):.1e}, {r.n_tokens} tokens)")
    assert abs(r.loss - dense_loss) <= 1e-4


def test_fused_source_converts_to_the_per_expert_checkpoint(converted, moe_fixture):
    """Converting the fused 3-D fixture gives, tensor for tensor, the checkpoint of the per-expert fixture."""
    a = converted("fp4-experts-fp8-dense", src=moe_fixture("exact", "mixtral"))
    b = converted("fp4-experts-fp8-dense", src=moe_fixture("exact", "fused"))
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert set(ta) == set(tb)
    assert "model.layers.0.block_sparse_moe.experts.7.w2.weight_packed" in ta
    assert "model.layers.0.block_sparse_moe.gate.weight" in ta  # router kept, unquantized
    assert ta["model.layers.0.block_sparse_moe.gate.weight"].dtype == torch.float32
    assert ta["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn  # dense layers FP8
    for k in ta:
        assert torch.equal(ta[k].view(torch.uint8) if ta[k].element_size() == 1 else ta[k],
                           tb[k].view(torch.uint8) if tb[k].element_size() == 1 else tb[k]), k


def test_router_quantization_refused_unless_asked(moe_fixture, tmp_path):
    from cublade.config import MXFP8Scheme, Policy, Rule
    from cublade.config.policy import EXPERT_PATTERN

    src = moe_fixture("exact", "mixtral")
    base = preset("fp4-experts-fp8-dense")
    # The router (8 x 128: too few rows for FP8 GEMM alignment) in MXFP8, the rest as the preset says.
    quantizes_router = Policy(preset="router-too", schemes=base.schemes + (("mxfp8", MXFP8Scheme()),),
                              rules=(Rule(EXPERT_PATTERN, "fp4"), Rule(r".*\.gate", "mxfp8"), Rule(".*", "fp8")),
                              ignore=(r".*embed_tokens", r"(.*\.)?lm_head"))
    with pytest.raises(ValueError, match=r"quantizes the MoE router model\.layers\.0\.block_sparse_moe\.gate "
                                         r"\(scheme mxfp8\).*allow_quantized_router"):
        convert(src, tmp_path / "refused", quantizes_router, progress=False)
    assert not (tmp_path / "refused").exists()
    # A rule that spares layer 0's router but not the others is refused too, naming the first one it quantizes.
    later_routers = Policy(preset="later-routers", schemes=quantizes_router.schemes, rules=quantizes_router.rules,
                           ignore=quantizes_router.ignore + (r"model\.layers\.0\.block_sparse_moe\.gate",))
    with pytest.raises(ValueError, match=r"quantizes the MoE router model\.layers\.1\.block_sparse_moe\.gate "):
        convert(src, tmp_path / "refused", later_routers, progress=False)
    assert not (tmp_path / "refused").exists()
    out = convert(src, tmp_path / "asked", quantizes_router, allow_quantized_router=True, progress=False)
    assert "model.layers.0.block_sparse_moe.gate.weight_scale" in load_file(str(out / "model.safetensors"))


def _edited_copy(src, dst, edit):
    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    edit(t)
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("layout, edit, match", [
    ("fused", lambda t: t.update({"model.layers.2.mlp.experts.down_proj":
                                  t["model.layers.2.mlp.experts.down_proj"][:7]}),
     r"model\.layers\.2\.mlp\.experts\.down_proj: 7 experts, but config\.json says 8"),
    ("mixtral", lambda t: t.pop("model.layers.1.block_sparse_moe.experts.5.w3.weight"),
     r"model\.layers\.1\.block_sparse_moe\.experts\.5\.w3\.weight: missing from the checkpoint"),
    ("mixtral", lambda t: t.update({"model.layers.1.block_sparse_moe.experts.8.w3.weight": torch.zeros(256, 128)}),
     r"experts\.8\.w3\.weight: expert id 8, but config\.json says 8 experts"),
    ("mixtral", lambda t: t.update({"model.layers.0.block_sparse_moe.experts.3.w1.weight": torch.zeros(128, 128)}),
     r"experts\.3\.w1\.weight: shape \[128, 128\], expected \[256, 128\]"),
])
def test_convert_refuses_bad_expert_tensors(moe_fixture, tmp_path, layout, edit, match):
    bad = _edited_copy(moe_fixture("exact", layout), tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=match):
        convert(bad, tmp_path / "out", preset("fp4-experts-fp8-dense"), progress=False)
    assert not (tmp_path / "out").exists()


def test_check_checkpoint_experts(converted, moe_fixture, tmp_path):
    """What a loader calls before trusting a converted checkpoint's experts (vLLM alone drops an extra expert
    and leaves a missing one's slice at zero)."""
    from cublade.vllm.moe import check_checkpoint_experts

    ckpt = converted("fp4-experts-fp8-dense", src=moe_fixture("exact", "mixtral"))
    check_checkpoint_experts(ckpt)
    extra = _edited_copy(ckpt, tmp_path / "extra", lambda t: t.update({
        "model.layers.1.block_sparse_moe.experts.8.w1.weight_packed": torch.zeros(256, 64, dtype=torch.uint8)}))
    with pytest.raises(ValueError, match=r"experts\.8\.w1\.weight_packed: expert id 8, but config\.json says 8"):
        check_checkpoint_experts(extra)
    # vLLM calls it through the quantization config before loading (its loader would drop expert 8 silently)
    from cublade.config import read_policy
    from cublade.vllm.config import CubladeConfig

    with pytest.raises(ValueError, match=r"experts\.8\.w1\.weight_packed: expert id 8"):
        CubladeConfig(read_policy(extra)).maybe_update_config(str(extra))
    CubladeConfig(read_policy(ckpt)).maybe_update_config(str(ckpt))
    missing = _edited_copy(ckpt, tmp_path / "missing", lambda t: t.pop(
        "model.layers.3.block_sparse_moe.experts.6.w2.weight_scale"))
    # the index still lists it: named as an index entry that no shard holds (cublade.checkpoint)
    with pytest.raises(ValueError, match=r"model\.layers\.3\.block_sparse_moe\.experts\.6\.w2\.weight_scale: "
                                         r"model\.safetensors\.index\.json puts it in model\.safetensors, which "
                                         r"does not hold it"):
        check_checkpoint_experts(missing)
    index = json.loads((missing / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.3.block_sparse_moe.experts.6.w2.weight_scale"]
    (missing / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model\.layers\.3\.block_sparse_moe\.experts\.6\.w2\.weight_scale: "
                                         r"missing from the checkpoint"):
        check_checkpoint_experts(missing)  # and without the index entry, the experts' own check names it


def test_reference_backend_refuses_bad_quantized_experts(converted, moe_fixture, tmp_path):
    from cublade.reference import load_reference_model

    ckpt = converted("fp4-experts-fp8-dense", src=moe_fixture("exact", "mixtral"))
    bad = _edited_copy(ckpt, tmp_path / "bad", lambda t: t.update({
        "model.layers.4.block_sparse_moe.experts.2.w2.weight_scale":
            t["model.layers.4.block_sparse_moe.experts.2.w2.weight_scale"][:, :4].contiguous()}))
    with pytest.raises(ValueError, match=r"model\.layers\.4\.block_sparse_moe\.experts\.2\.w2\.weight_scale: "
                                         r"expected shape \[128, 8\] torch\.uint8, found \[128, 4\]"):
        load_reference_model(bad)


@pytest.fixture(scope="module")
def unquantized_loss(moe_fixture, valid_text):
    cache: dict = {}

    def get(variant: str) -> float:
        if variant not in cache:
            cache[variant] = evaluate(moe_fixture(variant, "mixtral"), valid_text, "reference", lines=LOSS_LINES).loss
        return cache[variant]
    return get


LOSS_LINES = slice(0, 3)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_experts_fp8_dense_loss(converted, moe_fixture, valid_text, unquantized_loss, fmt):
    """Reported: the reference-backend loss of fp4-experts-fp8-dense on both fixtures (3 lines here; the
    whole-text numbers come from `cublade ppl`). Loose sanity bars (a real 4-bit model): the numbers are the
    point."""
    rows = []
    for variant in ("exact", "perturbed"):
        base = unquantized_loss(variant)
        q = evaluate(converted("fp4-experts-fp8-dense", src=moe_fixture(variant, "mixtral"), format=fmt),
                     valid_text, "reference", lines=LOSS_LINES).loss
        rows.append((variant, base, q))
        assert base < q < base + 0.25
    print("\n" + "\n".join(f"{fmt} {v}: fp32 MoE {b:.4f} -> fp4-experts-fp8-dense {q:.4f} (+{q - b:.4f})"
                           for v, b, q in rows))


# --- whole model through vLLM on CPU -----------------------------------------------------------------------

def test_whole_model_in_vllm_matches_reference_backend(vllm_cpu, cpu_attention, converted, moe_fixture,
                                                       valid_text):
    from cublade.text import tokenize
    from cublade.reference import load_reference_model
    from cublade.vllm.linear import CubladeLinearMethod
    from cublade.vllm.moe import CubladeFp4MoEMethod
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    ckpt = converted("fp4-experts-fp8-dense", src=moe_fixture("perturbed", "mixtral"))
    model, _ = load_vllm(ckpt)
    for layer in model.model.layers:
        assert isinstance(layer.block_sparse_moe.experts.routed_experts.quant_method, CubladeFp4MoEMethod)
        assert isinstance(layer.block_sparse_moe.gate.quant_method, UnquantizedLinearMethod)  # router
        assert isinstance(layer.self_attn.qkv_proj.quant_method, CubladeLinearMethod)
    ref, _ = load_reference_model(ckpt)
    ids = torch.tensor(tokenize(ckpt, valid_text, slice(0, 2))[:256])
    a = vllm_logits(model, ids)
    with torch.inference_mode():
        b = ref(ids[None]).logits[0]
    ce = lambda z: torch.nn.functional.cross_entropy(z[:-1].float(), ids[1:]).item()  # noqa: E731
    rel = ((a - b).abs().mean() / b.abs().mean()).item()
    print(f"\nvLLM (CPU, cublade methods) loss {ce(a):.5f}, reference backend {ce(b):.5f}, logits mean rel diff "
          f"{rel:.1e}")
    # Same ops in both stacks, different float op order (an FP8 activation rounding can flip now and then).
    assert abs(ce(a) - ce(b)) < 2e-3
    assert rel < 1e-2
