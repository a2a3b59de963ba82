"""Kernel choice for cublade's vLLM layers: linear layers (cublade.vllm.linear) and FusedMoE experts
(cublade.vllm.moe). One kernel class per module here (base.py says what a kernel is); this module holds the
ordered candidates per scheme and the one selector.

The selector walks the scheme's candidates in order and takes the first that can run the layer: cublade's own op
where it exists, else a named fallback, and last the pure-PyTorch reference (the CPU path, bit-exact to
`scheme.linear_ref`; on a GPU only with CUBLADE_ALLOW_REFERENCE=1, so that no layer runs fp32 math by surprise). It
logs one line per distinct choice, with the reason, and the reasons of the candidates it passed over; if none can
run the layer it raises one error listing them all. `CUBLADE_DISABLED_KERNELS=name,name`
takes kernels out of the running (as VLLM_DISABLED_KERNELS does). Why each list is in this order:
docs/kernel-selection.md.
"""
from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from cublade.config import FP4Scheme, Fp8Scheme, MXFP8Scheme, Scheme, W4A16Scheme
from cublade.vllm.kernels.base import LinearKernel, MoEKernel
from cublade.vllm.kernels.cublade_fp4_moe import CubladeFp4MoE
from cublade.vllm.kernels.cublade_fp8_gemm import CubladeFp8Gemm
from cublade.vllm.kernels.cublade_fp8_w8a16 import CubladeFp8W8A16
from cublade.vllm.kernels.cublade_fp8_wgmma import CubladeFp8Wgmma
from cublade.vllm.kernels.cublade_mxfp8_dequant_matmul import CubladeMxfp8DequantMatmul
from cublade.vllm.kernels.cublade_mxfp8_gemm import CubladeMxfp8Gemm
from cublade.vllm.kernels.cublade_mxfp8_gemm_sm80 import CubladeMxfp8GemmSm80
from cublade.vllm.kernels.cublade_mxfp8_measured import CubladeMxfp8Measured
from cublade.vllm.kernels.cublade_w4a16_fp8_prefill import CubladeW4A16Fp8Prefill
from cublade.vllm.kernels.cublade_w4a16_gemm import CubladeW4A16Gemm
from cublade.vllm.kernels.cublade_w4a16_gemm_sm80 import CubladeW4A16GemmSm80
from cublade.vllm.kernels.cublade_w4a16_measured import CubladeW4A16Measured
from cublade.vllm.kernels.reference import ReferenceKernel
from cublade.vllm.kernels.reference_moe import ReferenceMoE
from cublade.vllm.kernels.vllm_cutlass_scaled_mm import VllmCutlassScaledMM
from cublade.vllm.kernels.vllm_machete import VllmMachete
from cublade.vllm.kernels.vllm_marlin import VllmMarlin
from cublade.vllm.kernels.vllm_marlin_fp8 import VllmMarlinFp8
from cublade.vllm.kernels.vllm_marlin_moe import VllmMarlinMoE
from cublade.vllm.kernels.vllm_marlin_mxfp8 import VllmMarlinMxfp8

logger = logging.getLogger("vllm.cublade")

# The candidates per scheme, first that can run the layer wins.
CANDIDATES: dict[type[Scheme], tuple[type[LinearKernel] | type[MoEKernel], ...]] = {
    # Per-token dynamic layers on Hopper: cublade's FP8 decode GEMM for small batches, vLLM's CUTLASS above; then,
    # when asked for, cublade's wgmma GEMM where it measured faster than CUTLASS at load, CUTLASS elsewhere. Else
    # vLLM's CUTLASS (W8A8 on FP8 tensor cores, sm_89+), activations quantized by cublade's per-token / per-tensor
    # op; without FP8 tensor cores (sm_80 / sm_86) W8A16 on the 1-byte codes: vLLM's FP8 Marlin, then cublade's
    # sm_80 kernel. On sm_80-89 vLLM's Marlin kernels come before cublade's sm_80 kernels for every scheme: measured
    # through the PTX on an H200 (docs/decisions.md, "sm_80 kernels after Marlin"), the sm_80 kernels match Marlin
    # at 1-8 tokens and fall to 0.2-0.6x from 16.
    Fp8Scheme: (CubladeFp8Gemm, CubladeFp8Wgmma, VllmCutlassScaledMM, VllmMarlinFp8, CubladeFp8W8A16,
                ReferenceKernel),
    # The FP8 tensor-core path first, but only when asked for (CUBLADE_W4A16_PREFILL=fp8): it rounds activations.
    # Then, when asked for (CUBLADE_W4A16_PREFILL=machete,humming), cublade's kernels with the named vLLM kernels at
    # the token counts where one measured faster (a copy of the weights each); then the Hopper kernels, vLLM's
    # Machete (Hopper) and Marlin; the sm_80 kernel for what Marlin refuses.
    W4A16Scheme: (CubladeW4A16Fp8Prefill, CubladeW4A16Measured, CubladeW4A16Gemm, VllmMachete, VllmMarlin,
                  CubladeW4A16GemmSm80, ReferenceKernel),
    # W8A16 on the 1-byte weights (bf16 activations): when asked for (CUBLADE_MXFP8_PREFILL=humming), cublade's
    # kernels with vLLM's Humming at the token counts where it measured faster (a copy of the weights); the Hopper
    # kernels; then Marlin (fp16 activations, block scales above 2^7); the sm_80 kernel; then dequantize to the
    # activation dtype with cublade's op and a dense GEMM (no MX tensor cores before sm_100).
    MXFP8Scheme: (CubladeMxfp8Measured, CubladeMxfp8Gemm, VllmMarlinMxfp8, CubladeMxfp8GemmSm80,
                  CubladeMxfp8DequantMatmul, ReferenceKernel),
    # MoE experts only (the linear method refuses fp4): kernels of a FusedMoE layer.
    FP4Scheme: (CubladeFp4MoE, VllmMarlinMoE, ReferenceMoE),
}

_logged: set[tuple] = set()


def disabled_kernels() -> set[str]:
    return {k.strip() for k in os.environ.get("CUBLADE_DISABLED_KERNELS", "").split(",") if k.strip()}


def first_runnable(candidates, can_implement: Callable[[type], tuple[bool, str]]
                   ) -> tuple[type | None, str, list[str]]:
    """(first candidate not disabled by CUBLADE_DISABLED_KERNELS whose can_implement says yes, its reason,
    the candidates passed over with why); the kernel is None when none can."""
    disabled = disabled_kernels()
    skipped: list[str] = []
    for k in candidates:
        if k.name in disabled:
            skipped.append(f"{k.name}: disabled by CUBLADE_DISABLED_KERNELS")
            continue
        ok, reason = can_implement(k)
        if ok:
            return k, reason, skipped
        skipped.append(f"{k.name}: {reason}")
    return None, "", skipped


def log_choice_once(key: tuple, msg: str, *args) -> None:
    """One log line per distinct kernel choice (key), however many layers make it."""
    if key not in _logged:
        _logged.add(key)
        logger.info(msg, *args)


def add_to_compile_key(kernel: str) -> None:
    """Make a kernel choice part of the key under which vLLM caches compiled models. vLLM 0.26 stores a compiled model
    (VLLM_USE_AOT_COMPILE) under a hash of its config, its environment and its source files, none of which says which
    kernel cublade chose for a layer, so a model compiled with one choice would be loaded for another: with
    CUBLADE_DISABLED_KERNELS changed between two runs, the cached graph called cublade's mxfp8_gemm on the weights
    Marlin had repacked (seen on an H200). The kernels chosen while the model loads go, sorted, into the current
    config's `additional_config` (a dict that `VllmConfig.compute_hash` hashes as JSON) under "cublade_kernels"; the
    cache key is computed at the first compiled call, after loading. No current config (tests building a layer
    alone) or a non-dict additional_config: nothing is recorded."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None or not isinstance(config.additional_config, dict):
        return
    chosen = config.additional_config.setdefault("cublade_kernels", [])
    if kernel not in chosen:
        chosen.append(kernel)
        chosen.sort()


def select(scheme: Scheme, layer: torch.nn.Module, args: tuple, subject: str, failure: str):
    """The first candidate for `scheme` that can run `layer` (`can_implement(*args)`), constructed with `args` (it
    repacks the layer's weights once). `subject` names the layers in the log line, `failure` starts the error."""
    candidates = CANDIDATES.get(type(scheme))
    if candidates is None:
        raise NotImplementedError(f"{failure}: cublade has no kernel for it")
    k, reason, skipped = first_runnable(candidates, lambda k: k.can_implement(*args))
    if k is None:
        raise NotImplementedError(f"{failure}: " + "; ".join(skipped))
    log_choice_once((scheme.describe(), str(layer.params_dtype), k.name, reason, tuple(skipped)),
                    "cublade: %s run on %s%s: %s%s", subject, k.name, "" if k.own else " (fallback)", reason,
                    f"; passed over {'; '.join(skipped)}" if skipped else "")
    add_to_compile_key(k.name)
    return k(*args)


def per_rank(tp_size: int) -> str:
    """What a layer's shape is under tensor parallelism, for the log and the errors ("" on one rank)."""
    return f" per rank at tensor-parallel size {tp_size}" if tp_size > 1 else ""


def select_kernel(layer: torch.nn.Module, prefix: str) -> LinearKernel:
    """The kernel of a linear layer (its scheme: layer.cublade_scheme)."""
    scheme: Scheme = layer.cublade_scheme
    shape = (f"[N={layer.output_size_per_partition}, K={layer.input_size_per_partition}"
             f"{per_rank(getattr(layer, 'tp_size', 1))}, {layer.params_dtype}]")
    return select(scheme, layer, (layer,), f"{scheme.describe()} layers like {prefix} {shape}",
                  f"{prefix}: no kernel can run scheme {scheme.describe()} {shape}")


def select_moe_kernel(layer: torch.nn.Module, scheme: FP4Scheme, where: str) -> MoEKernel:
    """The kernel of a FusedMoE layer's experts."""
    E, I2, _ = layer.w13_weight_packed.shape
    tp = getattr(getattr(getattr(layer, "moe_config", None), "moe_parallel_config", None), "tp_size", 1)
    shape = f"[E={E}, H={layer.w2_weight_packed.shape[1]}, I={I2 // 2}{per_rank(tp)}, {layer.params_dtype}]"
    return select(scheme, layer, (layer, scheme), f"MoE experts {scheme.describe()} like {where} {shape}",
                  f"{where}: no kernel can run MoE experts {scheme.describe()} {shape}")

