"""FP8 W8A8 with cublade's decode GEMM for small batches and vLLM's CUTLASS scaled-mm above, on one weight tensor.
Opt-in (CUBLADE_FP8_GEMM=1): measured against vLLM's CUTLASS on Llama-3-8B's shapes it is not faster
(docs/performance.md#fp8-gemm), so `fp8` layers run on CUTLASS by default."""
from __future__ import annotations

import os

import torch

from cublade.numerics.fp8 import Fp8Activations
from cublade.ops.fp8_gemm import fp8_gemm
from cublade.ops.fp8_quant_per_token import fp8_quant_per_token, fp8_quant_per_token_bf16, fp8_quant_per_token_f16
from cublade.vllm.kernels.base import LinearKernel, env_switch, gpu_half, replace_parameter, why_no_kernel
from cublade.vllm.kernels.vllm_cutlass_scaled_mm import FUSE_ENV, VllmCutlassScaledMM, fuse_under_compile

# Batches of up to this many tokens run cublade's fp8_gemm, larger ones vLLM's CUTLASS. The op re-reads the weight
# every 32 rows and multiplies on bf16 mma.sync; CUTLASS reads it once and multiplies on FP8 wgmma: from 24 tokens
# fp8_gemm alone took 1.0-3.6x CUTLASS's time (benchmarks/bench_fp8_gemm.py, docs/performance.md#fp8-gemm).
FP8_GEMM_MAX_ROWS = 16
FP8_GEMM_ENV = "CUBLADE_FP8_GEMM"
# The type the activations' E4M3 values reach fp8_gemm in, which picks its decode: f16 (one conversion instruction
# per two codes, fp16 mma's) or bf16 (the codes decoded by bit placement, bf16 mma's: four times the decode's
# instructions). Both give the reference's products. f16 is the default: on the H200 fp8_gemm alone took 0.83-0.97x
# the bf16 form's time at every measured point (Llama-3-8B's four shapes x 1-16 tokens; one layer at one token 91.8
# against 99.7 us), docs/performance.md#fp8-gemm.
VALUES_ENV = "CUBLADE_FP8_GEMM_VALUES"
VALUES = {"f16": fp8_quant_per_token_f16, "bf16": fp8_quant_per_token_bf16}  # each entry is named after its op
DEFAULT_VALUES = "f16"


def fp8_gemm_asked_for() -> bool:
    """CUBLADE_FP8_GEMM=1: per-token dynamic `fp8` layers on Hopper take cublade-fp8-gemm (default 0: vLLM's CUTLASS)."""
    return env_switch(FP8_GEMM_ENV)


def values_form() -> str:
    """CUBLADE_FP8_GEMM_VALUES: "f16" (default) or "bf16", the activations' type into fp8_gemm (VALUES)."""
    v = os.environ.get(VALUES_ENV, DEFAULT_VALUES).strip()
    if v not in VALUES:
        raise ValueError(f"{VALUES_ENV}={v!r}: expected one of {', '.join(VALUES)}")
    return v


@torch.library.custom_op("cublade::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, max_rows: int,
               values: str = DEFAULT_VALUES) -> torch.Tensor:
    """y = x @ W^T for a per-token dynamic `fp8` layer: the activations quantized per token by cublade's op, then up
    to `max_rows` rows cublade's fp8_gemm (on the E4M3 values as `values`, VALUES), else vLLM's CUTLASS scaled-mm;
    both W8A8 on the same E4M3 bytes and scales, fp32 sums. One custom op, so torch.compile sees the row test as part
    of an opaque op (no guard on the batch)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] <= max_rows:
        xv, xs = VALUES[values](x2)
        y = fp8_gemm(xv, xs, weight, weight_scale)
    else:
        from vllm import _custom_ops as ops

        xq, xs = fp8_quant_per_token(x2)
        y = ops.cutlass_scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale, out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@fp8_linear.register_fake
def _fp8_linear_fake(x, weight, weight_scale, max_rows, values=DEFAULT_VALUES):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class CubladeFp8Gemm(LinearKernel):
    """Per-token dynamic `fp8` layers on Hopper: batches of up to FP8_GEMM_MAX_ROWS tokens on cublade's FP8 decode GEMM
    (cublade.ops.fp8_gemm: the E4M3 weight rows streamed through TMA as the checkpoint stores them), larger ones on
    vLLM's CUTLASS scaled-mm over the same tensor (no second copy of the weights). The activations are quantized per
    token by cublade's op, the same bytes either way, so both paths compute the scheme's W8A8 reference up to fp32
    summation order. Runs when asked for (CUBLADE_FP8_GEMM=1): at 1-16 tokens on Llama-3-8B's shapes the GEMM alone took
    0.97-1.54x the time of vLLM's CUTLASS on the H200 (benchmarks/bench_fp8_gemm.py; close on the two large weights,
    slower on the two small ones)."""
    name = "cublade-fp8-gemm"
    own = True

    @classmethod
    def can_implement(cls, layer):
        if not fp8_gemm_asked_for():
            return False, f"runs when asked for ({FP8_GEMM_ENV}=1; not faster than vLLM's CUTLASS where measured)"
        cap, why = gpu_half(layer, layer.weight.device)
        if cap is None:
            return False, why
        if layer.params_dtype != torch.bfloat16:
            return False, f"takes bf16 activations, the model runs in {layer.params_dtype}"
        if layer.cublade_scheme.activations is not Fp8Activations.DYNAMIC_TOKEN:
            return False, (f"{layer.cublade_scheme.activations.value} activations: the op takes per-token dynamic ones "
                           "(vLLM's CUTLASS runs the layer)")
        if fuse_under_compile():
            return False, f"{FUSE_ENV}=1 traces the quantization for Inductor onto vLLM's CUTLASS"
        for op in ("fp8_gemm", VALUES[values_form()].__name__, "fp8_quant_per_token"):
            why = why_no_kernel(op, layer.weight.device)
            if why is not None:
                return False, f"{op}: {why}"
        ok, why = VllmCutlassScaledMM.can_implement(layer)  # the batches above the decode GEMM's range
        if not ok:
            return False, f"larger batches need vLLM's CUTLASS: {why}"
        values = "" if values_form() == DEFAULT_VALUES else f" (fp8_gemm on bf16 values: {VALUES_ENV}=bf16)"
        return True, (f"cublade's fp8_gemm up to {FP8_GEMM_MAX_ROWS} tokens, vLLM's CUTLASS scaled-mm above, "
                      f"activations by cublade's fp8_quant_per_token{values}")

    def __init__(self, layer):
        super().__init__(layer)
        self.values = values_form()
        if self.values != DEFAULT_VALUES:
            from cublade.vllm.kernels import add_to_compile_key

            add_to_compile_key(f"{self.name}:{VALUES_ENV}={self.values}")  # the op's argument is in the traced graph
        N = layer.output_size_per_partition
        # one fp32 scale per output channel (a per-tensor scale repeated), as both GEMMs take it
        replace_parameter(layer, "weight_scale", layer.weight_scale.data.float().reshape(-1).expand(N).contiguous())

    def apply(self, layer, x, bias):
        y = torch.ops.cublade.fp8_linear(x, layer.weight, layer.weight_scale, FP8_GEMM_MAX_ROWS, self.values)
        return y if bias is None else y + bias
