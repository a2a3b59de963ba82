"""vLLM FusedMoE quantization method for FP4 (MXFP4 / NVFP4) experts: FP4 storage, bf16 math.

Entry point for the cublade QuantizationConfig (plugin/vllm/config.py): for a FusedMoE layer whose expert
linears the policy maps to an `FP4Scheme`, `get_quant_method` returns

    CubladeFp4MoEMethod(scheme, layer.moe_config)

(`layer` is vLLM's RoutedExperts; `scheme` is `policy.scheme_for(f"{prefix}.0.w1")`, an FP4Scheme).

Work in progress: parameters, weight loading and the kernel choice land in the next commits.
"""
from __future__ import annotations

from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

from cublade.config.schemes import FP4Scheme


class CubladeFp4MoEMethod(FusedMoEMethodBase):
    """FP4 experts of one FusedMoE layer (see the module docstring)."""

    def __init__(self, scheme: FP4Scheme, moe: FusedMoEConfig, prefix: str = ""):
        if not isinstance(scheme, FP4Scheme):
            raise ValueError(f"{prefix or 'FusedMoE'}: CubladeFp4MoEMethod takes an fp4 scheme, got "
                             f"{type(scheme).__name__}")
        super().__init__(moe)
        self.scheme = scheme
        self.prefix = prefix
