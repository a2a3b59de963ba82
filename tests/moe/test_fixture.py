"""The MoE fixture (examples/make_moe_fixture.py): built from the real dense model, its exact variant computes
the dense model (loss equal within 1e-4 in fp32), every expert's weights differ, and it is deterministic."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

N_LINES = 6  # text lines scored (4 windows of 512 tokens): enough to see any mix-up, seconds on CPU


def _loss(model_dir, ids: torch.Tensor, cls) -> float:
    model = cls.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids, labels=ids).loss.item()


@pytest.fixture(scope="module")
def ids(text_windows, padded_model_dir, valid_text):
    return text_windows(padded_model_dir, valid_text, N_LINES)


@pytest.fixture(scope="module")
def dense_loss(padded_model_dir, ids):
    from transformers import LlamaForCausalLM

    return _loss(padded_model_dir, ids, LlamaForCausalLM)


@pytest.mark.parametrize("layout", ["mixtral", "fused"])
def test_exact_moe_loss_equals_dense(moe_fixture, ids, dense_loss, layout):
    """transformers' MixtralForCausalLM on the exact fixture vs LlamaForCausalLM on the dense model, fp32."""
    from transformers import MixtralForCausalLM

    moe = _loss(moe_fixture("exact", layout), ids, MixtralForCausalLM)
    print(f"\n{layout}: dense loss {dense_loss:.6f}, MoE loss {moe:.6f}, |dloss| {abs(moe - dense_loss):.2e} "
          f"over {ids.numel()} tokens")
    assert abs(moe - dense_loss) <= 1e-4


def test_experts_are_permuted_dense_mlps(moe_fixture, padded_model_dir):
    d = moe_fixture("exact", "mixtral")
    sd, dense = load_file(str(d / "model.safetensors")), load_file(str(padded_model_dir / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    perms = json.loads((d / "moe_fixture.json").read_text())["permutations"]
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["num_local_experts"] == 8
    assert cfg["num_experts_per_tok"] == 2
    assert not any(".mlp." in k for k in sd)
    for l in range(cfg["num_hidden_layers"]):
        w1, w3, w2 = (dense[f"model.layers.{l}.mlp.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj"))
        seen = set()
        for e in range(8):
            pi = torch.tensor(perms[l][e])
            pre = f"model.layers.{l}.block_sparse_moe.experts.{e}"
            torch.testing.assert_close(sd[f"{pre}.w1.weight"], w1[pi], rtol=0, atol=0)
            torch.testing.assert_close(sd[f"{pre}.w3.weight"], w3[pi], rtol=0, atol=0)
            torch.testing.assert_close(sd[f"{pre}.w2.weight"], w2[:, pi], rtol=0, atol=0)
            seen.add(tuple(perms[l][e]))
        assert len(seen) == 8  # every expert's weights differ


def test_fused_layout_holds_the_same_experts(moe_fixture):
    a = load_file(str(moe_fixture("exact", "mixtral") / "model.safetensors"))
    b = load_file(str(moe_fixture("exact", "fused") / "model.safetensors"))
    I = 256
    for l in range(5):
        gu, down = b[f"model.layers.{l}.mlp.experts.gate_up_proj"], b[f"model.layers.{l}.mlp.experts.down_proj"]
        assert gu.shape == (8, 2 * I, 128) and down.shape == (8, 128, I)
        for e in range(8):
            pre = f"model.layers.{l}.block_sparse_moe.experts.{e}"
            assert torch.equal(gu[e, :I], a[f"{pre}.w1.weight"]) and torch.equal(gu[e, I:], a[f"{pre}.w3.weight"])
            assert torch.equal(down[e], a[f"{pre}.w2.weight"])
        assert torch.equal(b[f"model.layers.{l}.mlp.gate.weight"], a[f"model.layers.{l}.block_sparse_moe.gate.weight"])


def test_deterministic(fixture_builder, padded_model_dir, moe_fixture, tmp_path):
    again = fixture_builder.build(padded_model_dir, tmp_path / "again", variant="exact", layout="mixtral")
    first = moe_fixture("exact", "mixtral")
    assert (again / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()
    assert (again / "config.json").read_text() == (first / "config.json").read_text()


def test_perturbed_routing_is_exercised(moe_fixture, padded_model_dir, ids, dense_loss):
    """Perturbed experts differ, so the router's choice matters: the k-means router spreads tokens over every
    expert, and routing through another router changes the loss. Its loss is reported."""
    from transformers import MixtralForCausalLM

    d = moe_fixture("perturbed", "mixtral")
    model = MixtralForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    counts = torch.zeros(5, 8)

    def count(layer_idx):
        def hook(module, args, out):  # out = (logits, top-k weights, top-k ids)
            counts[layer_idx] += torch.bincount(out[2].flatten(), minlength=8).float()
        return hook

    hooks = [layer.mlp.gate.register_forward_hook(count(l)) for l, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    for h in hooks:
        h.remove()
    share = counts / counts.sum(dim=1, keepdim=True)
    print(f"\nperturbed MoE loss {loss:.6f} (dense {dense_loss:.6f}, +{loss - dense_loss:.4f}); expert share per "
          f"layer min {share.min():.3f} max {share.max():.3f}")
    assert share.min() > 0.02  # every expert of every layer gets tokens
    assert dense_loss < loss < dense_loss + 0.05
    with torch.no_grad():  # the same experts behind a shuffled router
        for layer in model.model.layers:
            layer.mlp.gate.weight.copy_(layer.mlp.gate.weight.roll(1, dims=0))
        shuffled = model(ids, labels=ids).loss.item()
    assert abs(shuffled - loss) > 1e-3
