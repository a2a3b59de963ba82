"""Building and loading real vLLM linear layers with cublade's config, for the tests in this folder."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cublade.config import Policy, Rule, Scheme, to_quantization_config

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 128, 8, 4, 16, 256


@dataclass(frozen=True)
class LayerKind:
    name: str
    prefix: str
    K: int
    shards: tuple[tuple[object, str, int], ...]  # (vLLM shard id, checkpoint module, rows)

    def build(self, cfg):
        from vllm.model_executor.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                                       RowParallelLinear)
        if self.name == "qkv":
            return QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=False, quant_config=cfg,
                                     prefix=self.prefix)
        if self.name == "gate_up":
            return MergedColumnParallelLinear(HIDDEN, [MLP, MLP], bias=False, quant_config=cfg, prefix=self.prefix)
        return RowParallelLinear(MLP, HIDDEN, bias=False, quant_config=cfg, prefix=self.prefix)


L0 = "model.layers.0"
KINDS = {
    "qkv": LayerKind("qkv", f"{L0}.self_attn.qkv_proj", HIDDEN,
                     (("q", f"{L0}.self_attn.q_proj", HEADS * HEAD_DIM),
                      ("k", f"{L0}.self_attn.k_proj", KV_HEADS * HEAD_DIM),
                      ("v", f"{L0}.self_attn.v_proj", KV_HEADS * HEAD_DIM))),
    "gate_up": LayerKind("gate_up", f"{L0}.mlp.gate_up_proj", HIDDEN,
                         ((0, f"{L0}.mlp.gate_proj", MLP), (1, f"{L0}.mlp.up_proj", MLP))),
    "down": LayerKind("down", f"{L0}.mlp.down_proj", MLP, ((None, f"{L0}.mlp.down_proj", HIDDEN),)),
}


def single_scheme_config(scheme: Scheme, source_qc: dict | None = None, lm_head: bool = False):
    """vLLM's config object for a checkpoint with one scheme on every layer (and on lm_head with lm_head=True)."""
    from cublade.vllm.config import CubladeConfig

    policy = Policy(preset="test", schemes=(("s", scheme),), rules=(Rule(r".*", "s"),))
    qc = source_qc or to_quantization_config(policy.with_lm_head() if lm_head else policy)
    return CubladeConfig.from_config(qc)


def random_weights(kind: LayerKind, seed: int = 0) -> dict[str, torch.Tensor]:
    """module -> fp32 [rows, K] weight; rows of different scale so per-channel scales matter."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for _, module, rows in kind.shards:
        w = torch.randn(rows, kind.K, generator=g, dtype=torch.float32) * 0.05
        out[module] = w * torch.linspace(0.2, 2.0, rows, dtype=torch.float32).unsqueeze(1)
    return out


def load(layer, kind: LayerKind, tensors: dict[str, dict[str, torch.Tensor]], skip: set[str] = frozenset()) -> None:
    """Load module -> {suffix: tensor} through each parameter's vLLM weight loader, as a model's load_weights
    does (fused shards with their shard id). `skip`: '<module>.<suffix>' names left out."""
    for shard_id, module, _ in kind.shards:
        for suffix, t in tensors[module].items():
            if f"{module}.{suffix}" in skip:
                continue
            param = getattr(layer, suffix)
            if shard_id is None:
                param.weight_loader(param, t)
            else:
                param.weight_loader(param, t, shard_id)


def lm_head(scheme: Scheme, vocab: int, K: int, tensors: dict[str, torch.Tensor]):
    """vLLM's ParallelLMHead of `vocab` rows (padded to 64) with the scheme on lm_head, its checkpoint tensors loaded
    through vLLM's vocabulary loader and processed."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    head = ParallelLMHead(vocab, K, params_dtype=torch.bfloat16, prefix="lm_head",
                          quant_config=single_scheme_config(scheme, lm_head=True))
    for suffix, t in tensors.items():
        param = getattr(head, suffix)
        param.weight_loader(param, t)
    head.quant_method.process_weights_after_loading(head)
    return head


def reference(scheme: Scheme, kind: LayerKind, tensors, x: torch.Tensor) -> torch.Tensor:
    """What the layer must compute: each checkpoint module's reference linear, concatenated."""
    return torch.cat([scheme.linear_ref(x, tensors[module]) for _, module, _ in kind.shards], dim=-1)
