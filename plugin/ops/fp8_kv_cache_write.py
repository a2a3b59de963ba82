"""FP8 KV-cache write: quantize new K/V with the layer's per-tensor scales and scatter them into vLLM's
paged cache in the FlashAttention layout (what vLLM's `reshape_and_cache_flash` does).

Layout: key/value [T, H, D]; key_cache/value_cache [num_blocks, block_size, H, D] (uint8 or e4m3 storage);
slot_mapping [T] int64, slot = block * block_size + offset, a negative slot means "skip this token"
(padding). As in vLLM, key/value may hold more rows than slot_mapping (vLLM pads them): the slots count the
tokens. A slot past the cache (>= num_blocks * block_size) is skipped too (vLLM's kernel would write out of
bounds; the reference used to raise). Quant: e4m3(clamp(x / scale, ±448)), a true fp32 division, as vLLM's
cache kernel does (csrc/quantization/w8a8/fp8/nvidia/quant_utils.cuh, scaled_vec_conversion:
`__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, __NV_E4M3)`; checked against vLLM's source), so the cache
bytes match vLLM's op bit for bit. Pass the scales as device tensors: a Python float costs a host-to-device
copy per call on the kernel path.
"""
from __future__ import annotations

import torch

from cublade.constants import F8E4M3_MAX
from cublade.ops._dispatch import register_fake, use_kernel
from cublade.ops.fp8_quant import FP8_DTYPE


def fp8_kv_quant_ref(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    return (x.float() / s).clamp(-F8E4M3_MAX, F8E4M3_MAX).to(FP8_DTYPE)


def fp8_kv_cache_write_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """In place: writes the quantized rows of key/value into the cache slots."""
    num_blocks, block_size = key_cache.shape[:2]
    T = slot_mapping.shape[0]
    keep = (slot_mapping >= 0) & (slot_mapping < num_blocks * block_size)
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    for src, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        q = fp8_kv_quant_ref(src[:T][keep], scale)
        cache[blocks, offsets] = q.view(cache.dtype) if cache.dtype != FP8_DTYPE else q


def fp8_kv_cache_write(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    if use_kernel(key, "fp8_kv_cache_write"):
        scales = [s if isinstance(s, torch.Tensor) else torch.tensor([s], dtype=torch.float32, device=key.device)
                  for s in (k_scale, v_scale)]
        torch.ops.cublade.fp8_kv_cache_write(key, value, key_cache, value_cache, slot_mapping, *scales)
        return
    fp8_kv_cache_write_ref(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


@register_fake("cublade::fp8_kv_cache_write")
def _fp8_kv_cache_write_fake(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    return None
