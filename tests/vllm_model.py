"""Whole checkpoints loaded by vLLM's own model loader (get_model) on CPU, and run layer by layer.

vLLM's attention needs its GPU backends and forward context, so `vllm_logits` runs vLLM's modules (embedding,
RMSNorms, rotary embedding, SiluAndMul, every linear and FusedMoE through its quant method) and puts torch SDPA
where vLLM's attention kernel would be. Used by tests/vllm (dense Llama) and tests/moe (Mixtral); the
`cpu_attention` fixture in tests/conftest.py must be active while a model is built. Also the CPU VllmConfig
and the process-group rendezvous the CPU tests and their tensor-parallel workers use.
"""
from __future__ import annotations

from pathlib import Path

import torch


def cpu_vllm_config():
    """vLLM's config for a CPU process (a bare VllmConfig() cannot infer the device)."""
    from vllm.config import DeviceConfig, VllmConfig

    return VllmConfig(device_config=DeviceConfig(device="cpu"))


def dist_init_method(directory) -> str:
    """torch.distributed rendezvous through a file in `directory` (new per process group): no TCP port to pick,
    so no other socket can take it between the pick and the store's bind."""
    return f"file://{Path(directory) / 'dist-store'}"


def load_vllm(ckpt, dtype: str = "float32", **model_config_kw):
    """(model, vllm_config) for the checkpoint at `ckpt`, built and loaded by vLLM on CPU."""
    import cublade.vllm
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    cublade.vllm.register()
    mc = ModelConfig(model=str(ckpt), skip_tokenizer_init=True, dtype=dtype, **model_config_kw)
    vc = VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"), load_config=LoadConfig())
    old = torch.get_default_dtype()
    try:
        with set_current_vllm_config(vc):
            return get_model(vllm_config=vc), vc
    finally:
        torch.set_default_dtype(old)


def fp8_round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x through the FP8 KV cache: quantized with the layer's scale (cublade's reference op), dequantized."""
    from cublade.ops.fp8_kv_cache_write import fp8_kv_quant_ref

    return (fp8_kv_quant_ref(x, scale).float() * scale).to(x.dtype)


def _attention(a, x: torch.Tensor, pos: torch.Tensor, kv_fp8: bool) -> torch.Tensor:
    T = x.shape[0]
    qkv, _ = a.qkv_proj(x)
    q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
    q, k = a.rotary_emb.forward_native(pos, q, k)
    if kv_fp8:  # with the scales vLLM's attention layer ended up with, as its cache write would use them
        k, v = fp8_round(k, a.attn._k_scale), fp8_round(v, a.attn._v_scale)
    heads = lambda t, n: t.reshape(T, n, a.head_dim).transpose(0, 1)  # noqa: E731
    o = torch.nn.functional.scaled_dot_product_attention(
        heads(q, a.num_heads), heads(k, a.num_kv_heads), heads(v, a.num_kv_heads), is_causal=True,
        scale=a.scaling, enable_gqa=True)
    o, _ = a.o_proj(o.transpose(0, 1).reshape(T, -1))
    return o


def _mixtral_moe(moe, x: torch.Tensor) -> torch.Tensor:
    """vLLM's router linear, Mixtral's routing (softmax, top-2, renormalize) in PyTorch, then the experts'
    quant method's apply(): the call vLLM's MoE runner makes."""
    logits, _ = moe.gate(x)
    w, top = torch.topk(torch.softmax(logits.float(), -1), 2, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    experts = moe.experts.routed_experts
    return experts.quant_method.apply(experts, x, w, top.to(torch.int32), None, None)


def _dense_mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    gu, _ = mlp.gate_up_proj(x)
    d, _ = mlp.down_proj(mlp.act_fn.forward_native(gu))
    return d


@torch.inference_mode()
def vllm_logits(model, ids: torch.Tensor, kv_fp8: bool = False) -> torch.Tensor:
    """Logits [T, vocab] of a Llama (dense MLP) or Mixtral (block_sparse_moe) model for one sequence."""
    m = model.model
    pos = torch.arange(ids.shape[0])
    h = m.embed_tokens(ids)
    for layer in m.layers:
        h = h + _attention(layer.self_attn, layer.input_layernorm.forward_native(h), pos, kv_fp8)
        x = layer.post_attention_layernorm.forward_native(h)
        h = h + (_mixtral_moe(layer.block_sparse_moe, x) if hasattr(layer, "block_sparse_moe")
                 else _dense_mlp(layer.mlp, x))
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    h, head = m.norm.forward_native(h), model.lm_head
    if not isinstance(head.quant_method, UnquantizedEmbeddingMethod):  # as vLLM's LogitsProcessor calls it
        return head.quant_method.apply(head, h)[:, :head.org_vocab_size]
    return h @ head.weight.t()
