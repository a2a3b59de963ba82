"""Kernel choice for cublade's linear layers: a scheme says what the weights are, a kernel says whether it
can run a given layer (`can_implement(layer) -> (ok, reason)`) and how.

One selector (`select_kernel`) walks the scheme's candidates in order and takes the first that can run the
layer: cublade's own op where it exists, else a named fallback, and last the pure-PyTorch reference (the CPU
path, bit-exact to `scheme.linear_ref`). It logs one line per distinct choice, with the reason, and the
reasons of the candidates it passed over; if none can run the layer it raises one error listing them all.
`CUBLADE_DISABLED_KERNELS=name,name` takes kernels out of the running (as VLLM_DISABLED_KERNELS does).

Candidates per scheme (first that can run the layer wins):
  fp8    vllm-cutlass-scaled-mm (fallback: cublade has no FP8 GEMM of its own; activations are quantized by
         cublade's per-token / per-tensor op)  ->  reference
  w4a16  cublade-w4a16-gemm  ->  vllm-machete (fallback, sm_90)  ->  vllm-marlin (fallback)  ->  reference
  mxfp8  cublade-mxfp8-gemm (W8A16 on the 1-byte weights, bf16 activations)  ->  vllm-marlin-mxfp8 (fallback: fp16
         activations, block scales above 2^7)  ->  cublade-mxfp8-dequant-matmul (no MX tensor cores before sm_100:
         dequantize to the activation dtype with cublade's op, then a dense GEMM)  ->  reference

The layer a kernel sees holds the scheme's tensors in cublade's checkpoint layout (cublade.config.schemes),
as plain Parameters, after cublade.vllm.linear brought them there; a kernel repacks them once, in its
constructor (called from process_weights_after_loading), and `apply` runs on what it left. Op choices that
depend on the device are made in the constructor too, so `apply` holds no Python dispatch and traces under
torch.compile(fullgraph=True), as vLLM compiles models.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, ClassVar

import torch

from cublade.config import Fp8Scheme, MXFP8Scheme, Scheme, W4A16Scheme
from cublade.ops.fp8_quant_per_tensor import fp8_quant_per_tensor_ref
from cublade.ops.fp8_quant_per_token import fp8_quant_per_token_ref
from cublade.ops import mxfp8_gemm as mxfp8_ops
from cublade.ops import w4a16_gemm as w4a16_ops
from cublade.ops.mxfp8_quant import mxfp8_dequant_ref  # (`cublade.ops.mxfp8_quant` is the op, not the module)
from cublade.ops._dispatch import use_kernel

logger = logging.getLogger("vllm.cublade")

HALF_DTYPES = (torch.bfloat16, torch.float16)


def _capability(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def _gpu_half(layer: torch.nn.Module, device: torch.device) -> tuple[int | None, str]:
    """(the GPU's sm number, "") for a layer on a CUDA device with bf16/fp16 activations, else (None, why not):
    the first two checks of every GPU kernel here."""
    cap = _capability(device)
    if cap is None:
        return None, "needs a CUDA device"
    if layer.params_dtype not in HALF_DTYPES:
        return None, f"takes bf16/fp16 activations, the model runs in {layer.params_dtype}"
    return cap, ""


# cublade's CUDA extension is built for sm_90a (setup.py), whose code runs on sm_90 only.
KERNEL_ARCH = 90


def why_no_kernel(name: str, device: torch.device) -> str | None:
    """Why cublade's CUDA op `torch.ops.cublade.<name>` cannot run on `device`; None when it can."""
    cap = _capability(device)
    if cap is None:
        return "CPU"
    if cap != KERNEL_ARCH:
        return f"cublade's kernels are built for sm_90a, this GPU is sm_{cap}"
    if not use_kernel(torch.empty(0, device=device), name):
        return "cublade's CUDA extension has no such op: not built?"
    return None


def _op(name: str, device: torch.device, reference: Callable) -> tuple[Callable, str]:
    """cublade's CUDA op `torch.ops.cublade.<name>` where it can run, else its reference; and a few words
    saying which."""
    why = why_no_kernel(name, device)
    if why is None:
        return getattr(torch.ops.cublade, name), f"cublade's CUDA op {name}"
    return reference, f"the PyTorch reference of {name} ({why})"


def layer_tensors(layer: torch.nn.Module, scheme: Scheme) -> dict[str, torch.Tensor]:
    """The scheme's tensors as the layer holds them (cublade's layout, one fused matrix)."""
    N, K = layer.output_size_per_partition, layer.input_size_per_partition
    return {name: getattr(layer, name) for name in scheme.tensor_specs(N, K)}


class LinearKernel:
    """Runs one layer. Subclasses set `name`, `own` (cublade's own op, or a fallback named as such)."""
    name: ClassVar[str] = ""
    own: ClassVar[bool] = False

    @classmethod
    def can_implement(cls, layer: torch.nn.Module) -> tuple[bool, str]:
        raise NotImplementedError

    def __init__(self, layer: torch.nn.Module):
        self.scheme = layer.cublade_scheme

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class ReferenceKernel(LinearKernel):
    """scheme.linear_ref on the layer's tensors: dequantize-in-fp32 math, any device. The CPU path; on a GPU
    the last resort (e.g. fp32 activations, which no tensor-core kernel takes)."""
    name = "reference"
    own = True

    @classmethod
    def can_implement(cls, layer):
        return True, "pure-PyTorch reference (cublade.ops), fp32 math on any device"

    def apply(self, layer, x, bias):
        return self.scheme.linear_ref(x, layer_tensors(layer, self.scheme), bias)


# ---- fp8 ------------------------------------------------------------------------------------------------

def _fp8_input_quant(scheme: Fp8Scheme, device: torch.device) -> tuple[Callable, str]:
    """(x2d, input_scale) -> (e4m3, fp32 scale [M, 1] or [1]), bound to cublade's op or its reference."""
    if scheme.activations == "dynamic-token":
        fn, how = _op("fp8_quant_per_token", device, fp8_quant_per_token_ref)
        return (lambda x, s: fn(x)), how
    fn, how = _op("fp8_quant_per_tensor", device, fp8_quant_per_tensor_ref)
    if scheme.activations == "dynamic-tensor":
        return (lambda x, s: fn(x, None)), how
    return (lambda x, s: fn(x, s.float())), how  # the op takes an fp32 scale


class VllmCutlassScaledMM(LinearKernel):
    """vLLM's CUTLASS scaled-mm (a fallback: cublade has no FP8 GEMM of its own). Activations are quantized
    by cublade's op; the epilogue applies the activation scale (per token or per tensor) and the weight
    scale (per channel or per tensor)."""
    name = "vllm-cutlass-scaled-mm"
    own = False

    @classmethod
    def can_implement(cls, layer):
        cap, why = _gpu_half(layer, layer.weight.device)
        if cap is None:
            return False, why
        try:
            from vllm import _custom_ops as ops

            supported = ops.cutlass_scaled_mm_supports_fp8(cap)
        except (AttributeError, RuntimeError) as e:
            return False, f"vLLM's _C has no cutlass_scaled_mm ({e})"
        if not supported:
            return False, f"vLLM's CUTLASS FP8 GEMM does not run on sm_{cap}"
        N, K = layer.output_size_per_partition, layer.input_size_per_partition
        if N % 16 or K % 16:
            return False, f"N={N}, K={K} are not multiples of 16"
        return True, f"FP8 tensor cores on sm_{cap}"

    def __init__(self, layer):
        super().__init__(layer)
        self.quant_input, self.quant_how = _fp8_input_quant(self.scheme, layer.weight.device)

    def apply(self, layer, x, bias):
        from vllm import _custom_ops as ops

        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = self.quant_input(x2, getattr(layer, "input_scale", None))
        # CUTLASS takes B column-major: the [N, K] row-major weight transposed is exactly that (no copy).
        y = ops.cutlass_scaled_mm(xq, layer.weight.t(), scale_a=xs, scale_b=layer.weight_scale,
                                  out_dtype=x.dtype, bias=bias)
        return y.reshape(*x.shape[:-1], -1)


# ---- w4a16 ----------------------------------------------------------------------------------------------

class CubladeW4A16Gemm(LinearKernel):
    """cublade's W4A16 GEMM (cublade.ops.w4a16_gemm) on weights repacked once by `w4a16_repack` into the
    kernel's tile layout. The op runs decode batches on its streaming kernel (up to 16 tokens) and its wide
    wgmma kernel (from 17, at group size 128 or per channel; from 9 on weights of 2^27 elements or more) and, from
    448 tokens (640 on weights of 2^27 elements or more; 128 at other group sizes), dequantizes the weight and runs
    a dense cuBLAS GEMM (the prefill path; a transient N x K weight in x's dtype per call).
    Sending large M to Machete instead would keep a second, Machete-layout copy of the weights (twice the
    memory W4A16 is there to save). Speeds against Machete/Marlin per M: benchmarks/RESULTS.md;
    `CUBLADE_DISABLED_KERNELS=cublade-w4a16-gemm` runs Machete/Marlin for every M instead."""
    name = "cublade-w4a16-gemm"
    own = True

    @classmethod
    def can_implement(cls, layer):
        device = layer.weight_packed.device
        if layer.params_dtype not in HALF_DTYPES:
            return False, f"takes bf16/fp16 activations, the model runs in {layer.params_dtype}"
        why = why_no_kernel("w4a16_gemm", device)
        if why is not None:
            return False, why
        return True, "cublade's CUDA op w4a16_gemm (decode kernels; from 448-640 tokens dequantize + cuBLAS)"

    def __init__(self, layer):
        super().__init__(layer)
        self.gemm, _ = _op("w4a16_gemm", layer.weight_packed.device, w4a16_ops.w4a16_gemm_ref)
        zp = getattr(layer, "weight_zero_point", None)
        rp = w4a16_ops.w4a16_repack(layer.weight_packed.data, layer.weight_scale.data,
                                    None if zp is None else zp.data, self.scheme.group_size)
        self.group_size, self.symmetric, self.size_n = rp.group_size, rp.symmetric, rp.size_n
        # one blob: the kernel's tiles with their scales interleaved
        replace_parameter(layer, "weight_packed", rp.packed)
        replace_parameter(layer, "weight_scale", None)
        replace_parameter(layer, "weight_zero_point", None)  # folded into the blob's scale records

    def apply(self, layer, x, bias):
        y = self.gemm(x, layer.weight_packed, self.group_size, self.symmetric, self.size_n)
        return y if bias is None else y + bias


class _VllmMixedPrecision(LinearKernel):
    """Adapter over vLLM's MPLinearKernel classes (Machete, Marlin): they read compressed-tensors' int4
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
        cap, why = _gpu_half(layer, layer.weight_packed.device)
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

        from cublade.config.compressed_tensors import pack_zero_points

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


class VllmMachete(_VllmMixedPrecision):
    name = "vllm-machete"
    vllm_class = "MacheteLinearKernel"


class VllmMarlin(_VllmMixedPrecision):
    name = "vllm-marlin"
    vllm_class = "MarlinLinearKernel"


# ---- mxfp8 ----------------------------------------------------------------------------------------------

class CubladeMxfp8Gemm(LinearKernel):
    """cublade's MXFP8 GEMM (cublade.ops.mxfp8_gemm, W8A16) on weights repacked once by `mxfp8_repack` into the
    kernels' tile layout (1 byte a weight plus its exponents, as the checkpoint). The op runs 1-16 tokens on its
    streaming kernel, from 17 on its wide (wgmma) kernel, and from 384 (512 on weights of 2^27 elements or more)
    dequantizes the weight to bf16 and runs cuBLAS (the prefill path; a transient N x K bf16 weight per call). Each
    path multiplies the same exact bf16 weights. bf16 activations only (the kernels build bf16 weights); E8M0 scales
    up to 2^7.
    H200, twelfth session (benchmarks/bench_mxfp8_linear.py, every kernel class in one run): against vLLM's MXFP8
    Marlin 1.00-1.63x as fast at 1-16 tokens, 1.03-1.70x at 32-256, 1.54-2.32x from 512 (K 8192 x N 28672 at M = 1 /
    64 / 256 / 4096: 75.7 / 94.0 / 261.4 / 2845.5 us, Marlin 75.6 / 113.9 / 411.1 / 6591.4); 3.4-4.5x as fast as the
    dequantize path below at 1-16 tokens, 0.97-1.07x from 512 (where it runs that path)."""
    name = "cublade-mxfp8-gemm"
    own = True

    @classmethod
    def can_implement(cls, layer):
        cap, why = _gpu_half(layer, layer.weight.device)
        if cap is None:
            return False, why
        if layer.params_dtype != torch.bfloat16:
            return False, f"takes bf16 activations, the model runs in {layer.params_dtype}"
        why = why_no_kernel("mxfp8_gemm", layer.weight.device) or mxfp8_ops.why_not_repackable(layer.weight_scale)
        if why is not None:
            return False, why
        return True, "cublade's CUDA op mxfp8_gemm (decode kernels; from 384-512 tokens dequantize + cuBLAS)"

    def __init__(self, layer):
        super().__init__(layer)
        self.size_n = layer.output_size_per_partition
        replace_parameter(layer, "weight", mxfp8_ops.mxfp8_repack(layer.weight.data, layer.weight_scale.data))
        replace_parameter(layer, "weight_scale", None)  # in the blob's records

    def apply(self, layer, x, bias):
        y = mxfp8_ops.mxfp8_gemm(x, layer.weight, self.size_n)
        return y if bias is None else y + bias


class CubladeMxfp8DequantMatmul(LinearKernel):
    """Hopper has no MX tensor cores: dequantize the MXFP8 weight to the activation dtype with cublade's op
    (exact: an e4m3 value times a power of two fits bf16/fp16 unless it leaves their range), then one dense
    GEMM. Costs a weight-sized write + read per call over an MX GEMM (at decode 2.7x the time of a bf16 layer);
    what it buys is 1-byte storage and cuBLAS's speed at prefill. Third, for layers neither GEMM above takes."""
    name = "cublade-mxfp8-dequant-matmul"
    own = True

    @classmethod
    def can_implement(cls, layer):
        if layer.weight.device.type != "cuda":
            return False, "needs a CUDA device"
        _, how = _op("mxfp8_dequant", layer.weight.device, mxfp8_dequant_ref)
        return True, f"dequantize with {how}, then a dense {layer.params_dtype} GEMM"

    def __init__(self, layer):
        super().__init__(layer)
        self.dequant, _ = _op("mxfp8_dequant", layer.weight.device, mxfp8_dequant_ref)

    def apply(self, layer, x, bias):
        w = self.dequant(layer.weight, layer.weight_scale, x.dtype)
        return torch.nn.functional.linear(x, w, bias)


class VllmMarlinMxfp8(LinearKernel):
    """vLLM's MXFP8 weight-only GEMM (Marlin, W8A16; a fallback), second for mxfp8: it takes what cublade-mxfp8-gemm
    refuses (fp16 activations, block scales above 2^7). vLLM's MarlinMxfp8LinearKernel repacks cublade's tensors once
    (they are the layout it reads: e4m3 [N, K], E8M0 uint8 [N, K/32]) and multiplies bf16/fp16 activations by the e4m3
    weights times their power-of-two scales with fp32 sums: the same products as cublade's kernels. Speeds:
    CubladeMxfp8Gemm above."""
    name = "vllm-marlin-mxfp8"
    own = False

    @classmethod
    def can_implement(cls, layer):
        cap, why = _gpu_half(layer, layer.weight.device)
        if cap is None:
            return False, why
        try:
            from vllm.model_executor.kernels.linear import MarlinMxfp8LinearKernel
        except ImportError as e:
            return False, f"this vLLM has no MarlinMxfp8LinearKernel ({e})"
        ok, why = MarlinMxfp8LinearKernel.is_supported(cap)
        return ok, (f"vLLM's MarlinMxfp8LinearKernel on sm_{cap}" if ok else f"vLLM's MarlinMxfp8LinearKernel: {why}")

    def __init__(self, layer):
        super().__init__(layer)
        from vllm.model_executor.kernels.linear import MarlinMxfp8LinearKernel, Mxfp8LinearLayerConfig

        self.impl = MarlinMxfp8LinearKernel(Mxfp8LinearLayerConfig())
        self.impl.process_weights_after_loading(layer)

    def apply(self, layer, x, bias):
        return self.impl.apply_weights(layer, x, bias)


# ---- the selector ---------------------------------------------------------------------------------------

CANDIDATES: dict[type[Scheme], tuple[type[LinearKernel], ...]] = {
    Fp8Scheme: (VllmCutlassScaledMM, ReferenceKernel),
    W4A16Scheme: (CubladeW4A16Gemm, VllmMachete, VllmMarlin, ReferenceKernel),
    MXFP8Scheme: (CubladeMxfp8Gemm, VllmMarlinMxfp8, CubladeMxfp8DequantMatmul, ReferenceKernel),
}

_logged: set[tuple] = set()


def disabled_kernels() -> set[str]:
    return {k.strip() for k in os.environ.get("CUBLADE_DISABLED_KERNELS", "").split(",") if k.strip()}


def first_runnable(candidates, can_implement: Callable[[type], tuple[bool, str]]
                   ) -> tuple[type | None, str, list[str]]:
    """(first candidate not disabled by CUBLADE_DISABLED_KERNELS whose can_implement says yes, its reason,
    the candidates passed over with why); the kernel is None when none can. Shared by the linear and MoE
    selectors."""
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
    kernel cublade chose for a layer, so a model compiled with one choice was loaded for another: with
    CUBLADE_DISABLED_KERNELS changed between two runs, the cached graph called cublade's mxfp8_gemm on the weights
    Marlin had repacked (H200, twelfth session). The kernels chosen while the model loads go, sorted, into the current
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


def select_kernel(layer: torch.nn.Module, prefix: str) -> LinearKernel:
    """The first candidate for the layer's scheme that can run it, constructed (it repacks the layer)."""
    scheme: Scheme = layer.cublade_scheme
    candidates = CANDIDATES.get(type(scheme))
    if candidates is None:
        raise NotImplementedError(f"{prefix}: cublade has no linear kernel for scheme {scheme.describe()}")
    k, reason, skipped = first_runnable(candidates, lambda k: k.can_implement(layer))
    if k is None:
        raise NotImplementedError(f"{prefix}: no kernel can run scheme {scheme.describe()} "
                                  f"[N={layer.output_size_per_partition}, K={layer.input_size_per_partition}, "
                                  f"{layer.params_dtype}]: " + "; ".join(skipped))
    log_choice_once((scheme.describe(), str(layer.params_dtype), k.name, reason, tuple(skipped)),
                    "cublade: %s layers like %s [N=%d, K=%d, %s] run on %s%s: %s%s", scheme.describe(), prefix,
                    layer.output_size_per_partition, layer.input_size_per_partition, layer.params_dtype,
                    k.name, "" if k.own else " (fallback)", reason,
                    f"; passed over {'; '.join(skipped)}" if skipped else "")
    add_to_compile_key(k.name)
    return k(layer)


def replace_parameter(layer: torch.nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Set a layer tensor as a Parameter (vLLM's compiled graphs take layer tensors as parameters); None
    removes it."""
    if name in layer._parameters:
        del layer._parameters[name]
    elif hasattr(layer, name):
        delattr(layer, name)
    if value is None:
        return
    if not isinstance(value, torch.nn.Parameter):
        value = torch.nn.Parameter(value, requires_grad=False)
    layer.register_parameter(name, value)
