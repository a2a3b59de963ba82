"""The opt-in attention backend (`--attention-backend CUSTOM`): vLLM's FlashAttention with the FP8 KV-cache
write done by cublade.ops.fp8_kv_cache_write. On CPU the op is its reference; the bytes it leaves in vLLM's
cache layout (FlashAttention, vLLM 0.26: [num_blocks, H, block_size, 2*D] logical, K then V in the last dim)
are checked against a direct computation, bit for bit, with padded tokens and skipped (-1) slots."""
from __future__ import annotations

import pytest
import torch

from cublade.ops.fp8_kv_cache_write import fp8_kv_quant_ref


def impl(kv_cache_dtype="fp8", head_size=16):
    from vllm.v1.attention.backend import AttentionType

    from cublade.vllm.kv_cache import CubladeFlashAttentionImpl

    # Only the fields do_kv_cache_update reads: FlashAttentionImpl.__init__ asks the GPU for its FA version.
    obj = object.__new__(CubladeFlashAttentionImpl)
    obj.kv_cache_dtype, obj.head_size, obj.attn_type = kv_cache_dtype, head_size, AttentionType.DECODER
    return obj


class Layer(torch.nn.Module):
    def __init__(self, k_scale, v_scale):
        super().__init__()
        self._k_scale = torch.tensor(k_scale, dtype=torch.float32)
        self._v_scale = torch.tensor(v_scale, dtype=torch.float32)


@pytest.mark.parametrize("cache_dtype", [torch.uint8, torch.float8_e4m3fn])
def test_fp8_cache_write_bytes(vllm_dist, cache_dtype):
    from cublade.vllm.kv_cache import CubladeFlashAttentionBackend

    num_blocks, block_size, H, D = 6, 16, 4, 16
    shape = CubladeFlashAttentionBackend.get_kv_cache_shape(num_blocks, block_size, H, D)
    assert shape == (num_blocks, H, block_size, 2 * D)
    kv_cache = torch.zeros(shape, dtype=cache_dtype)
    g = torch.Generator().manual_seed(0)
    T, padded = 9, 12  # key/value padded past the real tokens, as under CUDA graphs
    key = torch.randn(padded, H, D, generator=g).to(torch.bfloat16) * 3
    value = torch.randn(padded, H, D, generator=g).to(torch.bfloat16)
    slots = torch.tensor([5, 17, 18, -1, 40, 41, 63, 80, 3], dtype=torch.int64)
    layer = Layer(0.0123, 0.0071)
    impl().do_kv_cache_update(layer, key, value, kv_cache, slots)

    raw = kv_cache.view(torch.uint8)
    expect = torch.zeros_like(raw)
    for t in range(T):
        s = int(slots[t])
        if s < 0:
            continue
        b, off = divmod(s, block_size)
        expect[b, :, off, :D] = fp8_kv_quant_ref(key[t], layer._k_scale).view(torch.uint8)
        expect[b, :, off, D:] = fp8_kv_quant_ref(value[t], layer._v_scale).view(torch.uint8)
    assert torch.equal(raw, expect)
    assert int((raw != 0).any(dim=-1).sum()) > 0


def test_other_cache_dtypes_go_to_vllms_own_write(vllm_dist, monkeypatch):
    from vllm.v1.attention.backends import flash_attn

    called = []
    monkeypatch.setattr(flash_attn.FlashAttentionImpl, "do_kv_cache_update",
                        lambda self, *a: called.append(self.kv_cache_dtype))
    impl("auto").do_kv_cache_update(Layer(1.0, 1.0), None, None, None, None)
    assert called == ["auto"]


def test_backend_registered_as_custom(vllm_dist):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from cublade.vllm.kv_cache import CubladeFlashAttentionBackend, CubladeFlashAttentionImpl

    assert AttentionBackendEnum.CUSTOM.get_class() is CubladeFlashAttentionBackend
    assert AttentionBackendEnum[CubladeFlashAttentionBackend.get_name()] is AttentionBackendEnum.CUSTOM
    assert CubladeFlashAttentionBackend.get_impl_cls() is CubladeFlashAttentionImpl
