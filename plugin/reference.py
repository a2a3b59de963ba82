"""The CPU reference backend: a transformers model whose quantized layers compute from the checkpoint's
quantized tensors through the reference ops (never through a dequantized copy written anywhere).

Every linear the checkpoint's policy quantized becomes a `QuantLinearRef`; with an FP8 KV cache
(`kv_cache: fp8` and per-layer k_scale / v_scale in the checkpoint), K (after RoPE) and V go through the
FP8 cache quantization before attention, as vLLM's cache write does (K query-aware when the checkpoint's
kv_cache asks for it: each token's key rounded against that token's queries, as cublade's cache write does).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from cublade.checkpoint import check_tensors, load_all
from cublade.config import KVRounding, Policy, Scheme, parse_quantization_config
from cublade.reference_experts import prepare_moe_reference
from cublade.ops.fp8_kv_cache_write import fp8_kv_quant_query_aware_ref, fp8_kv_quant_ref

FP8_KV_ATTENTION = "cublade_fp8_kv"


class QuantLinearRef(nn.Module):
    """y = scheme.linear_ref(x, tensors): the quantized tensors are buffers, used as stored."""

    def __init__(self, name: str, scheme: Scheme, in_features: int, out_features: int,
                 tensors: dict[str, torch.Tensor], bias: torch.Tensor | None):
        super().__init__()
        self.name, self.scheme = name, scheme
        self.in_features, self.out_features = in_features, out_features
        specs = scheme.tensor_specs(out_features, in_features)
        check_tensors(name, specs, tensors, f"scheme {scheme.kind}")
        self._suffixes = tuple(specs)
        for suffix in specs:
            self.register_buffer(suffix, tensors[suffix], persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scheme.linear_ref(x, {s: getattr(self, s) for s in self._suffixes}, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.scheme.describe()}"


def fp8_kv_round_key(query: torch.Tensor, key: torch.Tensor, k_scale: torch.Tensor,
                     rounding: KVRounding | str) -> torch.Tensor:
    """K in transformers' layout [B, kv heads, T, D] (after RoPE) through the FP8 cache and back, rounded as
    KVCacheScheme.rounding says (query-aware: each token's key against its queries, [B, heads, T, D])."""
    if KVRounding(rounding) is KVRounding.QUERY_AWARE:  # per token: [B, heads, T, D] -> [B * T, heads, D]
        B, G, T, D = key.shape
        k = fp8_kv_quant_query_aware_ref(key.transpose(1, 2).reshape(B * T, G, D),
                                         query.transpose(1, 2).reshape(B * T, -1, D), k_scale)
        k = k.reshape(B, T, G, D).transpose(1, 2)
    else:
        k = fp8_kv_quant_ref(key, k_scale)
    return (k.float() * k_scale).to(key.dtype)


def _fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA over K/V rounded through the FP8 cache (quantize with the layer's scale, dequantize)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    scales = getattr(module, "cublade_kv_scales", None)
    if scales is not None:
        k_scale, v_scale = scales
        key = fp8_kv_round_key(query, key, k_scale, module.cublade_kv_rounding)
        value = (fp8_kv_quant_ref(value, v_scale).float() * v_scale).to(value.dtype)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(FP8_KV_ATTENTION, _fp8_kv_attention)


def _split_tensors(tensors: dict[str, torch.Tensor], module: str, scheme: Scheme) -> dict[str, torch.Tensor]:
    return {s: tensors.pop(f"{module}.{s}") for s in list(scheme.tensor_specs(1, 1))
            if f"{module}.{s}" in tensors}


def load_reference_model(model_dir, dtype: torch.dtype = torch.float32, kv_cache_fp8: bool | None = None):
    """(model, policy) for a cublade checkpoint (or an unquantized one: policy None), on CPU, eval mode.

    kv_cache_fp8: None follows the checkpoint (FP8 KV when it has kv_cache fp8), False disables it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    cfg_dict = json.loads((model_dir / "config.json").read_text())
    qc = cfg_dict.pop("quantization_config", None)
    policy: Policy | None = parse_quantization_config(qc) if qc is not None else None
    use_kv = policy is not None and policy.kv_cache is not None and kv_cache_fp8 is not False
    if use_kv:
        _register_attention()
    config = AutoConfig.for_model(**cfg_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                             attn_implementation=FP8_KV_ATTENTION if use_kv else "sdpa")
    tensors = load_all(model_dir)

    if policy is not None:
        for name, mod in list(model.named_modules()):
            if not isinstance(mod, nn.Linear):
                continue
            scheme = policy.scheme_for(name)
            if scheme is None:
                continue
            parts = _split_tensors(tensors, name, scheme)
            bias = tensors.pop(f"{name}.bias", None)
            q = QuantLinearRef(name, scheme, mod.in_features, mod.out_features, parts,
                               None if bias is None else bias.to(dtype))
            model.set_submodule(name, q)
        if use_kv:
            _attach_kv_scales(model, tensors, policy.kv_cache.rounding)

    # MoE experts: quantized ones become QuantExpertsRef, per-expert unquantized ones are stacked
    # (cublade.reference_experts).
    prepare_moe_reference(model, tensors, policy, cfg_dict)
    # Everything else (embeddings, norms, ignored layers) loads as plain weights, cast to `dtype`.
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied]
    if missing:
        raise ValueError(f"{model_dir}: tensors missing from the checkpoint: {', '.join(missing[:8])}"
                         f"{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        raise ValueError(f"{model_dir}: tensors the model does not use: {', '.join(unexpected[:8])}"
                         f"{' ...' if len(unexpected) > 8 else ''}")
    if tied:
        model.tie_weights()
    return model.eval(), policy


def _attach_kv_scales(model: nn.Module, tensors: dict[str, torch.Tensor], rounding: KVRounding) -> None:
    """Move each `<attn>.k_scale` / `.v_scale` from the checkpoint onto its attention module, with the
    rounding of K (KVCacheScheme.rounding)."""
    found = 0
    for name, mod in model.named_modules():
        if hasattr(mod, "k_proj") and hasattr(mod, "v_proj"):
            try:
                k, v = tensors.pop(f"{name}.k_scale"), tensors.pop(f"{name}.v_scale")
            except KeyError as e:
                raise ValueError(f"kv_cache fp8: checkpoint has no {e.args[0]}") from None
            mod.cublade_kv_scales = (k.float(), v.float())
            mod.cublade_kv_rounding = rounding
            found += 1
    if not found:
        raise ValueError("kv_cache fp8: the model has no attention modules with k_proj/v_proj")
