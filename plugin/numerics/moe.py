"""The MoE computation over expert linears, shared by the reference backend (cublade.reference_experts) and the
vLLM reference kernel (cublade.vllm.kernels.reference_moe): top-k routed tokens through gate, up and down of their
experts, weighted and summed in fp32.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ExpertLinear = Callable[[int, str, torch.Tensor], torch.Tensor]


def experts_forward_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        linear: ExpertLinear, num_experts: int,
                        act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j].

    x [T, H]; topk_ids [T, k] (ids outside 0..num_experts-1, e.g. -1 for an expert on another rank, are
    skipped); linear(e, proj, x) computes one expert linear (proj in 'gate', 'up', 'down') and returns x's
    dtype. The weighted sum is accumulated in fp32 and returned in x's dtype."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in range(num_experts):
        tok, slot = torch.where(topk_ids == e)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        h = act(linear(e, "gate", xe)) * linear(e, "up", xe)
        y = linear(e, "down", h)
        out.index_add_(0, tok, y.float() * topk_weights[tok, slot, None].float())
    return out.to(x.dtype)
