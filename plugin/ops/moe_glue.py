"""The glue around the grouped FP4 expert GEMMs (cublade.ops.fp4_gemm) of an MoE layer, as three ops:

    xs, offsets, pos = moe_route(topk_ids, x, num_experts)
    h = <w13 over xs, grouped by offsets>                  # [T*k, 2I]: gate | up
    a = silu_mul(h)                                        # [T*k, I]
    y = <w2 over a, grouped by offsets>                    # [T*k, N], row p of xs -> row p of y
    out = moe_finalize(y, pos, topk_weights)

`moe_route(topk_ids [T, k] int32/int64, x [T, H] bf16/fp16, num_experts E) -> (xs [T*k, H], offsets int32 [E+1],
pos int32 [T*k])`: routed row i = t*k + j (token t's j-th expert e = topk_ids[t, j]) goes to place pos[i] inside
e's range offsets[e] .. offsets[e+1]-1, and xs[pos[i]] = x[t]. Ids outside [0, E) (experts of other ranks) are
dropped: pos -1, no place; rows of xs from offsets[E] on are left unwritten. The order of the rows inside one
expert's range is unspecified (the kernel places them with atomics; the reference keeps token order): any
per-row computation over xs gives the same result row by row.

`moe_finalize(y [T*k, N], pos, topk_weights [T, k] fp32/bf16/fp16) -> [T, N] of y's dtype`: out[t] = sum over j
of w[t, j] * y[pos[t*k + j]], each product in fp32, summed from 0 in j order (a dropped row adds w * 0), rounded
once. Bit-exact to the reference (its `(rows.float() * w.float()).sum(dim=1)`).

`silu_mul(h [M, 2I] bf16/fp16) -> [M, I]`: F.silu(h[:, :I]) * h[:, I:] in one kernel, bit-exact to those two torch
ops (silu in fp32 as x / (1 + exp(-x)), rounded to h's dtype, then the product in fp32, rounded again).

CUDA-graph safe (no host sync, no allocation but the outputs). E <= 1024; H, N and I multiples of 8.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from cublade.ops._dispatch import register_fake, use_kernel

MAX_EXPERTS = 1024


def moe_route_ref(topk_ids: torch.Tensor, x: torch.Tensor, num_experts: int):
    ids = topk_ids.reshape(-1).long()
    k = topk_ids.shape[-1]
    key = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)  # dropped: sorted last
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
    offsets[1:] = torch.cumsum(counts[:num_experts], dim=0).to(torch.int32)
    pos = torch.empty_like(ids, dtype=torch.int32)
    pos[order] = torch.arange(ids.numel(), dtype=torch.int32, device=ids.device)
    pos = torch.where(key < num_experts, pos, -1)
    return x[order // k], offsets, pos


def moe_finalize_ref(y: torch.Tensor, pos: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    T, k = topk_weights.shape
    p = pos.long()
    rows = torch.where((p >= 0)[:, None], y[p.clamp(min=0)], torch.zeros((), dtype=y.dtype, device=y.device))
    return (rows.view(T, k, -1).float() * topk_weights.view(T, k, 1).float()).sum(dim=1).to(y.dtype)


def silu_mul_ref(h: torch.Tensor) -> torch.Tensor:
    i = h.shape[-1] // 2
    return F.silu(h[..., :i]) * h[..., i:]


def moe_route(topk_ids: torch.Tensor, x: torch.Tensor, num_experts: int):
    if use_kernel(x, "moe_route") and num_experts <= MAX_EXPERTS and x.shape[-1] % 8 == 0:
        return torch.ops.cublade.moe_route(topk_ids, x, num_experts)
    return moe_route_ref(topk_ids, x, num_experts)


def moe_finalize(y: torch.Tensor, pos: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    if use_kernel(y, "moe_finalize") and y.shape[-1] % 8 == 0:
        return torch.ops.cublade.moe_finalize(y, pos, topk_weights)
    return moe_finalize_ref(y, pos, topk_weights)


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    if (use_kernel(h, "silu_mul") and h.dim() == 2 and h.shape[-1] % 16 == 0
            and h.dtype in (torch.bfloat16, torch.float16)):
        return torch.ops.cublade.silu_mul(h)
    return silu_mul_ref(h)


@register_fake("cublade::moe_route")
def _moe_route_fake(topk_ids: torch.Tensor, x: torch.Tensor, num_experts: int):
    n = topk_ids.numel()
    return (x.new_empty((n, x.shape[-1])), x.new_empty((num_experts + 1,), dtype=torch.int32),
            x.new_empty((n,), dtype=torch.int32))


@register_fake("cublade::moe_finalize")
def _moe_finalize_fake(y: torch.Tensor, pos: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    return y.new_empty((topk_weights.shape[0], y.shape[-1]))


@register_fake("cublade::silu_mul")
def _silu_mul_fake(h: torch.Tensor) -> torch.Tensor:
    return h.new_empty((h.shape[0], h.shape[1] // 2))
