"""FP8 W8A8 decode GEMM on the E4M3 weight as checkpoints store it (no repack), the `fp8` scheme's small batches:

    xv, xs = fp8_quant_per_token_bf16(x)                  # the activations' E4M3 values, as bf16 (or _f16: fp16)
    y = fp8_gemm(xv, xs, weight, weight_scale)            # weight: E4M3 [N, K]; weight_scale: fp32 [N]

`fp8_gemm(x [..., K] bf16 or fp16, x_scale fp32 (one per row, or one), weight E4M3 [N, K], weight_scale fp32 [N],
  split_k=0) -> bf16 [..., N]`: y = (x @ W^T) * x_scale * weight_scale, x's E4M3 values and the codes multiplied
  exactly, summed in fp32, the scales applied in that order (`cublade.numerics.linear.fp8_linear_ref`'s epilogue),
  rounded once to bf16. With fp16 x the kernel decodes the codes with the conversion instruction (cvt
  e4m3x2 -> f16x2) and multiplies on fp16 mma's; with bf16 x by bit placement (the MXFP8 kernels' decode) on bf16
  mma's: the same products, so the same reference.
  On a GPU with the extension `torch.ops.cublade.fp8_gemm` (csrc/fp8_gemm.cu: the weight-streaming kernel reading the
  rows through TMA, passes of up to 32 rows); elsewhere the reference `fp8_gemm_ref`, the same numbers up to fp32
  summation order. It re-reads the weight every 32 rows: the layer kernel `cublade-fp8-gemm`
  (cublade.vllm.kernels.cublade_fp8_gemm, opt-in with CUBLADE_FP8_GEMM=1) runs it for small batches and vLLM's CUTLASS
  FP8 GEMM (the same weight tensor) above. `split_k` (1..8 fixes
  the K splits; 0 = automatic) is for tuning and tests.
"""
from __future__ import annotations

import torch

from cublade.ops._dispatch import register_fake, use_kernel


def fp8_gemm_ref(x: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 split_k: int = 0) -> torch.Tensor:
    """The reference: fp32 products and sums, (sum * x_scale) * weight_scale, rounded to bf16."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K).float()
    y = (x2 @ weight.float().t()) * x_scale.float().reshape(-1, 1) * weight_scale.float().reshape(1, -1)
    return y.to(torch.bfloat16).reshape(*x.shape[:-1], weight.shape[0])


def fp8_gemm(x: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             split_k: int = 0) -> torch.Tensor:
    if use_kernel(x, "fp8_gemm"):
        return torch.ops.cublade.fp8_gemm(x, x_scale, weight, weight_scale, split_k)
    return fp8_gemm_ref(x, x_scale, weight, weight_scale, split_k)


@register_fake("cublade::fp8_gemm")
def _fp8_gemm_fake(x: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   split_k: int = 0) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.bfloat16)
