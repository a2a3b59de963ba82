"""The opt-in attention backend (`--attention-backend CUSTOM`): vLLM's FlashAttention with the FP8 KV-cache
write done by cublade.ops.fp8_kv_cache_write, in the backend's forward (where the query is, for a query-aware
checkpoint). On CPU the op is its reference; the bytes it leaves in vLLM's cache layout (FlashAttention, vLLM
0.26: [num_blocks, H, block_size, 2*D] logical, K then V in the last dim) are checked against a direct
computation, bit for bit, with padded tokens and skipped (-1) slots."""
from __future__ import annotations

import logging

import pytest
import torch

from cublade.config import KVRounding
from cublade.ops.fp8_kv_cache_write import fp8_kv_quant_query_aware_ref, fp8_kv_quant_ref


def impl(kv_cache_dtype="fp8", head_size=16):
    from vllm.v1.attention.backend import AttentionType

    from cublade.vllm.kv_cache import CubladeFlashAttentionImpl

    # Only the fields do_kv_cache_update reads: FlashAttentionImpl.__init__ asks the GPU for its FA version.
    obj = object.__new__(CubladeFlashAttentionImpl)
    obj.kv_cache_dtype, obj.head_size, obj.attn_type = kv_cache_dtype, head_size, AttentionType.DECODER
    return obj


class Layer(torch.nn.Module):
    def __init__(self, k_scale, v_scale, rounding="nearest"):
        super().__init__()
        self._k_scale = torch.tensor(k_scale, dtype=torch.float32)
        self._v_scale = torch.tensor(v_scale, dtype=torch.float32)
        self.cublade_kv_rounding = KVRounding(rounding)  # what CubladeKVCacheMethod.create_weights sets
        self.layer_name, self.kv_sharing_target_layer_name = "model.layers.0.self_attn.attn", None


def expected_cache(kv_cache, key, value, slots, layer, query=None):
    """The cache bytes a write of these rows leaves in a zeroed FlashAttention cache, token by token."""
    raw = torch.zeros_like(kv_cache.view(torch.uint8))
    num_blocks, H, block_size, D2 = raw.shape
    D = D2 // 2
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        b, off = divmod(s, block_size)
        k = (fp8_kv_quant_ref(key[t], layer._k_scale) if query is None
             else fp8_kv_quant_query_aware_ref(key[t:t + 1], query[t:t + 1], layer._k_scale)[0])
        raw[b, :, off, :D] = k.view(torch.uint8)
        raw[b, :, off, D:] = fp8_kv_quant_ref(value[t], layer._v_scale).view(torch.uint8)
    return raw


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
    assert torch.equal(raw, expected_cache(kv_cache, key, value, slots[:T], layer))
    assert int((raw != 0).any(dim=-1).sum()) > 0


def forward_case(seed=0, H=2, R=4, D=16, padded=12):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(padded, H, D, generator=g).to(torch.bfloat16) * 3
    value = torch.randn(padded, H, D, generator=g).to(torch.bfloat16)
    query = torch.randn(padded, H * R, D, generator=g).to(torch.bfloat16) * 2
    slots = torch.tensor([5, 17, 18, -1, 40, 41, 63, 80, 3], dtype=torch.int64)
    return key, value, query, slots


@pytest.fixture
def flash_forward(vllm_dist, monkeypatch):
    """FlashAttentionImpl.forward replaced by a recorder (no FlashAttention on CPU); the forward context's
    slot mapping replaced by the test's. Returns the recorded calls."""
    from vllm.v1.attention.backends import flash_attn

    import cublade.vllm.kv_cache as kv

    calls, slots = [], []
    monkeypatch.setattr(flash_attn.FlashAttentionImpl, "forward",
                        lambda self, layer, q, k, v, cache, meta, out, **kw: calls.append((q, k, meta)) or out)
    monkeypatch.setattr(kv, "_slot_mapping", lambda layer: slots[0])
    return calls, slots


@pytest.mark.parametrize("rounding", ["nearest", "query-aware"])
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_forward_writes_the_cache_then_attends(flash_forward, rounding, query_dtype):
    """The backend writes the cache in forward (vLLM then calls no separate update), K rounded against the
    query the layer hands it (FP8 where vLLM quantized it for FlashAttention 3) when the checkpoint says so."""
    from cublade.vllm.kv_cache import CubladeFlashAttentionBackend

    calls, slots_box = flash_forward
    assert CubladeFlashAttentionBackend.forward_includes_kv_cache_update
    key, value, query, slots = forward_case()
    query = query.to(query_dtype)
    slots_box.append(slots)
    kv_cache = torch.zeros((6, 2, 16, 32), dtype=torch.uint8)
    layer = Layer(0.0123, 0.0071, rounding)
    output = torch.empty(12, 8, 16)
    assert impl().forward(layer, query, key, value, kv_cache, "metadata", output) is output
    assert len(calls) == 1 and calls[0][0] is query and calls[0][2] == "metadata"
    expect = expected_cache(kv_cache, key, value, slots, layer, query if rounding == "query-aware" else None)
    assert torch.equal(kv_cache, expect)
    nearest = expected_cache(kv_cache, key, value, slots, layer)
    # query-aware moves some K bytes (never V's); nearest is vLLM's bytes
    assert torch.equal(kv_cache, nearest) == (rounding == "nearest")
    assert torch.equal(kv_cache[..., 16:], nearest[..., 16:])


def test_forward_writes_nothing_for_the_profiling_run_or_a_shared_cache(flash_forward):
    calls, slots_box = flash_forward
    key, value, query, slots = forward_case()
    slots_box.append(slots)
    kv_cache = torch.zeros((6, 2, 16, 32), dtype=torch.uint8)
    layer = Layer(0.0123, 0.0071, "query-aware")
    impl().forward(layer, query, key, value, kv_cache, None, torch.empty(12, 8, 16))  # profiling run
    layer.kv_sharing_target_layer_name = "model.layers.0.self_attn.attn"
    impl().forward(layer, query, key, value, kv_cache, "metadata", torch.empty(12, 8, 16))
    assert len(calls) == 2 and not kv_cache.any()


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
