"""Synthetic Hugging Face checkpoints for converter tests."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
                "intermediate_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16,
                "vocab_size": 512, "torch_dtype": "float32", "tie_word_embeddings": True}


def write_checkpoint(out: Path, shards: list[dict[str, torch.Tensor]], config: dict | None = None) -> Path:
    """A checkpoint directory with one safetensors file per dict (and an index when there are several)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config or LLAMA_CONFIG))
    (out / "tokenizer_config.json").write_text("{}")
    weight_map = {}
    for i, tensors in enumerate(shards, 1):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(out / name))
        weight_map.update({k: name for k in tensors})
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def synthetic_llama(out: Path, n_shards: int, layers_per_shard: int, hidden: int, seed: int = 0) -> Path:
    """Linear layers only (plus norms): [hidden, hidden] q/o and [2*hidden, hidden] up, fp32."""
    g = torch.Generator().manual_seed(seed)
    shards = []
    for s in range(n_shards):
        t = {}
        for j in range(layers_per_shard):
            p = f"model.layers.{s * layers_per_shard + j}"
            t[f"{p}.self_attn.q_proj.weight"] = torch.randn(hidden, hidden, generator=g) * 0.02
            t[f"{p}.self_attn.o_proj.weight"] = torch.randn(hidden, hidden, generator=g) * 0.02
            t[f"{p}.mlp.up_proj.weight"] = torch.randn(2 * hidden, hidden, generator=g) * 0.02
            t[f"{p}.input_layernorm.weight"] = torch.ones(hidden)
        shards.append(t)
    return write_checkpoint(out, shards)
