"""The adapter over vLLM's mixed-precision (MPLinearKernel) int4 kernels: vllm_machete, vllm_marlin, vllm_humming."""
from __future__ import annotations

from typing import ClassVar

from cublade.config import W4A16Scheme
from cublade.config.compressed_tensors import pack_zero_points
from cublade.vllm.kernels.base import LinearKernel, gpu_half, replace_parameter


class VllmMixedPrecision(LinearKernel):
    """Adapter over vLLM's MPLinearKernel classes (Machete, Marlin, Humming): they read compressed-tensors' int4
    layout, so the constructor rebuilds it from cublade's (same weight words; zero points packed 8 per int32
    along N) and lets vLLM's kernel repack from there."""
    vllm_class: ClassVar[str] = ""

    @classmethod
    def _vllm_kernel(cls):
        from vllm.model_executor.kernels import linear as vllm_linear

        return getattr(vllm_linear, cls.vllm_class)

    @classmethod
    def _config(cls, layer):
        from vllm.model_executor.kernels.linear import MPLinearLayerConfig
        from vllm.scalar_type import scalar_types

        s: W4A16Scheme = layer.cublade_scheme
        return MPLinearLayerConfig(
            full_weight_shape=(layer.input_size, layer.output_size),
            partition_weight_shape=(layer.input_size_per_partition, layer.output_size_per_partition),
            # symmetric: unsigned nibble u = q + 8 (uint4b8); asymmetric: u and a zero point (uint4)
            weight_type=scalar_types.uint4b8 if s.symmetric else scalar_types.uint4,
            act_type=layer.params_dtype, group_size=s.group_size, zero_points=not s.symmetric,
            has_g_idx=False)

    @classmethod
    def can_implement(cls, layer):
        cap, why = gpu_half(layer, layer.weight_packed.device)
        if cap is None:
            return False, why
        if not layer.cublade_scheme.symmetric and layer.output_size_per_partition % 8:
            return False, f"zero points pack 8 per int32 along N; N={layer.output_size_per_partition}"
        k = cls._vllm_kernel()
        if cap < k.get_min_capability():
            return False, f"needs sm_{k.get_min_capability()}+, this GPU is sm_{cap}"
        ok, why = k.can_implement(cls._config(layer))
        return ok, (f"vLLM's {k.__name__} on sm_{cap}" if ok else f"vLLM's {k.__name__}: {why}")

    def __init__(self, layer):
        super().__init__(layer)
        from vllm.model_executor.parameter import (ChannelQuantScaleParameter, GroupQuantScaleParameter,
                                                   PackedColumnParameter, PackedvLLMParameter)

        s: W4A16Scheme = self.scheme
        act = layer.params_dtype
        noop = lambda *a, **k: None  # noqa: E731  (loading is over)
        replace_parameter(layer, "weight_packed", PackedvLLMParameter(
            data=layer.weight_packed.data, input_dim=1, output_dim=0, packed_dim=1, packed_factor=8,
            weight_loader=noop))
        scale = layer.weight_scale.data.to(act)
        zp = getattr(layer, "weight_zero_point", None)
        zp = None if zp is None else pack_zero_points(zp.data)  # [N/8, groups]
        if s.group_size == -1:
            replace_parameter(layer, "weight_scale", ChannelQuantScaleParameter(
                data=scale, output_dim=0, weight_loader=noop))
            if zp is not None:
                replace_parameter(layer, "weight_zero_point", PackedColumnParameter(
                    data=zp, output_dim=0, packed_dim=0, packed_factor=8, weight_loader=noop))
        else:
            replace_parameter(layer, "weight_scale", GroupQuantScaleParameter(
                data=scale, output_dim=0, input_dim=1, weight_loader=noop))
            if zp is not None:
                replace_parameter(layer, "weight_zero_point", PackedvLLMParameter(
                    data=zp, input_dim=1, output_dim=0, packed_dim=0, packed_factor=8, weight_loader=noop))
        self.impl = self._vllm_kernel()(self._config(layer), w_q_param_name="weight_packed",
                                        w_s_param_name="weight_scale",
                                        w_zp_param_name=None if s.symmetric else "weight_zero_point")
        self.impl.process_weights_after_loading(layer)

    def apply(self, layer, x, bias):
        return self.impl.apply_weights(layer, x, bias)
