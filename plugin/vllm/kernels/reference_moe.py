"""FP4 MoE experts in pure PyTorch: the CPU path; on a GPU only when asked for (CUBLADE_ALLOW_REFERENCE=1)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from cublade.config import FP4Scheme, Fp4Format
from cublade.numerics.moe import experts_forward_ref
from cublade.vllm.kernels.base import MoEKernel, local_topk_ids, reference_allowed


def expert_tensors(layer, scheme: FP4Scheme, e: int, proj: str) -> dict[str, torch.Tensor]:
    """One expert linear's tensors in the checkpoint layout (views into the layer's stacked parameters)."""
    I = layer.w13_weight_packed.shape[1] // 2
    w, rows = ("w2", slice(None)) if proj == "down" else ("w13", slice(0, I) if proj == "gate" else slice(I, 2 * I))
    t = {"weight_packed": getattr(layer, f"{w}_weight_packed")[e, rows],
         "weight_scale": getattr(layer, f"{w}_weight_scale")[e, rows]}
    if scheme.format is Fp4Format.NVFP4:
        g = getattr(layer, f"{w}_weight_global_scale")
        t["weight_global_scale"] = g[e, 0 if proj == "gate" else 1].reshape(1) if w == "w13" else g[e].reshape(1)
    return t


class ReferenceMoE(MoEKernel):
    """Pure PyTorch, from the stored FP4 tensors (scheme.linear_ref per expert linear)."""
    name = "reference"

    @classmethod
    def can_implement(cls, layer, scheme):
        # On a GPU only when asked for: it dequantizes every expert on every call and syncs with the host.
        return reference_allowed(layer.w13_weight_packed.device)

    def __init__(self, layer, scheme):
        super().__init__(layer, scheme)
        self.num_experts = layer.w13_weight_packed.shape[0]

    def apply(self, layer, x, topk_weights, topk_ids):
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("cublade FP4 MoE: the reference kernel cannot run under CUDA-graph capture "
                               "(it syncs with the host); serve with --enforce-eager, or build cublade's CUDA "
                               "extension / use a GPU where vLLM's Marlin MoE runs")

        def linear(e, proj, h):
            return self.scheme.linear_ref(h, expert_tensors(layer, self.scheme, e, proj))

        return experts_forward_ref(x, local_topk_ids(layer, topk_ids), topk_weights, linear, self.num_experts,
                                   F.silu)
