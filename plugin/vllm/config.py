"""The `cublade` QuantizationConfig: reads a checkpoint's quantization_config into a cublade Policy and hands
each vLLM layer the method for its scheme.

Checkpoints it reads:
  * cublade's own (`"quant_method": "cublade"`, cublade.config.format): selected with no flag;
  * compressed-tensors FP8 W8A8 (float-quantized: channel/tensor weight scales; dynamic per-token, dynamic
    per-tensor or static per-tensor activations) and W4A16 (pack-quantized int4, group 32/64/128 or
    channel, symmetric or asymmetric), served by the same methods when `--quantization cublade` is given.
    Their config is translated into an equivalent Policy; the tensor layouts that differ (an [N, 1] FP8
    channel scale, int4 zero points packed 8 per int32 along N) are read as compressed-tensors writes them
    and brought to cublade's layout after loading (cublade.vllm.linear).
"""
from __future__ import annotations

import re
from typing import Any

import torch
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from cublade.config import (QUANT_METHOD, Fp8Scheme, KVCacheScheme, Policy, Rule, Scheme, W4A16Scheme,
                            parse_quantization_config)

CT_METHOD = "compressed-tensors"
SOURCES = (QUANT_METHOD, CT_METHOD)

# Fused vLLM modules and the checkpoint modules they hold, for models that do not declare their own
# packed_modules_mapping (vLLM's model loader sets it on the config for those that do).
DEFAULT_PACKED_MODULES = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


class CubladeConfig(QuantizationConfig):
    """A cublade Policy as a vLLM QuantizationConfig. Pickles (vLLM ships it to the engine process): its
    state is the Policy (frozen dataclasses), the source format name and plain dicts."""

    def __init__(self, policy: Policy, source: str = QUANT_METHOD):
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"cublade: unknown checkpoint source format {source!r}; valid: {', '.join(SOURCES)}")
        self.policy = policy
        self.source = source
        # Read by vLLM's Attention layer: a declared KV-cache scheme makes `--kv-cache-dtype auto` mean fp8,
        # so the cache dtype follows the checkpoint (an explicit --kv-cache-dtype still wins).
        self.kv_cache_scheme = ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                 "symmetric": True} if policy.kv_cache is not None else None)

    def __repr__(self) -> str:
        return f"CubladeConfig(source={self.source!r}, preset={self.policy.preset!r})"

    # ---- what vLLM asks of every QuantizationConfig --------------------------------------------------
    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        # fp32 runs through the reference kernels (the CPU tests, and fp32 scoring on a GPU).
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        # Every scheme has a path from Ampere on (reference kernels, Marlin); the per-layer kernel selector
        # says which kernel each layer gets on the GPU at hand (FP8 tensor cores need sm_89+).
        return 80

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # the quantization_config lives in config.json

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CubladeConfig:
        if not isinstance(config, dict):
            raise ValueError(f"cublade: quantization_config must be a JSON object, got {type(config).__name__}")
        method = config.get("quant_method")
        if method == QUANT_METHOD:
            return cls(parse_quantization_config(config), QUANT_METHOD)
        if method == CT_METHOD:
            return cls(policy_from_compressed_tensors(config), CT_METHOD)
        raise ValueError(f"cublade cannot read a checkpoint with quantization_config.quant_method={method!r}; "
                         f"it reads {QUANT_METHOD!r} checkpoints (written by `cublade convert`) and "
                         f"{CT_METHOD!r} FP8 W8A8 and int4 W4A16 checkpoints")

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        """Claim a compressed-tensors checkpoint when the user asked for `--quantization cublade`, or say
        clearly why not. Returns None otherwise, leaving every other method to vLLM."""
        if user_quant != QUANT_METHOD:
            return None
        method = hf_quant_cfg.get("quant_method") if isinstance(hf_quant_cfg, dict) else None
        if method == QUANT_METHOD:
            return QUANT_METHOD
        if method == CT_METHOD:
            try:
                policy_from_compressed_tensors(hf_quant_cfg)
            except (ValueError, NotImplementedError) as e:
                raise ValueError(f"--quantization cublade: this compressed-tensors checkpoint is not one cublade "
                                 f"serves: {e}") from None
            return QUANT_METHOD
        raise ValueError(f"--quantization cublade: the checkpoint is quantized with {method!r}, which cublade does "
                         f"not read; cublade serves {QUANT_METHOD!r} checkpoints and {CT_METHOD!r} FP8 W8A8 / "
                         f"int4 W4A16 ones. Drop --quantization to use vLLM's {method!r} method")

    def maybe_update_config(self, model_name: str, hf_config=None, revision: str | None = None) -> None:
        """Check a local MoE checkpoint's expert tensors against its config.json before loading: vLLM's FusedMoE
        loader maps expert ids 0..E-1 only and would drop an extra expert without a word."""
        from pathlib import Path

        if Path(model_name).is_dir():
            from cublade.experts import check_checkpoint_experts

            check_checkpoint_experts(model_name)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, LinearBase):
            scheme = self.scheme_for_layer(prefix)
            if scheme is None:
                return UnquantizedLinearMethod()
            from cublade.vllm.linear import CubladeLinearMethod

            return CubladeLinearMethod(self, scheme, prefix)
        if isinstance(layer, Attention):
            if self.policy.kv_cache is None:
                return None
            from cublade.vllm.kv_cache import CubladeKVCacheMethod

            return CubladeKVCacheMethod(self, prefix)
        if isinstance(layer, RoutedExperts):
            return self._moe_method(layer, prefix)
        return None

    # ---- cublade's own ------------------------------------------------------------------------------
    def shard_names(self, prefix: str) -> list[str]:
        """Checkpoint module names a vLLM module holds: one for a plain layer, the packed ones for a fused
        layer (`...qkv_proj` -> `...q_proj`, `...k_proj`, `...v_proj`)."""
        parent, _, leaf = prefix.rpartition(".")
        mapping = self.packed_modules_mapping or DEFAULT_PACKED_MODULES
        if leaf in mapping:
            return [f"{parent}.{s}" if parent else s for s in mapping[leaf]]
        return [prefix]

    def scheme_for_layer(self, prefix: str) -> Scheme | None:
        """The policy's scheme for a vLLM layer; a fused layer's shards must all agree (vLLM runs the fused
        matrix as one GEMM, so it cannot mix schemes)."""
        names = self.shard_names(prefix)
        schemes = [self.policy.scheme_for(n) for n in names]
        if any(s != schemes[0] for s in schemes):
            detail = ", ".join(f"{n}: {s.describe() if s else 'unquantized'}" for n, s in zip(names, schemes))
            raise ValueError(f"cublade: fused layer {prefix} holds modules with different schemes ({detail}); "
                             f"vLLM runs them as one matrix, so the policy must give them one scheme")
        return schemes[0]

    def _moe_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """vLLM's RoutedExperts (prefix `...experts`): the MoE engineer's method for the experts' scheme
        (cublade.vllm.moe), or None (vLLM's unquantized experts) when the policy leaves them alone."""
        scheme = self.policy.scheme_for(f"{prefix}.0.w1")
        if scheme is None:
            return None
        from cublade.vllm.moe import CubladeFp4MoEMethod

        return CubladeFp4MoEMethod(scheme, layer.moe_config, prefix)


# ---- compressed-tensors interop ------------------------------------------------------------------------

def _ct_pattern(target: str, field: str) -> str:
    """A compressed-tensors target/ignore entry as a Policy regex (matched with re.fullmatch)."""
    if target == "Linear":
        return r".*"
    if target.startswith("re:"):
        # compressed-tensors matches `re:` targets with re.match (anchored at the start only).
        return f"(?:{target[3:]}).*"
    if re.fullmatch(r"[A-Z]\w*", target):
        raise NotImplementedError(f"compressed-tensors {field} {target!r}: cublade matches module names and "
                                  f"the class 'Linear' only")
    return rf"(?:.*\.)?{re.escape(target)}"  # a module name, possibly without the model's prefix


def _ct_scheme(name: str, group: dict, fmt: str | None) -> Scheme:
    where = f"compressed-tensors config_groups.{name}"
    w = group.get("weights") or {}
    a = group.get("input_activations")
    fmt = group.get("format") or fmt
    if (group.get("output_activations")) is not None:
        raise NotImplementedError(f"{where}.output_activations: output quantization is not supported by cublade")
    wtype, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    if not w.get("symmetric", True) and wtype == "float":
        raise NotImplementedError(f"{where}.weights.symmetric=false: cublade's FP8 weights are symmetric")
    if wtype == "float" and bits == 8:
        if strategy not in ("channel", "tensor"):
            raise NotImplementedError(f"{where}.weights.strategy={strategy!r}: cublade FP8 weights are per "
                                      f"channel or per tensor (not block/group)")
        if a is None:
            raise NotImplementedError(f"{where}.input_activations is null (FP8 weight-only W8A16): cublade's fp8 "
                                      f"scheme quantizes activations too")
        if a.get("type") != "float" or a.get("num_bits") != 8:
            raise NotImplementedError(f"{where}.input_activations: expected 8-bit float, got "
                                      f"type={a.get('type')!r} num_bits={a.get('num_bits')!r}")
        a_strategy, dynamic = a.get("strategy"), a.get("dynamic")
        modes = {("token", True): "dynamic-token", ("tensor", True): "dynamic-tensor",
                 ("tensor", False): "static-tensor"}
        if (a_strategy, dynamic) not in modes:
            raise NotImplementedError(f"{where}.input_activations: strategy={a_strategy!r} dynamic={dynamic!r} "
                                      f"is not one of cublade's FP8 activation modes (token+dynamic, tensor+dynamic, "
                                      f"tensor+static)")
        if fmt not in (None, "float-quantized", "naive-quantized"):
            raise NotImplementedError(f"{where}: FP8 weights in format {fmt!r}; cublade reads 'float-quantized'")
        return Fp8Scheme(weight_strategy=strategy, activations=modes[(a_strategy, dynamic)])
    if wtype == "int" and bits == 4:
        if a is not None:
            raise NotImplementedError(f"{where}.input_activations: int4 weights with quantized activations "
                                      f"(W4A8) are not supported; cublade serves W4A16")
        if fmt not in (None, "pack-quantized"):
            raise NotImplementedError(f"{where}: int4 weights in format {fmt!r}; cublade reads 'pack-quantized'")
        if w.get("actorder") == "group":
            raise NotImplementedError(f"{where}.weights.actorder='group' (a g_idx per layer) is not supported; "
                                      f"'weight' (static) act-order is")
        if strategy == "channel":
            group_size = -1
        elif strategy == "group":
            group_size = w.get("group_size")
        else:
            raise NotImplementedError(f"{where}.weights.strategy={strategy!r}: cublade int4 weights are per group "
                                      f"or per channel")
        try:
            return W4A16Scheme(group_size=group_size, symmetric=bool(w.get("symmetric", True)))
        except ValueError as e:
            raise NotImplementedError(f"{where}.weights: {e}") from None
    raise NotImplementedError(f"{where}.weights: type={wtype!r} num_bits={bits!r} is not a cublade scheme "
                              f"(cublade reads 8-bit float W8A8 and 4-bit int W4A16)")


def policy_from_compressed_tensors(qc: dict) -> Policy:
    """The cublade Policy equivalent to a compressed-tensors quantization_config."""
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    if qc.get("sparsity_config"):
        raise NotImplementedError("compressed-tensors sparsity_config: sparse checkpoints are not supported")
    if qc.get("transform_config"):
        raise NotImplementedError("compressed-tensors transform_config: transformed checkpoints are not supported")
    schemes, rules = [], []
    for name, group in groups.items():
        schemes.append((name, _ct_scheme(name, group, qc.get("format"))))
        targets = group.get("targets") or []
        if not targets:
            raise ValueError(f"compressed-tensors config_groups.{name}.targets is empty")
        rules += [Rule(_ct_pattern(t, f"config_groups.{name}.targets"), name) for t in targets]
    ignore = tuple(_ct_pattern(t, "ignore") for t in qc.get("ignore") or [])
    kv = qc.get("kv_cache_scheme")
    if kv is not None:
        if not (kv.get("type") == "float" and kv.get("num_bits") == 8 and kv.get("strategy", "tensor") == "tensor"
                and not kv.get("dynamic", False)):
            raise NotImplementedError(f"compressed-tensors kv_cache_scheme {kv}: cublade's KV cache is FP8 with "
                                      f"static per-tensor scales")
    # compressed-tensors lets a module match any group whose target fits; cublade rules are ordered, first
    # match wins. Module-name targets go before the catch-all 'Linear' so the specific group wins.
    rules.sort(key=lambda r: r.pattern == r".*")
    return Policy(preset=CT_METHOD, schemes=tuple(schemes), rules=tuple(rules), ignore=ignore,
                  kv_cache=KVCacheScheme("fp8") if kv is not None else None)
