"""FP8 KV cache: the checkpoint's per-layer k_scale / v_scale reach vLLM's attention layer, and (opt-in) the
cache write runs cublade's op.

Scales. A checkpoint with `kv_cache: fp8` stores `<attention module>.k_scale` / `.v_scale` (fp32 scalars,
e.g. `model.layers.0.self_attn.k_scale`). vLLM's loader maps them onto the Attention layer
(`...self_attn.attn.k_scale`, QuantizationConfig.get_cache_scale_mapper) and CubladeKVCacheMethod, vLLM's
BaseKVCacheMethod with two changes, takes them from there:
  * the scale parameters are fp32 (vLLM creates them in the model dtype, which would round a calibrated
    0.0123 to 0.0123291015625 under bf16 and quantize the cache differently from the reference backend);
  * a scale that never arrived is an error naming the checkpoint tensor (vLLM would fall back to 1.0 with a
    warning, silently wrong for a cache calibrated in cublade's format).
The cache dtype follows the checkpoint: CubladeConfig.kv_cache_scheme makes `--kv-cache-dtype auto` fp8.

The cache write. vLLM 0.26 has a registry for attention backends with one slot for third parties,
`AttentionBackendEnum.CUSTOM` (vllm.v1.attention.backends.registry.register_backend); a backend there is
picked with `--attention-backend CUSTOM`. cublade.vllm.register() puts CubladeFlashAttentionBackend in that
slot: vLLM's FlashAttention backend, unchanged but for the FP8 cache write, done by cublade's CUDA op
`fp8_kv_cache_write` instead of vLLM's `reshape_and_cache_flash` (vLLM's op still runs where cublade's
extension lacks the kernel). The backend writes the cache in its `forward` (forward_includes_kv_cache_update),
where the layer's query is at hand: a checkpoint whose kv_cache has `rounding: query-aware` has K rounded
against its token's queries (cublade.ops.fp8_kv_cache_write); with `rounding: nearest` the op writes the bytes
vLLM's op writes. Nothing in vLLM is patched; without the flag vLLM's own backend and cache write run (a
query-aware checkpoint is then rounded to nearest, with a warning). It cannot be made the default without the
flag: the backend is chosen from the attention config before any quantization config is consulted, and
overriding vLLM's FLASH_ATTN entry would change every model served in a process that has cublade installed.
"""
from __future__ import annotations

import logging
import math

import torch
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.utils.torch_utils import is_quantized_kv_cache

from cublade.config import KVRounding

logger = logging.getLogger("vllm.cublade")

SCALE_NAMES = ("q_scale", "k_scale", "v_scale", "prob_scale")


def kv_rounding(layer) -> KVRounding:
    """How the FP8 cache write rounds this Attention layer's K: what CubladeKVCacheMethod.create_weights set
    (`layer.cublade_kv_rounding`, the checkpoint's kv_cache rounding); NEAREST for a layer cublade's method did not
    create (e.g. `--kv-cache-dtype fp8` on a checkpoint without a cublade KV cache)."""
    return getattr(layer, "cublade_kv_rounding", KVRounding.NEAREST)


def checkpoint_module(prefix: str) -> str:
    """The checkpoint's attention module for vLLM's Attention layer: `...self_attn.attn` -> `...self_attn`."""
    return prefix[: -len(".attn")] if prefix.endswith(".attn") else prefix


class CubladeKVCacheMethod(BaseKVCacheMethod):
    _warned_rounding = False

    def __init__(self, quant_config, prefix: str = ""):
        super().__init__(quant_config)
        self.prefix = prefix
        kv = quant_config.policy.kv_cache
        self.rounding: KVRounding = kv.rounding if kv is not None else KVRounding.NEAREST

    def create_weights(self, layer: torch.nn.Module):
        super().create_weights(layer)
        for name in SCALE_NAMES:  # fp32, whatever the model dtype (see the module docstring)
            p = getattr(layer, name)
            p.data = p.data.float()
        layer.cublade_kv_rounding = self.rounding  # the one place it is set; read through kv_rounding(layer)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if (hasattr(layer, "k_scale") and is_quantized_kv_cache(layer.kv_cache_dtype)
                and not layer.calculate_kv_scales):
            for name in ("k_scale", "v_scale"):
                v = float(getattr(layer, name))
                if not (v > 0 and math.isfinite(v)):
                    what = "is missing from the checkpoint" if v == -1.0 else f"is {v}"
                    raise ValueError(f"{checkpoint_module(self.prefix)}.{name} {what}: the checkpoint's "
                                     f"quantization_config has kv_cache fp8, which needs a positive finite "
                                     f"per-layer {name} (cublade convert --kv-cache fp8 writes it)")
            if (self.rounding is KVRounding.QUERY_AWARE and not isinstance(getattr(layer, "impl", None),
                                                                  CubladeFlashAttentionImpl)
                    and not CubladeKVCacheMethod._warned_rounding):
                CubladeKVCacheMethod._warned_rounding = True
                logger.warning("cublade: the checkpoint's FP8 KV cache asks for query-aware K rounding, but the "
                               "attention backend is %s, whose cache write rounds to nearest (on the bundled "
                               "model +0.038 loss instead of +0.005); serve with --attention-backend CUSTOM for "
                               "cublade's cache write", type(getattr(layer, "impl", None)).__name__)
        super().process_weights_after_loading(layer)


def _flash_attention():
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

    return FlashAttentionBackend, FlashAttentionImpl


_FlashAttentionBackend, _FlashAttentionImpl = _flash_attention()


def _slot_mapping(layer) -> torch.Tensor | None:
    """The layer's slot mapping for this step, where vLLM's unified_kv_cache_update reads it."""
    from vllm.forward_context import get_forward_context

    return get_forward_context().slot_mapping.get(layer.layer_name)


class CubladeFlashAttentionImpl(_FlashAttentionImpl):
    """vLLM's FlashAttention, with the FP8 KV-cache write done by cublade.ops.fp8_kv_cache_write in forward."""

    _logged = False

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        # What vLLM's Attention.forward does before calling a backend without the update in forward: no write
        # for the profiling run, for a layer sharing an earlier layer's cache, or without K / V.
        if (attn_metadata is not None and key is not None and value is not None
                and getattr(layer, "kv_sharing_target_layer_name", None) is None):
            slot_mapping = _slot_mapping(layer)
            if slot_mapping is not None:
                self.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping, query=query)
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                               output_scale=output_scale, output_block_scale=output_block_scale)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping, query=None) -> None:
        """query: the layer's query for these tokens (FP8 when vLLM quantized it for FlashAttention 3), used
        when the layer's cache rounds K query-aware."""
        from vllm.v1.attention.backend import AttentionType

        from cublade.ops import fp8_kv_cache_write
        from cublade.ops._dispatch import use_kernel

        if self.kv_cache_dtype not in ("fp8", "fp8_e4m3") or self.attn_type in (AttentionType.ENCODER_ONLY,
                                                                                  AttentionType.ENCODER):
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        # On a GPU without cublade's kernel, vLLM's own write: the reference's boolean indexing syncs with
        # the host, which CUDA-graph capture forbids. (The reference runs here only on CPU, for tests.)
        cublade_kernel = use_kernel(key, "fp8_kv_cache_write")
        vllm_write = key.is_cuda and not cublade_kernel
        query_aware = kv_rounding(layer) is KVRounding.QUERY_AWARE and not vllm_write
        if not CubladeFlashAttentionImpl._logged:
            CubladeFlashAttentionImpl._logged = True
            how = ("cublade's CUDA op fp8_kv_cache_write" if cublade_kernel
                   else "vLLM's reshape_and_cache_flash (cublade's CUDA extension has no fp8_kv_cache_write)"
                   if vllm_write else "the PyTorch reference of fp8_kv_cache_write (CPU)")
            logger.info("cublade: FP8 KV-cache write runs %s, K rounded %s", how,
                        "query-aware" if query_aware else "to nearest")
        if vllm_write:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        # The same views of the cache as vLLM's FlashAttention backend: [num_blocks, H, block_size, 2*D]
        # -> K and V, each [num_blocks, block_size, H, D] (strided views; the op writes through them).
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        # key/value may be padded past the real tokens (CUDA graphs); slot_mapping is not.
        n = slot_mapping.shape[0]
        fp8_kv_cache_write(key[:n], value[:n], key_cache, value_cache, slot_mapping, layer._k_scale,
                           layer._v_scale, query=query[:n] if query_aware and query is not None else None)
        return None


class CubladeFlashAttentionBackend(_FlashAttentionBackend):
    """Registered as AttentionBackendEnum.CUSTOM by cublade.vllm.register(). It writes the cache in forward
    (the query-aware write needs the query), so vLLM calls no separate cache update."""

    forward_includes_kv_cache_update = True

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return CubladeFlashAttentionImpl
