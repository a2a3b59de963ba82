"""The `cublade` QuantizationConfig: reads a checkpoint's quantization_config into a cublade Policy and hands
each vLLM layer the method for its scheme.

Checkpoints it reads:
  * cublade's own (`"quant_method": "cublade"`, cublade.config.format): selected with no flag;
  * compressed-tensors FP8 W8A8 (float-quantized: channel/tensor weight scales; dynamic per-token, dynamic
    per-tensor or static per-tensor activations) and W4A16 (pack-quantized int4, group 32/64/128 or
    channel, symmetric or asymmetric), served by the same methods when `--quantization cublade` is given.
    Their config is translated into an equivalent Policy and their tensor layouts described by
    cublade.config.compressed_tensors; cublade.vllm.linear loads them as compressed-tensors writes them and
    brings them to cublade's layout after loading.

The layer methods (cublade.vllm.linear, .kv_cache, .moe) take what they need from here as arguments and
import nothing of this module.
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from cublade.config import QUANT_METHOD, Policy, Scheme, parse_quantization_config
from cublade.config.compressed_tensors import CT_METHOD, KV_CACHE_ARGS, policy_from_compressed_tensors
from cublade.config.format import QuantMethod

# Fused vLLM modules and the checkpoint modules they hold, for models that do not declare their own
# packed_modules_mapping (vLLM's model loader sets it on the config for those that do).
DEFAULT_PACKED_MODULES = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


class CubladeConfig(QuantizationConfig):
    """A cublade Policy as a vLLM QuantizationConfig. Pickles (vLLM ships it to the engine process): its
    state is the Policy (frozen dataclasses), the source format and plain dicts."""

    def __init__(self, policy: Policy, source: QuantMethod | str = QuantMethod.CUBLADE):
        super().__init__()
        self.policy = policy
        self.source = QuantMethod.lookup(source, "checkpoint source format", "cublade")
        # Read by vLLM's Attention layer: a declared KV-cache scheme makes `--kv-cache-dtype auto` mean fp8,
        # so the cache dtype follows the checkpoint (an explicit --kv-cache-dtype still wins).
        self.kv_cache_scheme = dict(KV_CACHE_ARGS) if policy.kv_cache is not None else None

    def __repr__(self) -> str:
        return f"CubladeConfig(source={self.source.value!r}, preset={self.policy.preset!r})"

    # ---- what vLLM asks of every QuantizationConfig --------------------------------------------------
    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        # fp32 runs through the reference kernels (the CPU tests, and fp32 scoring on a GPU, which asks for them
        # with CUBLADE_ALLOW_REFERENCE=1).
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        # Every scheme has a tensor-core path from Ampere on (cublade's kernels on sm_90, vLLM's Marlin / CUTLASS
        # elsewhere: fp8 runs W8A16 on Marlin where FP8 tensor cores are missing, before sm_89); the per-layer
        # kernel selector says which kernel each layer gets on the GPU at hand.
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
            return cls(parse_quantization_config(config), QuantMethod.CUBLADE)
        if method == CT_METHOD:
            return cls(policy_from_compressed_tensors(config), QuantMethod.COMPRESSED_TENSORS)
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
            from cublade.vllm.moe import check_checkpoint_experts

            check_checkpoint_experts(model_name)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, LinearBase):
            scheme = self.scheme_for_layer(prefix)
            if scheme is None:
                return UnquantizedLinearMethod()
            from cublade.vllm.linear import CubladeLinearMethod

            return CubladeLinearMethod(scheme, prefix, self.shard_names(prefix), self.source)
        if isinstance(layer, ParallelLMHead):  # quantized only where the checkpoint's policy says so
            scheme = self.policy.scheme_for(prefix)
            if scheme is None:
                return None  # vLLM's unquantized lm_head
            from cublade.vllm.linear import CubladeLMHeadMethod

            return CubladeLMHeadMethod(scheme, prefix, [prefix], self.source)
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
