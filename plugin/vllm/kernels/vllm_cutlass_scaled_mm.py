"""FP8 W8A8 on vLLM's CUTLASS scaled-mm, with activations quantized by cublade's op (vLLM's on sm_89).

CUBLADE_FP8_FUSE=1: while torch.compile traces the model (vLLM's default), the activations are quantized with the
reference's torch ops instead (cublade.numerics.fp8, the same rule), so that Inductor can fuse the quantization into
the kernel before it (RMSNorm, SiLU-and-mul), as it does for vLLM's own fp8 layers, whose quantization it traces too.
Eager runs keep cublade's CUDA op. Inductor's generated division may round differently from the op's IEEE division
in the last bit of the scaled value, so the E4M3 bytes can differ from the op's in rare rounding ties."""
from __future__ import annotations

from typing import Callable

import torch

from cublade.config import Fp8Scheme
from cublade.numerics.fp8 import Fp8Activations
from cublade.ops.fp8_quant_per_tensor import fp8_quant_per_tensor_ref
from cublade.ops.fp8_quant_per_token import fp8_quant_per_token_ref
from cublade.vllm.kernels import base
from cublade.vllm.kernels.base import LinearKernel, env_switch, gpu_half, why_no_kernel

FUSE_ENV = "CUBLADE_FP8_FUSE"


def fuse_under_compile() -> bool:
    """CUBLADE_FP8_FUSE=1: quantize with traceable torch ops while torch.compile traces (module docstring)."""
    return env_switch(FUSE_ENV)


def _fp8_input_quant(scheme: Fp8Scheme, pick: Callable[[str, Callable], Callable]) -> Callable:
    """(x2d, input_scale) -> (e4m3, fp32 scale [M, 1] or [1]) for the scheme's activations, through
    pick(op name, its reference): cublade's op entry, or the reference's torch ops themselves."""
    if scheme.activations is Fp8Activations.DYNAMIC_TOKEN:
        fn = pick("fp8_quant_per_token", fp8_quant_per_token_ref)
        return lambda x, s: fn(x)
    fn = pick("fp8_quant_per_tensor", fp8_quant_per_tensor_ref)
    if scheme.activations is Fp8Activations.DYNAMIC_TENSOR:
        return lambda x, s: fn(x, None)
    return lambda x, s: fn(x, s.float())  # the op takes an fp32 scale


def _vllm_input_quant(scheme: Fp8Scheme) -> Callable:
    """The same (x2d, input_scale) -> (e4m3, fp32 scale) through vLLM's scaled_fp8_quant, for GPUs cublade's quant
    ops are not built for (sm_89): per token its bytes equal cublade's; per tensor it multiplies by the scale's
    reciprocal where cublade divides, so a value at a rounding tie may land one E4M3 step apart."""
    from vllm import _custom_ops as ops

    if scheme.activations is Fp8Activations.DYNAMIC_TOKEN:
        return lambda x, s: ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
    if scheme.activations is Fp8Activations.DYNAMIC_TENSOR:
        return lambda x, s: ops.scaled_fp8_quant(x)
    return lambda x, s: ops.scaled_fp8_quant(x, s.float())


def input_quant_choice(scheme: Fp8Scheme, device: torch.device) -> tuple[str, str]:
    """Who quantizes the layer's activations ("cublade", "vllm" or "reference") and a few words saying so: cublade's
    CUDA op where it runs, else on a GPU vLLM's scaled_fp8_quant (a named fallback), else (CPU) the op's PyTorch
    reference."""
    name = "fp8_quant_per_token" if scheme.activations is Fp8Activations.DYNAMIC_TOKEN else "fp8_quant_per_tensor"
    why = why_no_kernel(name, device)
    if why is None:
        return "cublade", f"activations by cublade's {name}"
    if base._capability(device) is None:
        return "reference", f"activations by the PyTorch reference of {name} ({why})"
    return "vllm", f"activations by vLLM's scaled_fp8_quant ({name}: {why})"


class VllmCutlassScaledMM(LinearKernel):
    """vLLM's CUTLASS scaled-mm (the named fallback, and the default: cublade's own FP8 decode GEMM, cublade-fp8-gemm,
    runs only when asked for). Activations are quantized by cublade's op (on sm_89, which cublade._C is not built
    for, by vLLM's scaled_fp8_quant); the epilogue applies the activation scale (per token or per tensor) and the
    weight scale (per channel or per tensor)."""
    name = "vllm-cutlass-scaled-mm"
    own = False

    @classmethod
    def can_implement(cls, layer):
        cap, why = gpu_half(layer, layer.weight.device)
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
        return True, f"FP8 tensor cores on sm_{cap}, {input_quant_choice(layer.cublade_scheme, layer.weight.device)[1]}"

    def __init__(self, layer):
        super().__init__(layer)
        who, _ = input_quant_choice(self.scheme, layer.weight.device)
        if who == "vllm":
            self.quant_input = _vllm_input_quant(self.scheme)
        else:  # cublade's op where it runs, else (CPU) its reference
            self.quant_input = _fp8_input_quant(
                self.scheme, lambda name, ref: getattr(torch.ops.cublade, name) if who == "cublade" else ref)
        self.quant_traced = _fp8_input_quant(self.scheme, lambda name, ref: ref) if fuse_under_compile() else None
        if self.quant_traced is not None:
            from cublade.vllm.kernels import add_to_compile_key

            add_to_compile_key(f"{self.name}:{FUSE_ENV}=1")  # another traced graph: another compiled model

    def quantize(self, x2: torch.Tensor, input_scale: torch.Tensor | None):
        """The activations in E4M3 and their fp32 scale: cublade's op, or under CUBLADE_FP8_FUSE=1 while torch.compile
        traces, the same rule in torch ops."""
        if self.quant_traced is not None and torch.compiler.is_compiling():
            return self.quant_traced(x2, input_scale)
        return self.quant_input(x2, input_scale)

    def apply(self, layer, x, bias):
        from vllm import _custom_ops as ops

        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # a norm's output goes to the quantization as it is
        xq, xs = self.quantize(x2, getattr(layer, "input_scale", None))
        # CUTLASS takes B column-major: the [N, K] row-major weight transposed is exactly that (no copy).
        y = ops.cutlass_scaled_mm(xq, layer.weight.t(), scale_a=xs, scale_b=layer.weight_scale,
                                  out_dtype=x.dtype, bias=bias)
        return y.reshape(*x.shape[:-1], -1)
