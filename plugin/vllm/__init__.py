"""cublade's vLLM integration, loaded by vLLM through the `vllm.general_plugins` entry point.

`register()` runs in every vLLM process (API server, engine core, workers). It registers, through vLLM's
public registries only (nothing in vLLM is patched):
  * the `cublade` QuantizationConfig (cublade.vllm.config.CubladeConfig): `--quantization cublade`, and
    selected with no flag for a checkpoint whose config.json says `"quant_method": "cublade"`;
  * the attention backend `CUSTOM` = cublade.vllm.kv_cache.CubladeFlashAttentionBackend (FlashAttention with
    cublade's FP8 KV-cache write), used only when asked for: `--attention-backend CUSTOM`.

This module imports nothing heavy: vLLM and the plugin's methods are imported inside register().
"""
from __future__ import annotations

import logging

# Under vLLM's logger tree so the lines appear in vLLM's own log output, with its format.
logger = logging.getLogger("vllm.cublade")

_registered = False


def register() -> None:
    """Register cublade with vLLM. Idempotent: a second call in the same process does nothing."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config

    from cublade.config import QUANT_METHOD
    from cublade.vllm.config import CubladeConfig

    register_quantization_config(QUANT_METHOD)(CubladeConfig)
    backend = _register_attention_backend()
    _registered = True
    logger.info("cublade: registered quantization method %r (%s.%s)%s", QUANT_METHOD,
                CubladeConfig.__module__, CubladeConfig.__qualname__,
                f"; attention backend CUSTOM = {backend} (opt in: --attention-backend CUSTOM)" if backend
                else "")


def _register_attention_backend() -> str | None:
    """Claim vLLM's one third-party attention slot, CUSTOM, unless another plugin already holds it."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    path = "cublade.vllm.kv_cache.CubladeFlashAttentionBackend"
    try:
        held = AttentionBackendEnum.CUSTOM.get_path()
    except ValueError:  # CUSTOM not registered yet
        held = None
    if held not in (None, path):
        logger.warning("cublade: attention backend CUSTOM is already registered to %s; cublade's FP8 "
                       "KV-cache write backend is not registered", held)
        return None
    register_backend(AttentionBackendEnum.CUSTOM, path)
    return path
