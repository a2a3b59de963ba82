"""FP4 MoE experts on cublade's grouped FP4 GEMM (cublade.ops.fp4_gemm) and MoE glue ops."""
from __future__ import annotations

import torch

from cublade.config import Fp4Format
from cublade.ops.fp4_gemm import fp4_gemm, fp4_repack
from cublade.ops.moe_glue import moe_finalize, moe_route, silu_mul
from cublade.vllm.kernels.base import MoEKernel, local_topk_ids, on_gpu, replace_parameter, why_no_kernel


class CubladeFp4MoE(MoEKernel):
    """cublade's FP4 GEMM (cublade.ops.fp4_gemm), grouped over experts: one call for w13 and one for w2 per
    layer, tokens sorted by expert and the outputs combined by cublade.ops.moe_glue's two ops (no host sync:
    CUDA-graph capturable)."""
    name = "cublade-fp4-moe"

    @classmethod
    def can_implement(cls, layer, scheme):
        w = layer.w13_weight_packed
        if not on_gpu(w.device):
            return False, "needs a CUDA device"
        why = why_no_kernel("fp4_gemm", w.device)  # the arch too: the extension is sm_90a only
        if why is not None:
            return False, why
        if layer.params_dtype != torch.bfloat16:
            return False, f"activations are {layer.params_dtype}; cublade's fp4_gemm takes bf16"
        H, I = layer.w2_weight_packed.shape[1], w.shape[1] // 2
        if H % 32 or I % 32:
            return False, f"fp4_gemm needs K % 32 == 0 for both GEMMs (hidden_size={H}, intermediate={I})"
        return True, f"cublade's grouped FP4 dequant-GEMM ({scheme.format} weights, bf16 math)"

    def __init__(self, layer, scheme):
        super().__init__(layer, scheme)
        E, I2, _ = layer.w13_weight_packed.shape
        self.num_experts, self.I, self.H = E, I2 // 2, layer.w2_weight_packed.shape[1]
        # The kernel's tiled layout (fp4_repack, see cublade.ops.fp4_gemm), made once; the checkpoint-layout
        # parameters are dropped. nvfp4: w13's [E, 2] global scales become per-row scales of w1 and w3 rows.
        self.fmt = scheme.format.value  # a plain str, as the op takes it (under torch.compile too)
        nv = scheme.format is Fp4Format.NVFP4
        for w in ("w13", "w2"):
            rp = fp4_repack(getattr(layer, f"{w}_weight_packed").data, getattr(layer, f"{w}_weight_scale").data,
                            scheme.format, getattr(layer, f"{w}_weight_global_scale").data if nv else None)
            for name in ("weight_packed", "weight_scale", "weight_global_scale"):
                replace_parameter(layer, f"{w}_{name}", None)
            replace_parameter(layer, f"{w}_fp4_packed", rp.packed)
            replace_parameter(layer, f"{w}_fp4_row_scale", rp.row_scale)

    def apply(self, layer, x, topk_weights, topk_ids):
        T, k = topk_ids.shape
        I, H = self.I, self.H
        fmt = self.fmt
        # Rows sorted by expert (ids of other ranks' experts dropped), then the two grouped GEMMs, then the top-k
        # weighted sum: cublade.ops.moe_glue's two ops around the GEMMs (a reference path off the GPU).
        E = self.num_experts
        xs, offsets, pos = moe_route(local_topk_ids(layer, topk_ids), x, E)
        # max_m bounds an expert's rows and picks the streaming (decode) kernel's tokens per pass (8 / 16 / 32). T is a
        # true bound (top-k picks distinct experts) but runs 16- or 32-token passes where a balanced routing gives an
        # expert ~T k / E rows; twice that mean is the bound used (an expert with more rows takes one more pass,
        # still correct). Mixtral-size w13 + w2 at 16 / 32 tokens: 275 / 399 us with max_m = T, 241 / 278 with twice
        # the mean (H200, benchmarks/tuning/experiments/fp4_moe_maxm.py). From 16 rows per expert (T k / E)
        # fp4_gemm runs its wgmma kernel instead, which picks its own tokens per pass. E is the experts the rows were
        # routed over: under expert parallelism the model's (global_num_experts), not this rank's share of them, or
        # the mean is overestimated by the number of ranks (EP = 2 at 64 tokens: 32 rows instead of 16, a wide
        # pass of 48 tokens where 32 fits).
        routed = max(E, getattr(layer, "global_num_experts", E))
        max_m = min(T, -(-2 * T * k // routed))
        # Each intermediate is dropped once used, so the caching allocator reuses it for the next (w2's x workspace
        # among them): the layer's peak is what vLLM's profiling run charges against the KV cache.
        h = fp4_gemm(xs, layer.w13_fp4_packed, getattr(layer, "w13_fp4_row_scale", None), fmt, 2 * I, offsets, max_m,
                     0, routed)
        del xs
        a = silu_mul(h)
        del h
        y = fp4_gemm(a, layer.w2_fp4_packed, getattr(layer, "w2_fp4_row_scale", None), fmt, H, offsets, max_m, 0,
                     routed)
        del a
        return moe_finalize(y, pos, topk_weights).to(x.dtype)
