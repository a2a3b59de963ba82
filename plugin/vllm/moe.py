"""vLLM FusedMoE quantization method for FP4 (MXFP4 / NVFP4) experts: FP4 storage, bf16 math.

Entry point for the cublade QuantizationConfig (cublade.vllm.config): for a FusedMoE layer whose expert
linears the policy maps to an `FP4Scheme`, `get_quant_method` returns

    CubladeFp4MoEMethod(scheme, layer.moe_config, prefix)

(`layer` is vLLM's RoutedExperts; `scheme` is `policy.scheme_for(f"{prefix}.0.w1")`).

Parameters (E local experts, H hidden, I intermediate per TP rank, B = 32 mxfp4 / 16 nvfp4), the checkpoint's
per-expert tensors stacked by vLLM's FusedMoE weight loader (w13 = [w1; w3] rows, as vLLM fuses them):
    w13_weight_packed        uint8 [E, 2I, H/2]      w2_weight_packed        uint8 [E, H, I/2]
    w13_weight_scale         E8M0 uint8 / e4m3 [E, 2I, H/B]                 w2_weight_scale [E, H, I/B]
    w13_weight_global_scale  fp32 [E, 2] (nvfp4: w1, w3)                     w2_weight_global_scale fp32 [E]
Checkpoint `...experts.{e}.w1.weight_packed` lands in `w13_weight_packed[e, :I]`, w3 in `[e, I:]`, w2 in
`w2_weight_packed[e]` (TP: w1/w3 split along rows, w2 along columns; I/TP must be a multiple of B). A tensor of
the wrong shape or dtype is refused at load, and a local expert missing one of its tensors after loading, each
with the checkpoint tensor's name. Kernels repack these once (process_weights_after_loading) and drop them.

Kernel choice (one per layer, in process_weights_after_loading, by the selector of cublade.vllm.kernels: first
that can run the layer wins; logged once per distinct choice with the reason; CUBLADE_DISABLED_KERNELS=name,...
takes kernels out), one class each in cublade.vllm.kernels:
  cublade-fp4-moe    cublade's FP4 dequant-GEMM op (cublade.ops.fp4_gemm), CUDA, bf16: one grouped call per
                     projection, between cublade.ops.moe_glue's moe_route (tokens sorted by expert on the
                     device) and moe_finalize (the top-k weighted sum); CUDA-graph capturable
  vllm-marlin-moe    fallback: vLLM's fused Marlin MoE (FP4 weights, bf16/fp16 activations), CUDA; weights
                     repacked once into Marlin's layout. NVFP4 needs one global scale per expert for w1 and w3.
  reference          pure PyTorch: every expert linear is scheme.linear_ref on the stored FP4 tensors (the
                     reference backend's numerics, cublade.numerics.moe.experts_forward_ref); the CPU path. On a GPU
                     only with CUBLADE_ALLOW_REFERENCE=1: slow, and it syncs with the host, so it refuses CUDA-graph
                     capture (serve with --enforce-eager).
"""
from __future__ import annotations

import logging

import torch
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import FusedMoeWeightScaleSupported
from vllm.model_executor.utils import set_weight_attrs

from cublade.checkpoint import tensor_infos
from cublade.config.experts import expert_layout
from cublade.config.schemes import FP4Scheme, UnsupportedShape
from cublade.numerics.fp4 import Fp4Format
from cublade.numerics.constants import E8M0_NAN
from cublade.vllm.kernels import select_moe_kernel
from cublade.vllm.kernels.base import MoEKernel

logger = logging.getLogger("vllm.cublade")


def check_checkpoint_experts(model_dir) -> None:
    """A cublade (or any per-expert) checkpoint's expert tensors against its config.json, from the safetensors
    headers only: no expert id beyond the config's count, none missing. For loaders that would otherwise drop
    an extra expert without a word (vLLM's FusedMoE loader maps ids 0..E-1 only)."""
    layout = expert_layout(model_dir)
    if layout is None:
        return
    layout.check_complete(name for _, name, _, _ in tensor_infos(model_dir))


def _ckpt_proj(layer, shard_id: str) -> str:
    """The checkpoint's projection name for a FusedMoE shard id (w1: gate, w3: up, w2: down)."""
    return {"w1": layer.ckpt_gate_proj_name, "w2": layer.ckpt_down_proj_name,
            "w3": layer.ckpt_up_proj_name}.get(shard_id, shard_id)


def check_expert_partition(scheme: FP4Scheme, where: str, H: int, I: int, tp_size: int = 1) -> None:
    """The sharding rules of FP4 experts on one tensor-parallel rank (H: hidden size; I: intermediate size per rank,
    the full one split over tp_size ranks: w1 / w3 by rows, w2 by columns, i.e. along w2's K). A rule broken is one
    UnsupportedShape naming the layer, the size per rank, the tensor-parallel size and the rule. Sizes the rules allow
    and a kernel's tiles do not are the kernel selection's to refuse (docs/kernel-selection.md#tensor-parallelism)."""
    B = scheme.block
    for what, v, full in (("hidden_size H", H, H), ("intermediate_size I", I, I * tp_size)):
        if v % B:
            size = (f"{what}={v} per rank (intermediate_size {full} at tensor-parallel size {tp_size})"
                    if what.startswith("inter") and tp_size > 1 else f"{what}={v}")
            raise UnsupportedShape(f"{where}: {size} breaks a rule of scheme {scheme.describe()}: it must be a "
                                   f"multiple of the {scheme.format} block size {B} (a block and its scale live on "
                                   f"one rank; FP4 packs 2 values per byte along K)")


class CubladeFp4MoEMethod(FusedMoEMethodBase):
    """FP4 experts of one FusedMoE layer (see the module docstring)."""

    def __init__(self, scheme: FP4Scheme, moe: FusedMoEConfig, prefix: str = ""):
        where = prefix or "FusedMoE layer"
        if not isinstance(scheme, FP4Scheme):
            raise NotImplementedError(
                f"{where}: cublade serves MoE experts in fp4 (preset fp4-experts-fp8-dense), not "
                f"{scheme.describe()}; put the experts in the policy's ignore list or quantize them with fp4")
        super().__init__(moe)
        self.scheme = scheme
        self.prefix = prefix
        self.kernel: MoEKernel | None = None
        # (suffix, shard id, global expert id) of every checkpoint tensor loaded: vLLM's loader checks that each
        # parameter got something, not that every expert's slice of it did.
        self._loaded: set[tuple[str, str, int]] = set()
        if not moe.is_act_and_mul or moe.activation != MoEActivation.SILU:
            raise NotImplementedError(f"{where}: cublade FP4 experts support the gated SiLU (SwiGLU) of "
                                      f"Mixtral-style experts, not activation {moe.activation.value!r}")
        if moe.has_bias:
            raise NotImplementedError(f"{where}: cublade FP4 experts have no bias (the checkpoint format "
                                      f"stores none)")

    # --- parameters -----------------------------------------------------------------------------------
    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        E, H, I = num_experts, hidden_size, intermediate_size_per_partition
        where = self.prefix or getattr(layer, "layer_name", "FusedMoE layer")
        if layer.apply_router_weight_on_input:
            raise NotImplementedError(f"{where}: apply_router_weight_on_input is not supported by cublade's "
                                      f"FP4 experts")
        check_expert_partition(self.scheme, where, H, I, layer.moe_config.moe_parallel_config.tp_size)
        self._sizes = (E, H, I)
        group = {"quant_method": FusedMoeWeightScaleSupported.GROUP.value}
        tensor = {"quant_method": FusedMoeWeightScaleSupported.TENSOR.value}
        for w, (N, K) in (("w13", (2 * I, H)), ("w2", (H, I))):
            for suffix, (shape, dtype) in self.scheme.tensor_specs(N, K).items():
                if suffix == "weight_global_scale":  # one per checkpoint tensor: w1 and w3 of each expert
                    full, attrs = ((E, 2) if w == "w13" else (E,)), tensor
                else:
                    full, attrs = (E, *shape), (group if suffix == "weight_scale" else {})
                p = torch.nn.Parameter(torch.zeros(full, dtype=dtype), requires_grad=False)
                layer.register_parameter(f"{w}_{suffix}", p)
                set_weight_attrs(p, {**extra_weight_attrs, **attrs})
                p.weight_loader = self._checked_loader(layer, suffix, extra_weight_attrs["weight_loader"])

    def _checked_loader(self, layer, suffix: str, loader):
        """vLLM's FusedMoE loader, after a check that names the checkpoint tensor: copy_ would broadcast or
        cast a tensor of the wrong shape or dtype silently (or fail without naming it)."""

        def load(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
            self._check_loaded(layer, suffix, param, loaded_weight, shard_id, expert_id)
            ok = loader(param, loaded_weight, weight_name, shard_id, expert_id, return_success=return_success)
            if ok is not False:  # False: the expert lives on another rank
                self._loaded.add((suffix, shard_id, expert_id))
            return ok

        return load

    def _check_loaded(self, layer, suffix, param, t, shard_id, expert_id) -> None:
        name = f"{layer.layer_name}.{expert_id}.{_ckpt_proj(layer, shard_id)}.{suffix}"
        if t.dim() == 3:
            raise ValueError(f"{name}: a fused 3-D expert tensor {list(t.shape)} in a cublade checkpoint; cublade "
                             f"checkpoints store experts per expert (cublade convert splits fused layouts)")
        if expert_id >= layer.global_num_experts:
            raise ValueError(f"{name}: expert id {expert_id}, but the model has {layer.global_num_experts} experts")
        if t.dtype != param.dtype:
            raise ValueError(f"{name}: dtype {t.dtype}, expected {param.dtype} for scheme "
                             f"{self.scheme.describe()}")
        if suffix == "weight_global_scale":
            want = (1,)
            got = (t.numel(),)
        else:
            tp = layer.moe_config.moe_parallel_config.tp_size
            rows, cols = param.shape[1:]
            # Per checkpoint tensor: w1/w3 are [I_full, H/..] (split by rows), w2 is [H, I_full/..] (by columns).
            want = (rows // 2 * tp, cols) if shard_id in ("w1", "w3") else (rows, cols * tp)
            got = tuple(t.shape)
        if got != want:
            E, H, I = self._sizes
            raise ValueError(f"{name}: shape {list(t.shape)}, expected {list(want)} for scheme "
                             f"{self.scheme.describe()} (hidden_size={H}, intermediate_size="
                             f"{I * layer.moe_config.moe_parallel_config.tp_size}, block {self.scheme.block})")

    # --- after loading: checks and the kernel ---------------------------------------------------------
    def _check_complete(self, layer) -> None:
        """Every local expert got w1, w3 and w2 of every tensor the scheme has."""
        E, H, I = self._sizes
        N_K = {"w1": (I, H), "w3": (I, H), "w2": (H, I)}
        for g in range(layer.global_num_experts):
            if layer._map_global_expert_id_to_local_expert_id(g) == -1:
                continue
            for shard in ("w1", "w3", "w2"):
                for suffix in self.scheme.tensor_specs(*N_K[shard]):
                    if (suffix, shard, g) not in self._loaded:
                        name = f"{layer.layer_name}.{g}.{_ckpt_proj(layer, shard)}.{suffix}"
                        raise ValueError(f"{name}: missing from the checkpoint (scheme "
                                         f"{self.scheme.describe()}; other experts have it)")

    def process_weights_after_loading(self, layer) -> None:
        where = self.prefix or layer.layer_name
        if not self._loaded:
            # Nothing came through the loader: vLLM's dummy weights (--load-format dummy) or a test. Random
            # bytes are no checkpoint to check; pick the kernel and run on them.
            logger.warning("cublade: %s: no expert tensors were loaded (dummy weights?); skipping the checks",
                           where)
            self.kernel = select_moe_kernel(layer, self.scheme, where)
            return
        self._check_complete(layer)
        if self.scheme.format is Fp4Format.MXFP4:
            for w in ("w13", "w2"):
                bad = (getattr(layer, f"{w}_weight_scale") == E8M0_NAN)
                if bad.any():
                    e = int(bad.nonzero()[0, 0])
                    raise ValueError(f"{where}.{w}_weight_scale: expert {e} has an E8M0 NaN scale (code "
                                     f"{E8M0_NAN}); the checkpoint is corrupt")
        else:
            for w in ("w13", "w2"):
                g = getattr(layer, f"{w}_weight_global_scale")
                if not (torch.isfinite(g).all() and (g > 0).all()):
                    raise ValueError(f"{where}.{w}_weight_global_scale: every nvfp4 global scale must be finite "
                                     f"and > 0, got {g.flatten()[:8].tolist()}")
        self.kernel = select_moe_kernel(layer, self.scheme, where)

    def get_fused_moe_quant_config(self, layer) -> FusedMoEQuantConfig | None:
        # The experts run in this method's apply() (the old, non-modular path: vLLM's router picks top-k,
        # then apply()); vLLM's modular kernels never see these weights.
        return FusedMoEQuantConfig.make()

    def maybe_make_prepare_finalize(self, routing_tables=None):
        if self.moe.moe_parallel_config.use_all2all_kernels:
            raise NotImplementedError(f"{self.prefix}: cublade FP4 experts do not support expert-parallel "
                                      f"all2all kernels; serve without --enable-expert-parallel")
        return None

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        if self.kernel is None:
            raise RuntimeError(f"{self.prefix}: apply() before process_weights_after_loading()")
        return self.kernel.apply(layer, x, topk_weights, topk_ids)
