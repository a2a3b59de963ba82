"""FP8 KV-cache write: quantize new K/V with the layer's per-tensor scales and scatter them into vLLM's
paged cache in the FlashAttention layout (what vLLM's `reshape_and_cache_flash` does).

Layout: key/value [T, H, D]; key_cache/value_cache [num_blocks, block_size, H, D] (uint8 or e4m3 storage);
slot_mapping [T] int64, slot = block * block_size + offset, a negative slot means "skip this token"
(padding). As in vLLM, key/value may hold more rows than slot_mapping (vLLM pads them): the slots count the
tokens. A slot past the cache (>= num_blocks * block_size) is skipped too (vLLM's kernel would write out of
bounds). Quant: e4m3(clamp(x / scale, ±448)), a true fp32 division, as vLLM's
cache kernel does (csrc/quantization/w8a8/fp8/nvidia/quant_utils.cuh, scaled_vec_conversion:
`__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, __NV_E4M3)`; checked against vLLM's source), so the cache
bytes match vLLM's op bit for bit. Pass the scales as device tensors: a Python float costs a host-to-device
copy per call on the kernel path.

Query-aware K rounding (`query` given; V is always rounded to nearest). Each key's E4M3 codes are chosen, per
element, between the nearest value (what vLLM writes) and the neighbour on the other side of x / scale, to make
the key's rounding error e small where it matters: in the logits q . e of its own token's queries, the
`num_heads / num_kv_heads` query heads that read this KV head. Starting from round-to-nearest, up to
KV_QUERY_AWARE_MAX_FLIPS times: flip the one element that lowers sum_h (q_h . e)^2 the most, while one does.
The cache keeps vLLM's format (E4M3 bytes, one scale per layer): any attention kernel reads it. Why it works,
and what it buys (the FP8 KV cost on the bundled model falls from +0.038 to under +0.01): docs/decisions.md,
query-aware K rounding. The arithmetic is spelled out in fp8_kv_quant_query_aware_ref so that the CUDA kernel can
match it bit for bit (every product and sum rounded to fp32 in the stated order, no fused multiply-add).
"""
from __future__ import annotations

import torch

from cublade.numerics.constants import F8E4M3_MAX
from cublade.numerics.fp8 import FP8_DTYPE
from cublade.ops._dispatch import register_fake, use_kernel


def fp8_kv_quant_ref(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    return (x.float() / s).clamp(-F8E4M3_MAX, F8E4M3_MAX).to(FP8_DTYPE)


KV_QUERY_AWARE_MAX_FLIPS = 8
_LANES = 32  # the CUDA kernel's warp: lane l holds elements l, l + 32, l + 64, ... of a key


def _other_neighbour(r: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    """The E4M3 value next to r on xs's side (E4M3 magnitudes are ordered like their 7-bit codes); where
    r == xs, the next one towards zero; r itself for a zero; 448 stays the largest."""
    code = r.view(torch.uint8).to(torch.int16)
    mag, sign = code & 0x7F, code & 0x80
    up = r.float().abs() < xs.abs()
    mag = torch.where(up, (mag + 1).clamp(max=0x7E), (mag - 1).clamp(min=0))
    return (mag | sign).to(torch.uint8).view(FP8_DTYPE)


def fp8_kv_quant_query_aware_ref(key: torch.Tensor, query: torch.Tensor, scale: torch.Tensor | float,
                                 max_flips: int = KV_QUERY_AWARE_MAX_FLIPS) -> torch.Tensor:
    """key [T, G, D], query [T, G * R, D] (query heads g*R .. g*R+R-1 read KV head g, vLLM's grouping)
    -> E4M3 [T, G, D]: the key rounded query-aware (module docstring). In fp32, with xs = clamp(key / scale,
    +-448) (IEEE division), r = the nearest E4M3 value, o = _other_neighbour, e0 = r - xs, e1 = o - xs:

    - res[h] = sum_d query[h, d] * e0[d], summed as the kernel's warp does: lane l (d = l + 32 j, zeros past D)
      adds its products in order of j, then the 32 lane sums are added in a butterfly (lane l + lane l ^ m,
      m = 16, 8, 4, 2, 1);
    - norm(res) = res[0]^2 + res[1]^2 + ... (in order of h); cur = norm(res);
    - up to max_flips times: for every d, new[h] = res[h] + query[h, d] * delta[d], with delta[d] = e1 - e0
      (e0 - e1 once d is flipped), n[d] = norm(new) (NaN read as +inf); d* = the lowest d of the least n[d];
      if n[d*] < cur: flip d*, res = new for d*, cur = n[d*]; else stop.
    """
    T, G, D = key.shape
    if query.dim() != 3 or query.shape[0] != T or query.shape[2] != D or query.shape[1] % G:
        raise ValueError(f"query must be [{T}, a multiple of {G}, {D}] for key of shape {tuple(key.shape)}, "
                         f"got {tuple(query.shape)}")
    s = torch.as_tensor(scale, dtype=torch.float32, device=key.device)
    xs = (key.float() / s).clamp(-F8E4M3_MAX, F8E4M3_MAX)
    r = xs.to(FP8_DTYPE)
    o = _other_neighbour(r, xs)
    e0, e1 = r.float() - xs, o.float() - xs
    q = query.float().reshape(T, G, query.shape[1] // G, D)  # [T, G, R, D]
    R = q.shape[2]

    # res: per-lane partial sums in order of j, then the butterfly over the 32 lanes.
    J = -(-D // _LANES)
    pad = J * _LANES - D
    prod = torch.nn.functional.pad(q * e0[:, :, None, :], (0, pad)).reshape(T, G, R, J, _LANES)
    lane = prod[..., 0, :]
    for j in range(1, J):
        lane = lane + prod[..., j, :]
    for m in (16, 8, 4, 2, 1):
        lane = lane + lane[..., torch.arange(_LANES, device=key.device) ^ m]
    res = lane[..., 0]  # [T, G, R]: every lane holds the same sums

    def norm(v: torch.Tensor) -> torch.Tensor:  # v [..., R, X] -> [..., X], squares summed in order of h
        acc = v[..., 0, :] * v[..., 0, :]
        for h in range(1, R):
            acc = acc + v[..., h, :] * v[..., h, :]
        return acc

    cur = norm(res[..., None])[..., 0]  # [T, G]
    flipped = torch.zeros_like(e0, dtype=torch.bool)
    for _ in range(max_flips):
        delta = torch.where(flipped, e0 - e1, e1 - e0)  # [T, G, D]
        new = res[..., None] + q * delta[:, :, None, :]  # [T, G, R, D]
        n = norm(new).nan_to_num(nan=float("inf"), posinf=float("inf"))
        best, d = n.min(dim=-1)  # the lowest index among equal minima
        go = best < cur
        flipped.scatter_(-1, d[..., None], flipped.gather(-1, d[..., None]) ^ go[..., None])
        res = torch.where(go[..., None], new.gather(-1, d[:, :, None, None].expand(T, G, R, 1))[..., 0], res)
        cur = torch.where(go, best, cur)
    return torch.where(flipped, o, r)


def fp8_kv_cache_write_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           k_scale: torch.Tensor, v_scale: torch.Tensor, query: torch.Tensor | None = None) -> None:
    """In place: writes the quantized rows of key/value into the cache slots (K query-aware when query is
    given, [T, num_heads, D] like key's rows)."""
    num_blocks, block_size = key_cache.shape[:2]
    T = slot_mapping.shape[0]
    keep = (slot_mapping >= 0) & (slot_mapping < num_blocks * block_size)
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    for src, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        if src is key and query is not None:
            q = fp8_kv_quant_query_aware_ref(key[:T][keep], query[:T][keep], scale)
        else:
            q = fp8_kv_quant_ref(src[:T][keep], scale)
        cache[blocks, offsets] = q.view(cache.dtype) if cache.dtype != FP8_DTYPE else q


def fp8_kv_cache_write(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, query=None) -> None:
    """query: None rounds K to nearest (vLLM's bytes); the token's queries [T, num_heads, D] round it
    query-aware (module docstring)."""
    if use_kernel(key, "fp8_kv_cache_write"):
        scales = [s if isinstance(s, torch.Tensor) else torch.tensor([s], dtype=torch.float32, device=key.device)
                  for s in (k_scale, v_scale)]
        torch.ops.cublade.fp8_kv_cache_write(key, value, key_cache, value_cache, slot_mapping, *scales, query)
        return
    fp8_kv_cache_write_ref(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, query)


@register_fake("cublade::fp8_kv_cache_write")
def _fp8_kv_cache_write_fake(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                             query=None) -> None:
    return None
