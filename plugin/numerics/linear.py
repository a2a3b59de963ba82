"""Reference quantized linears: what each scheme's layer computes, from the quantized tensors themselves
(never from a dequantized copy stored anywhere). y = x @ W^T (+ bias), accumulated in fp32, returned in
x's dtype. GPU methods must agree with these within the scheme's tolerance (GEMMs are not bit-exact:
their fp32 summation order differs), and the quant steps inside them are bit-exact.
"""
from __future__ import annotations

import os

import torch

from cublade.numerics.fp4 import Fp4Format, fp4_dequant_weight
from cublade.numerics.fp8 import Fp8Activations, quantize_per_group, quantize_per_tensor, quantize_per_token
from cublade.numerics.int4 import int4_dequant_weight
from cublade.numerics.mxfp8 import mxfp8_dequantize


def _finish(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   activations: Fp8Activations | str = Fp8Activations.DYNAMIC_TOKEN,
                   input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8: activations quantized per token (dynamic) or per tensor (dynamic, or static `input_scale`),
    e4m3 x e4m3 products summed in fp32, then both scales applied (the scaled-mm epilogue)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    activations = Fp8Activations.lookup(activations, "fp8 activation mode")
    if activations is Fp8Activations.DYNAMIC_TOKEN:
        xq, xs = quantize_per_token(x2)
    elif activations is Fp8Activations.DYNAMIC_TENSOR:
        xq, xs = quantize_per_tensor(x2)
    else:
        if input_scale is None:
            raise ValueError("fp8 static-tensor activations need an input_scale")
        xq, xs = quantize_per_tensor(x2, input_scale)
    ws = weight_scale.float().reshape(1, -1)  # [1, N] or [1, 1]
    y = (xq.float() @ weight.float().t()) * xs.float() * ws
    return _finish(y, bias, x.dtype).reshape(*shape[:-1], -1)


# Exponent bias of e4m3 codes decoded by bit placement into a 16-bit float: a code moved into bf16's (fp16's) exponent
# field is worth its value times 2^-120 (2^-8), and the kernel folds 2^120 (2^8) into the per-channel scale.
W8A16_EXPONENT_BIAS = {torch.bfloat16: 120, torch.float16: 8}
# Error of one W8A16 weight element against the exact code x fp32 scale, (relative, absolute): the scale's one
# rounding to the activation dtype (fp16: subnormal below 2^-14 after the bias, i.e. fp32 scales under 2^-22).
W8A16_WEIGHT_ERROR = {torch.bfloat16: (2.0**-8, 0.0), torch.float16: (2.0**-11, 2.0**-24)}


def fp8_w8a16_weight(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 [N, K] weight an FP8 W8A16 kernel (vLLM's FP8 Marlin) multiplies `dtype` (bf16 / fp16) activations
    by: each e4m3 code, exact, times its channel's scale as the kernel holds it (`fp8_w8a16_scale`, the bias taken
    back out: exact). Marlin multiplies the decoded codes in its MMAs and applies the channel scale to the fp32
    sums (vLLM's marlin_template.h, 8-bit weights with channel scales), the same products up to fp32 rounding.
    Error per element against code x fp32 scale: W8A16_WEIGHT_ERROR."""
    bias = W8A16_EXPONENT_BIAS[dtype]
    s = fp8_w8a16_scale(weight_scale, weight.shape[0], dtype).float() * 2.0**-bias
    return weight.float() * s.unsqueeze(1)  # a 4-bit by 11-bit significand product: exact in fp32


def fp8_w8a16_scale(weight_scale: torch.Tensor, N: int, dtype: torch.dtype) -> torch.Tensor:
    """[N] per-channel scales of an FP8 W8A16 kernel: the fp32 scale (one per channel, or one per tensor repeated)
    times 2^bias, rounded once to `dtype`. Folding the bias in before the rounding keeps fp16 scales normal down to
    2^-22 (rounding first would make every scale under 2^-14 an fp16 subnormal)."""
    return (weight_scale.float().reshape(-1).expand(N) * 2.0**W8A16_EXPONENT_BIAS[dtype]).to(dtype)


def fp8_w8a16_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A16 on FP8 weights (vLLM's FP8 Marlin, for GPUs without FP8 tensor cores): activations are not quantized;
    x (bf16 / fp16) times `fp8_w8a16_weight`, summed in fp32, rounded once to x's dtype. Against the W8A8
    `fp8_linear_ref` of the same checkpoint it differs by the activation rounding W8A8 does and this does not:
    `w8a16_vs_w8a8_bound` says by how much at most."""
    return _dense(x, fp8_w8a16_weight(weight, weight_scale, x.dtype), bias)


def w8a16_vs_w8a8_bound(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, x_dequant: torch.Tensor
                        ) -> torch.Tensor:
    """[M, N] bound on |fp8_w8a16_linear_ref - fp8_linear_ref| for x [M, K], where `x_dequant` is W8A8's quantized
    activation times its scale (fp32): sum_k |x - x_dequant| |W| (the activation rounding, incl. clipping at a
    static scale) + the W8A16 weight error (W8A16_WEIGHT_ERROR: 2^-8 sum_k |x| |W| for bf16; fp16 2^-11 of it plus
    2^-24 sum_k |x|) + K 2^-24 sum_k (|x| + |x_dequant|) |W| (fp32 summation) + one rounding of each output to x's
    dtype."""
    x2, xd = x.reshape(-1, x.shape[-1]).float(), x_dequant.reshape(-1, x.shape[-1]).float()
    W = (weight.float() * weight_scale.float().reshape(-1, 1)).abs()
    u = 2.0**-8 if x.dtype == torch.bfloat16 else 2.0**-11
    rel_w, abs_w = W8A16_WEIGHT_ERROR[x.dtype]
    K = x2.shape[-1]
    xw, xdw = x2.abs() @ W.t(), xd.abs() @ W.t()
    inner = ((x2 - xd).abs() @ W.t() + rel_w * xw + abs_w * x2.abs().sum(-1, keepdim=True)
             + K * 2.0**-24 * (xw + xdw))
    # each output rounded once to x's dtype (|y| <= its sum of |products|); 2^-5 slack for second-order terms
    return (inner + u * (xw + xdw + inner)) * (1 + 2.0**-5)


def _dense(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.reshape(-1, x.shape[-1]).float() @ w.t()
    return _finish(y, bias, x.dtype).reshape(*x.shape[:-1], -1)


W4A16_PREFILL_ENV = "CUBLADE_W4A16_PREFILL"
W4A16_PREFILL_CHOICES = ("bf16", "fp8")
# The vLLM W4A16 kernels CUBLADE_W4A16_PREFILL may name instead (comma-separated): timed against cublade's at load
W4A16_MEASURED_KERNELS = ("machete", "humming")
# Rows from which CUBLADE_W4A16_PREFILL=fp8 rounds a w4a16 layer's activations to E4M3 per 1 x 128 (the FP8
# tensor-core path, cublade.ops.w4a16_gemm_fp8), one count for every shape. Measured on an H200
# (benchmarks/bench_w4a16_gemm.py, "fp8-tc" against "cublade", Llama-3-8B and -70B shapes; docs/decisions.md): from
# 512 rows the FP8 path is the faster on every shape but 4096x6144 (0.84x there at 512, 1.14x at 1024); at 384 it
# loses on 8192x10240 and 28672x8192, at 256 on four of seven shapes. Below, quantizing both operands per call
# costs more than the faster tensor cores gain.
W4A16_FP8_MIN_ROWS = 512


def _w4a16_prefill() -> tuple[str, tuple[str, ...]]:
    """CUBLADE_W4A16_PREFILL read once: its math ("bf16", "fp8" or "measured") and the kernels it names to time (vLLM
    kernels, and "fp8" among them: cublade's FP8 tensor-core path timed too)."""
    v = os.environ.get(W4A16_PREFILL_ENV, "").strip().lower() or "bf16"
    if v in W4A16_PREFILL_CHOICES:
        return v, ()
    names = tuple(n.strip() for n in v.split(","))
    if (all(n in (*W4A16_MEASURED_KERNELS, "fp8") for n in names) and len(set(names)) == len(names)
            and any(n in W4A16_MEASURED_KERNELS for n in names)):
        return "measured", names
    raise ValueError(f"{W4A16_PREFILL_ENV}={os.environ[W4A16_PREFILL_ENV]!r}: expected "
                     f"{' or '.join(W4A16_PREFILL_CHOICES)}, or vLLM kernels to time against cublade's at load, "
                     f"comma-separated, of {', '.join(W4A16_MEASURED_KERNELS)} (with fp8 among them: the FP8 "
                     "tensor-core path timed too)")


def w4a16_prefill_math() -> str:
    """CUBLADE_W4A16_PREFILL: "bf16" (default: bf16/fp16 activations at every batch size), "fp8" (calls of
    W4A16_FP8_MIN_ROWS rows or more take their activations in E4M3 per 1 x 128, on FP8 tensor cores) or "measured"
    when it names vLLM kernels (W4A16_MEASURED_KERNELS, e.g. "machete,humming": the token counts where one measured
    faster at load run on it, from a copy of the weights in its layout; the math is bf16's, except where "fp8" is
    among them and the FP8 path measured fastest: cublade.vllm.kernels.cublade_w4a16_measured)."""
    return _w4a16_prefill()[0]


def w4a16_measured_kernels() -> tuple[str, ...]:
    """The kernels CUBLADE_W4A16_PREFILL names to time against cublade's, in its order (none unless
    w4a16_prefill_math() is "measured"): vLLM's ("machete", "humming") and cublade's FP8 path ("fp8")."""
    return _w4a16_prefill()[1]


MXFP8_PREFILL_ENV = "CUBLADE_MXFP8_PREFILL"
# The vLLM MXFP8 kernels CUBLADE_MXFP8_PREFILL may name: timed against cublade's at load
MXFP8_MEASURED_KERNELS = ("humming",)


def mxfp8_measured_kernels() -> tuple[str, ...]:
    """The vLLM MXFP8 kernels CUBLADE_MXFP8_PREFILL names (comma-separated, of MXFP8_MEASURED_KERNELS; unset: none):
    the token counts where one measured faster than cublade's at load run on it, from a copy of the weights in its
    layout (cublade.vllm.kernels.cublade_mxfp8_measured). The math is the same weight-only MXFP8."""
    v = os.environ.get(MXFP8_PREFILL_ENV, "").strip().lower()
    names = tuple(n.strip() for n in v.split(",")) if v else ()
    if all(n in MXFP8_MEASURED_KERNELS for n in names) and len(set(names)) == len(names):
        return names
    raise ValueError(f"{MXFP8_PREFILL_ENV}={os.environ[MXFP8_PREFILL_ENV]!r}: expected vLLM kernels to time against "
                     f"cublade's at load, comma-separated, of {', '.join(MXFP8_MEASURED_KERNELS)}")


def fp8_activations_per_group(x2: torch.Tensor) -> torch.Tensor:
    """x [M, K] (K % 128 == 0) rounded to E4M3 per 1 x 128 group with the dynamic per-token rule per group, back in
    fp32 (q * scale, exact)."""
    M, K = x2.shape
    q, s = quantize_per_group(x2, 128)
    return (q.float().reshape(M, K // 128, 128) * s[:, :, None]).reshape(M, K)


def w4a16_linear_ref(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                     weight_zero_point: torch.Tensor | None, group_size: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """bf16/fp16 activations times the exact int4 weights. With CUBLADE_W4A16_PREFILL=fp8, calls of
    W4A16_FP8_MIN_ROWS rows or more at group size 128 or per channel compute what the FP8 tensor-core path does:
    activations rounded to E4M3 per 1 x 128 first."""
    w = int4_dequant_weight(weight_packed, weight_scale, weight_zero_point, group_size)
    K = x.shape[-1]
    if (group_size in (128, -1) and K % 128 == 0 and x.numel() // max(K, 1) >= W4A16_FP8_MIN_ROWS
            and w4a16_prefill_math() == "fp8"):
        y = fp8_activations_per_group(x.reshape(-1, K).float()) @ w.float().t()
        return _finish(y, bias, x.dtype).reshape(*x.shape[:-1], -1)
    return _dense(x, w, bias)


def mxfp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only MXFP8 (Hopper has no MX tensor cores): activations stay in their dtype."""
    return _dense(x, mxfp8_dequantize(weight, weight_scale), bias)


def fp4_linear_ref(x: torch.Tensor, tensors: dict[str, torch.Tensor], fmt: Fp4Format | str,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    return _dense(x, fp4_dequant_weight(tensors, fmt), bias)
