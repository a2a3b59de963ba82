"""FP8 W8A8 GEMM on Hopper's FP8 tensor cores for batches and prompts, on the E4M3 weight as checkpoints store it:

    xq, xs = fp8_quant_per_token(x)                       # or fp8_quant_per_tensor: E4M3 [..., K], fp32 scale
    y = fp8_gemm_wgmma(xq, xs, weight, weight_scale)      # weight: E4M3 [N, K]; weight_scale: fp32 [N]

`fp8_gemm_wgmma(x E4M3 [..., K], x_scale fp32 (one per row, or one), weight E4M3 [N, K], weight_scale fp32 [N],
  split_k=0) -> bf16 [..., N]`: y = x_scale * (weight_scale * (x @ W^T)), the numerics of vLLM's CUTLASS scaled-mm
  (the layer's other GEMM, cublade.vllm.kernels.cublade_fp8_wgmma): the tensor cores' FP8 accumulation over K in
  steps of 32, in K order, which keeps fewer bits than fp32 (the error against the exact sum grows with K, as
  CUTLASS's does), then the weight scale, the activation scale and one rounding to bf16. `split_k=0` lets the
  launcher halve K >= 8192 over a two-CTA cluster on small grids (two fp32 halves added: other bits than an unsplit
  call); 1 never splits, so every batch size gives the same bits; 2 / 4 / 8 are for tuning and tests.
  On a GPU with the extension `torch.ops.cublade.fp8_gemm_wgmma` (csrc/fp8_gemm_wgmma.cu: both operands staged by TMA,
  wgmma m64nNk32 with the weights as A); elsewhere the reference `fp8_gemm_wgmma_ref`: the exact products summed in
  fp32, which the kernel matches to its accumulation's precision (tests/ops/test_fp8_gemm_wgmma.py states the bound).
"""
from __future__ import annotations

import torch

from cublade.ops._dispatch import register_fake, use_kernel


def fp8_gemm_wgmma_ref(x: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       split_k: int = 0) -> torch.Tensor:
    """The reference: the E4M3 values' fp32 products and sums, x_scale * (weight_scale * sum), rounded to bf16."""
    K = x.shape[-1]
    acc = x.reshape(-1, K).float() @ weight.float().t()
    y = x_scale.float().reshape(-1, 1) * (weight_scale.float().reshape(1, -1) * acc)
    return y.to(torch.bfloat16).reshape(*x.shape[:-1], weight.shape[0])


def fp8_gemm_wgmma(x: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   split_k: int = 0) -> torch.Tensor:
    if use_kernel(x, "fp8_gemm_wgmma"):
        return torch.ops.cublade.fp8_gemm_wgmma(x, x_scale, weight, weight_scale, split_k)
    return fp8_gemm_wgmma_ref(x, x_scale, weight, weight_scale, split_k)


@register_fake("cublade::fp8_gemm_wgmma")
def _fp8_gemm_wgmma_fake(x: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         split_k: int = 0) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.bfloat16)
