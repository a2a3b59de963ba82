"""vLLM FusedMoE quantization method for FP4 (MXFP4 / NVFP4) experts: FP4 storage, bf16 math.

Entry point for the cublade QuantizationConfig (plugin/vllm/config.py): for a FusedMoE layer whose expert
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

Kernel choice (one per layer, in process_weights_after_loading; first that can run the layer wins; logged
once per distinct choice with the reason; CUBLADE_DISABLED_KERNELS=name,... takes kernels out):
  cublade-fp4-moe    cublade's FP4 dequant-GEMM op (cublade.ops.fp4_gemm), CUDA, bf16: one grouped call per
                     projection, between cublade.ops.moe_glue's moe_route (tokens sorted by expert on the
                     device) and moe_finalize (the top-k weighted sum); CUDA-graph capturable
  vllm-marlin-moe    fallback: vLLM's fused Marlin MoE (FP4 weights, bf16/fp16 activations), CUDA; weights
                     repacked once into Marlin's layout. NVFP4 needs one global scale per expert for w1 and w3.
  reference          pure PyTorch: every expert linear is scheme.linear_ref on the stored FP4 tensors (the
                     reference backend's numerics, cublade.numerics.moe.experts_forward_ref); the CPU path. On a GPU
                     it is the last resort: slow, and it syncs with the host, so it refuses CUDA-graph capture
                     (serve with --enforce-eager).
"""
from __future__ import annotations

import logging
import types
from typing import ClassVar

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import FusedMoeWeightScaleSupported
from vllm.model_executor.utils import set_weight_attrs

from cublade.checkpoint import tensor_infos
from cublade.config.experts import expert_layout
from cublade.config.schemes import FP4Scheme, UnsupportedShape
from cublade.numerics.constants import E8M0_NAN
from cublade.numerics.moe import experts_forward_ref
from cublade.vllm.kernels import (add_to_compile_key, first_runnable, log_choice_once, replace_parameter,
                                  why_no_kernel)

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
        B = self.scheme.block
        for what, v in (("hidden_size", H), ("intermediate_size per TP rank", I)):
            if v % B:
                raise UnsupportedShape(f"{where}: not supported by scheme fp4 because {what}={v} is not a "
                                       f"multiple of the {self.scheme.format} block size {B}")
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
        if self.scheme.format == "mxfp4":
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


# --- kernels ---------------------------------------------------------------------------------------------

def expert_tensors(layer, scheme: FP4Scheme, e: int, proj: str) -> dict[str, torch.Tensor]:
    """One expert linear's tensors in the checkpoint layout (views into the layer's stacked parameters)."""
    I = layer.w13_weight_packed.shape[1] // 2
    w, rows = ("w2", slice(None)) if proj == "down" else ("w13", slice(0, I) if proj == "gate" else slice(I, 2 * I))
    t = {"weight_packed": getattr(layer, f"{w}_weight_packed")[e, rows],
         "weight_scale": getattr(layer, f"{w}_weight_scale")[e, rows]}
    if scheme.format == "nvfp4":
        g = getattr(layer, f"{w}_weight_global_scale")
        t["weight_global_scale"] = g[e, 0 if proj == "gate" else 1].reshape(1) if w == "w13" else g[e].reshape(1)
    return t


def local_topk_ids(layer, topk_ids: torch.Tensor) -> torch.Tensor:
    """Global expert ids -> this rank's (expert parallel: -1 for experts held elsewhere)."""
    expert_map = getattr(layer, "expert_map", None)
    return topk_ids if expert_map is None else expert_map[topk_ids.long()]


class MoEKernel:
    name: ClassVar[str] = ""
    own: ClassVar[bool] = True  # cublade's own op (False: a named fallback)

    @classmethod
    def can_implement(cls, layer, scheme: FP4Scheme) -> tuple[bool, str]:
        raise NotImplementedError

    def __init__(self, layer, scheme: FP4Scheme):
        self.scheme = scheme

    def apply(self, layer, x, topk_weights, topk_ids) -> torch.Tensor:
        raise NotImplementedError


class ReferenceMoE(MoEKernel):
    """Pure PyTorch, from the stored FP4 tensors (scheme.linear_ref per expert linear)."""
    name = "reference"

    @classmethod
    def can_implement(cls, layer, scheme):
        if layer.w13_weight_packed.is_cuda:
            return True, "last resort on a GPU: dequantizes every expert on every call and syncs with the host"
        return True, "pure-PyTorch reference (scheme.linear_ref per expert), the CPU path"

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


class CubladeFp4MoE(MoEKernel):
    """cublade's FP4 GEMM (cublade.ops.fp4_gemm), grouped over experts: one call for w13 and one for w2 per
    layer, tokens sorted by expert and the outputs combined by cublade.ops.moe_glue's two ops (no host sync:
    CUDA-graph capturable)."""
    name = "cublade-fp4-moe"

    @classmethod
    def can_implement(cls, layer, scheme):
        w = layer.w13_weight_packed
        if not w.is_cuda:
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
        from cublade.ops.fp4_gemm import fp4_repack

        E, I2, _ = layer.w13_weight_packed.shape
        self.num_experts, self.I, self.H = E, I2 // 2, layer.w2_weight_packed.shape[1]
        # The kernel's tiled layout (fp4_repack, see cublade.ops.fp4_gemm), made once; the checkpoint-layout
        # parameters are dropped. nvfp4: w13's [E, 2] global scales become per-row scales of w1 and w3 rows.
        nv = scheme.format == "nvfp4"
        for w in ("w13", "w2"):
            rp = fp4_repack(getattr(layer, f"{w}_weight_packed").data, getattr(layer, f"{w}_weight_scale").data,
                            scheme.format, getattr(layer, f"{w}_weight_global_scale").data if nv else None)
            for name in ("weight_packed", "weight_scale", "weight_global_scale"):
                replace_parameter(layer, f"{w}_{name}", None)
            replace_parameter(layer, f"{w}_fp4_packed", rp.packed)
            replace_parameter(layer, f"{w}_fp4_row_scale", rp.row_scale)

    def apply(self, layer, x, topk_weights, topk_ids):
        from cublade.ops.fp4_gemm import fp4_gemm
        from cublade.ops.moe_glue import moe_finalize, moe_route, silu_mul

        T, k = topk_ids.shape
        I, H = self.I, self.H
        fmt = self.scheme.format
        # Rows sorted by expert (ids of other ranks' experts dropped), then the two grouped GEMMs, then the top-k
        # weighted sum: cublade.ops.moe_glue's two ops around the GEMMs (a reference path off the GPU).
        E = self.num_experts
        xs, offsets, pos = moe_route(local_topk_ids(layer, topk_ids), x, E)
        # max_m bounds an expert's rows and picks the streaming (decode) kernel's tokens per pass (8 / 16 / 32). T is a
        # true bound (top-k picks distinct experts) but runs 16- or 32-token passes where a balanced routing gives an
        # expert ~T k / E rows; twice that mean is the bound used (an expert with more rows takes one more pass,
        # still correct). Mixtral-size w13 + w2 at 16 / 32 tokens: 275 / 399 us with max_m = T, 241 / 278 with twice
        # the mean (ninth session, benchmarks/tuning/experiments/fp4_moe_maxm.py). From 16 rows per expert (T k / E)
        # fp4_gemm runs its wgmma kernel instead, which picks its own tokens per pass (tenth session).
        max_m = min(T, -(-2 * T * k // E))
        # Each intermediate is dropped once used, so the caching allocator reuses it for the next (w2's x workspace
        # among them): the layer's peak is what vLLM's profiling run charges against the KV cache.
        h = fp4_gemm(xs, layer.w13_fp4_packed, getattr(layer, "w13_fp4_row_scale", None), fmt, 2 * I, offsets, max_m)
        del xs
        a = silu_mul(h)
        del h
        y = fp4_gemm(a, layer.w2_fp4_packed, getattr(layer, "w2_fp4_row_scale", None), fmt, H, offsets, max_m)
        del a
        return moe_finalize(y, pos, topk_weights).to(x.dtype)


class VllmMarlinMoE(MoEKernel):
    """Fallback: vLLM's fused Marlin MoE kernel over FP4 weights (bf16/fp16 activations)."""
    name = "vllm-marlin-moe"
    own = False

    @classmethod
    def can_implement(cls, layer, scheme):
        w = layer.w13_weight_packed
        if not w.is_cuda:
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
        if scheme.format == "nvfp4":
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
        if scheme.format == "mxfp4":
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


CANDIDATES: list[type[MoEKernel]] = [CubladeFp4MoE, VllmMarlinMoE, ReferenceMoE]


def select_moe_kernel(layer, scheme: FP4Scheme, where: str) -> MoEKernel:
    """The first candidate that can run the layer, constructed (it repacks the layer's weights once)."""
    k, reason, skipped = first_runnable(CANDIDATES, lambda k: k.can_implement(layer, scheme))
    if k is None:
        raise NotImplementedError(f"{where}: no kernel can run MoE experts {scheme.describe()}: " + "; ".join(skipped))
    E, I2, _ = layer.w13_weight_packed.shape
    log_choice_once((scheme.describe(), str(layer.params_dtype), k.name, reason, tuple(skipped)),
                    "cublade: MoE experts %s like %s [E=%d, H=%d, I=%d, %s] run on %s%s: %s%s",
                    scheme.describe(), where, E, layer.w2_weight_packed.shape[1], I2 // 2, layer.params_dtype,
                    k.name, "" if k.own else " (fallback)", reason,
                    f"; passed over {'; '.join(skipped)}" if skipped else "")
    add_to_compile_key(k.name)
    return k(layer, scheme)
