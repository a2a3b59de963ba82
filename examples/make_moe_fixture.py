#!/usr/bin/env python3
"""Build a Mixtral-architecture MoE checkpoint from a real dense Llama checkpoint (no trained tiny MoE exists).

    python examples/make_moe_fixture.py OUT [--src DENSE_DIR] [--variant exact|perturbed] [--layout mixtral|fused]

Every layer's dense MLP (gate_proj, up_proj, down_proj) becomes E experts (default 8, top-2, renormalized
routing). Expert e of layer l is the dense MLP with its intermediate neurons permuted by a fixed permutation
pi_{l,e}: gate and up rows permuted, down columns permuted. Then

    expert_e(x) = W2[:, pi] (silu(W1[pi] x) * (W3[pi] x)) = W2 (silu(W1 x) * (W3 x)) = mlp(x)

for every e, and the renormalized top-k weights sum to 1, so the MoE model computes the dense model (its loss
equals the dense loss up to fp32 summation order), whatever the router says — while every expert's weights
differ: a mix-up of experts, of rows within an expert, of w1/w3, or of scales between experts breaks it.

Variants:
  exact      the construction above, with a random (seeded) router so tokens spread over all experts.
  perturbed  each expert also gets a small independent perturbation (relative --noise, default 0.05, of the
             tensor's RMS) and the router is "trained-looking": its rows are the spherical k-means centroids
             of the real MLP inputs of that layer (collected by running the dense model on --calib-lines lines
             of --text), scaled so router logits have standard deviation --router-std across experts. Routing
             then matters (experts differ), and tokens cluster the way a trained router sends them.

Layouts:
  mixtral    per-expert tensors `model.layers.{l}.block_sparse_moe.experts.{e}.w1/w2/w3.weight` and the router
             `block_sparse_moe.gate.weight`: what vLLM's MixtralForCausalLM loads and Mixtral checkpoints ship.
  fused      3-D tensors `model.layers.{l}.mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and
             `mlp.experts.down_proj` [E, H, I], router `mlp.gate.weight`: the layout transformers 5 uses in
             memory, and that newer MoE checkpoints ship. (cublade convert splits it into the mixtral layout.)

Deterministic: everything derives from --seed (torch's CPU generator); the same inputs and torch version give
the same bytes. Runs in seconds on a CPU. A `moe_fixture.json` beside the weights records how it was built.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SRC = REPO / "fixtures" / "models" / "stories260K-padded-hf"
DEFAULT_TEXT = REPO / "fixtures" / "data" / "tinystories_valid_head30k.txt"
VARIANTS = ("exact", "perturbed")
LAYOUTS = ("mixtral", "fused")
# Files copied unchanged from the dense checkpoint (tokenizer and generation settings).
COPY_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json")


def _default_path(repo_path: Path, shared_rel: str) -> Path:
    """The bundled copy in the repository, else the shared one beside the checkout."""
    return repo_path if repo_path.exists() else (REPO / ".." / "shared" / shared_rel).resolve()


def _dense_weights(src: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg = json.loads((src / "config.json").read_text())
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{src}: no *.safetensors files")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    for l in range(cfg["num_hidden_layers"]):
        for p in ("gate_proj", "up_proj", "down_proj"):
            name = f"model.layers.{l}.mlp.{p}.weight"
            if name not in sd:
                raise ValueError(f"{src}: missing {name}; the source must be a dense Llama-style checkpoint "
                                 f"with gate_proj/up_proj/down_proj MLPs")
            if name.replace(".weight", ".bias") in sd:
                raise ValueError(f"{src}: {name} has a bias; MLP biases are not supported by this fixture")
    return cfg, sd


def mixtral_config(dense: dict, num_experts: int, top_k: int, dtype: str) -> dict:
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
            "hidden_act", "tie_word_embeddings", "bos_token_id", "eos_token_id", "initializer_range", "use_cache")
    cfg = {k: dense[k] for k in keep if k in dense}
    if dense.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={dense['hidden_act']!r}: Mixtral experts use silu")
    cfg.update({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": num_experts, "num_experts_per_tok": top_k,
                "router_aux_loss_coef": 0.0, "output_router_logits": False, "router_jitter_noise": 0.0,
                "sliding_window": None, "attention_dropout": 0.0, "torch_dtype": dtype})
    return dict(sorted(cfg.items()))


def _mlp_inputs(src: Path, text: Path, lines: int) -> list[torch.Tensor]:
    """The input of every layer's MLP (after post_attention_layernorm) over the first `lines` lines of text,
    from the dense model: [tokens, H] per layer."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(src))
    tok.model_max_length = 1 << 30  # lines are cut to the model's context below
    model = LlamaForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    captured: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, a, i=i: captured[i].append(a[0].reshape(-1, a[0].shape[-1])))
             for i, layer in enumerate(model.model.layers)]
    with open(text, encoding="utf-8") as f:
        texts = [ln.strip() for ln, _ in zip(f, range(lines)) if ln.strip()]
    with torch.no_grad():
        for t in texts:
            ids = tok(t, return_tensors="pt").input_ids[:, : model.config.max_position_embeddings]  # with BOS
            model(ids)
    for h in hooks:
        h.remove()
    return [torch.cat(c) for c in captured]


def _spherical_kmeans(x: torch.Tensor, k: int, gen: torch.Generator, iters: int = 25) -> torch.Tensor:
    """k unit centroids of the rows of x (cosine similarity), Lloyd iterations from a seeded k-means++ start."""
    xn = torch.nn.functional.normalize(x, dim=-1)
    first = int(torch.randint(len(xn), (1,), generator=gen))
    cents = [xn[first]]
    for _ in range(1, k):  # k-means++: next centroid far (in cosine) from the chosen ones
        d = 1 - (xn @ torch.stack(cents).t()).max(dim=1).values
        cents.append(xn[int(torch.multinomial(d.clamp_min(0) + 1e-12, 1, generator=gen))])
    c = torch.stack(cents)
    for _ in range(iters):
        assign = (xn @ c.t()).argmax(dim=1)
        for j in range(k):
            members = xn[assign == j]
            if len(members):
                c[j] = torch.nn.functional.normalize(members.sum(0), dim=0)
    return c


def build(src: Path, out: Path, *, variant: str = "exact", layout: str = "mixtral", num_experts: int = 8,
          top_k: int = 2, seed: int = 0, noise: float = 0.05, router_std: float = 2.0, text: Path | None = None,
          calib_lines: int = 200, overwrite: bool = False) -> Path:
    """Write the MoE checkpoint to `out` (see the module docstring); returns `out`."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r} is not one of {', '.join(VARIANTS)}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in 1..num_experts={num_experts}")
    src, out = Path(src), Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    dense, sd = _dense_weights(src)
    L, H, I = dense["num_hidden_layers"], dense["hidden_size"], dense["intermediate_size"]
    dtype = next(iter(sd.values())).dtype
    gen = torch.Generator().manual_seed(seed)

    mlp_inputs = None
    if variant == "perturbed":
        mlp_inputs = _mlp_inputs(src, Path(text or _default_path(DEFAULT_TEXT, "data/tinystories_valid_head30k.txt")),
                                 calib_lines)

    tensors: dict[str, torch.Tensor] = {k: v for k, v in sd.items() if ".mlp." not in k}
    perms: list[list[list[int]]] = []
    for l in range(L):
        w1, w3, w2 = (sd[f"model.layers.{l}.mlp.{p}.weight"].float() for p in ("gate_proj", "up_proj", "down_proj"))
        layer_perms, e1, e3, e2 = [], [], [], []
        for e in range(num_experts):
            pi = torch.randperm(I, generator=gen)
            layer_perms.append(pi.tolist())
            a, b, c = w1[pi], w3[pi], w2[:, pi]
            if variant == "perturbed":
                a, b, c = (t + noise * t.pow(2).mean().sqrt() * torch.randn(t.shape, generator=gen)
                           for t in (a, b, c))
            e1.append(a), e3.append(b), e2.append(c)
        perms.append(layer_perms)
        if variant == "perturbed":
            cents = _spherical_kmeans(mlp_inputs[l], num_experts, gen)
            logits = mlp_inputs[l] @ cents.t()
            router = cents * (router_std / logits.std(dim=1).mean())
        else:
            router = torch.randn(num_experts, H, generator=gen) * (router_std / H ** 0.5)
        if layout == "mixtral":
            pre = f"model.layers.{l}.block_sparse_moe"
            tensors[f"{pre}.gate.weight"] = router
            for e in range(num_experts):
                tensors[f"{pre}.experts.{e}.w1.weight"] = e1[e]
                tensors[f"{pre}.experts.{e}.w3.weight"] = e3[e]
                tensors[f"{pre}.experts.{e}.w2.weight"] = e2[e]
        else:
            pre = f"model.layers.{l}.mlp"
            tensors[f"{pre}.gate.weight"] = router
            tensors[f"{pre}.experts.gate_up_proj"] = torch.cat([torch.stack(e1), torch.stack(e3)], dim=1)
            tensors[f"{pre}.experts.down_proj"] = torch.stack(e2)
    tensors = {k: v.to(dtype).contiguous() for k, v in sorted(tensors.items())}

    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = mixtral_config(dense, num_experts, top_k, str(dtype).removeprefix("torch."))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in COPY_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    info = {"source": str(src), "variant": variant, "layout": layout, "num_experts": num_experts, "top_k": top_k,
            "seed": seed, "noise": noise if variant == "perturbed" else 0.0,
            "router": "spherical k-means of MLP inputs" if variant == "perturbed" else "gaussian",
            "router_std": router_std, "calib_lines": calib_lines if variant == "perturbed" else 0,
            "permutations": perms}
    (out / "moe_fixture.json").write_text(json.dumps(info) + "\n")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="output checkpoint directory")
    p.add_argument("--src", type=Path, default=None,
                   help="dense Llama checkpoint (default: the bundled stories260K-padded-hf)")
    p.add_argument("--variant", choices=VARIANTS, default="exact",
                   help="exact: experts = permuted dense MLP; perturbed: + per-expert noise and k-means router")
    p.add_argument("--layout", choices=LAYOUTS, default="mixtral",
                   help="mixtral: per-expert w1/w2/w3 tensors; fused: 3-D gate_up_proj/down_proj")
    p.add_argument("--experts", type=int, default=8, help="number of experts E (default 8)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--noise", type=float, default=0.05, help="perturbed: noise std relative to the tensor RMS")
    p.add_argument("--router-std", type=float, default=2.0, help="std of router logits across experts")
    p.add_argument("--text", type=Path, default=None, help="perturbed: text whose MLP inputs shape the router")
    p.add_argument("--calib-lines", type=int, default=200, help="perturbed: lines of --text to use")
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    src = a.src or _default_path(DEFAULT_SRC, "models/stories260K-padded-hf")
    out = build(src, a.out, variant=a.variant, layout=a.layout, num_experts=a.experts, top_k=a.top_k,
                seed=a.seed, noise=a.noise, router_std=a.router_std, text=a.text, calib_lines=a.calib_lines,
                overwrite=a.overwrite)
    print(f"wrote {out} ({a.variant}, {a.layout} layout, {a.experts} experts, top-{a.top_k})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
