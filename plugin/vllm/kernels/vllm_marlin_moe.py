"""FP4 MoE experts on vLLM's fused Marlin MoE (a fallback)."""
from __future__ import annotations

import types

import torch

from cublade.config import Fp4Format
from cublade.vllm.kernels.base import MoEKernel, on_gpu, replace_parameter


class VllmMarlinMoE(MoEKernel):
    """Fallback: vLLM's fused Marlin MoE kernel over FP4 weights (bf16/fp16 activations)."""
    name = "vllm-marlin-moe"
    own = False

    @classmethod
    def can_implement(cls, layer, scheme):
        w = layer.w13_weight_packed
        if not on_gpu(w.device):
            return False, "needs a CUDA device"
        if layer.params_dtype not in (torch.bfloat16, torch.float16):
            return False, f"activations are {layer.params_dtype}; Marlin takes bf16/fp16"
        try:
            from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import is_fp4_marlin_supported
            from vllm.platforms import current_platform

            # vLLM's CUDA extensions register torch.ops._moe_C (0.26: the module vllm._moe_C_stable_libtorch;
            # older releases: vllm._moe_C); the platform knows the names and loads them once.
            current_platform.import_kernels()
            torch.ops._moe_C.moe_wna16_marlin_gemm  # noqa: B018  (the op fused_marlin_moe calls)
        except (ImportError, AttributeError, RuntimeError) as e:
            return False, f"vLLM's Marlin MoE op is not available ({type(e).__name__}: {e})"
        if not is_fp4_marlin_supported():
            return False, "vLLM says this GPU has no FP4 Marlin support"
        E, I2, _ = w.shape
        H, I = layer.w2_weight_packed.shape[1], I2 // 2
        if H % 128 or I % max(64, scheme.block):
            return False, f"Marlin MoE tiles need hidden_size % 128 == 0 and intermediate % 64 == 0 (H={H}, I={I})"
        if scheme.format is Fp4Format.NVFP4:
            g = layer.w13_weight_global_scale
            if not torch.equal(g[:, 0], g[:, 1]):
                return False, ("nvfp4 w1 and w3 of an expert have different global scales; Marlin takes one per "
                               "expert for the fused w13")
        return True, f"vLLM's fused Marlin MoE over {scheme.format} weights"

    def __init__(self, layer, scheme):
        super().__init__(layer, scheme)
        from vllm.model_executor.layers.quantization.utils import marlin_utils_fp4 as mu
        from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_make_workspace_new
        from vllm.scalar_type import scalar_types

        E, I2, H2 = layer.w13_weight_packed.shape
        self.quant_type_id = scalar_types.float4_e2m1f.id
        # Marlin's tiled layout (gptq_marlin_repack per expert) and its permuted scales, made once here; the
        # checkpoint-layout tensors are dropped.
        if scheme.format is Fp4Format.MXFP4:
            w13, w2, s13, s2, _, _ = mu.prepare_moe_mxfp4_layer_for_marlin(
                layer, layer.w13_weight_packed.data, layer.w2_weight_packed.data,
                layer.w13_weight_scale.data, layer.w2_weight_scale.data, None, None)
            g13 = g2 = None
        else:
            # vLLM's nvfp4 helper reads these four sizes off the layer it is given.
            sizes = types.SimpleNamespace(num_experts=E, hidden_size=H2 * 2, intermediate_size_per_partition=I2 // 2,
                                          params_dtype=layer.params_dtype)
            w13, s13, g13, w2, s2, g2 = mu.prepare_nvfp4_moe_layer_for_marlin(
                sizes, layer.w13_weight_packed.data, layer.w13_weight_scale.data,
                layer.w13_weight_global_scale.data[:, 0].contiguous(), layer.w2_weight_packed.data,
                layer.w2_weight_scale.data, layer.w2_weight_global_scale.data, True)
        self.workspace = marlin_make_workspace_new(layer.w13_weight_packed.device, 4)
        for name, value in (("w13_weight_packed", w13), ("w2_weight_packed", w2), ("w13_weight_scale", s13),
                            ("w2_weight_scale", s2), ("w13_weight_global_scale", g13),
                            ("w2_weight_global_scale", g2)):
            replace_parameter(layer, name, value)

    def apply(self, layer, x, topk_weights, topk_ids):
        from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe

        return fused_marlin_moe(
            x, layer.w13_weight_packed, layer.w2_weight_packed, None, None,
            layer.w13_weight_scale, layer.w2_weight_scale, topk_weights, topk_ids,
            quant_type_id=self.quant_type_id, global_num_experts=layer.global_num_experts,
            expert_map=layer.expert_map, activation=layer.activation, workspace=self.workspace,
            global_scale1=getattr(layer, "w13_weight_global_scale", None),
            global_scale2=getattr(layer, "w2_weight_global_scale", None))
