"""SiLU-and-mul and FP8 E4M3 quantization of its output in one op:

    silu_mul_fp8_quant(x, scale=None) -> (e4m3 [..., K], fp32 scale)

x [..., 2K] holds a gated MLP's gate and up halves in vLLM's SiluAndMul layout (gate = x[..., :K], up = x[..., K:]).
The activation is vLLM's native SiluAndMul (F.silu(gate) * up) as torch.compile's Inductor computes it, which is how
vLLM runs it under its default compile mode (custom ops off): y = T(g / (1 + exp(-g)) * u) in fp32, rounded once to
x's dtype T. Inductor decomposes silu to x / (1 + exp(-x)) and, fusing it with the multiply into one kernel, drops
the silu's own rounding to T; eager PyTorch rounds twice, T(T(silu(g)) * u) (cublade.ops.moe_glue.silu_mul's rule),
which differs from the compiled y in about a quarter of bf16 elements. The quantization is cublade's: per token
(`scale=None`: fp8_quant_per_token's rule, scale [..., 1]) or per tensor with a static fp32 scale
(fp8_quant_per_tensor's rule; the scale returned as [1]). This is what cublade's compile pass (cublade.vllm.fusion)
puts in place of a SiLU-and-mul followed by an fp8 layer's quantization. The kernel (csrc/silu_mul_fp8_quant.cu) takes
the reference's fp32 steps with the same roundings (IEEE division, expf); Inductor's generated GPU code divides with
Triton's approximate fp32 division, so the unfused graph's y can sit one step of T away where a quotient lies at a
rounding boundary."""
from __future__ import annotations

import torch

from cublade.numerics.fp8 import FP8_DTYPE, quantize_per_tensor, quantize_per_token
from cublade.ops._dispatch import register_fake, use_kernel

MAX_K = 131072  # the kernel's widest output row (kSiluMulFp8QuantMaxK): x's last dim up to 2 * MAX_K


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """vLLM's native SiluAndMul as Inductor compiles it: T(g / (1 + exp(-g)) * u) in fp32, one rounding to x's dtype
    (for fp32 x, that fp32 value)."""
    K = x.shape[-1] // 2
    g, u = x[..., :K].float(), x[..., K:].float()
    return (g / (1 + torch.exp(-g)) * u).to(x.dtype)


def silu_mul_fp8_quant_ref(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    y = silu_and_mul_ref(x)
    return quantize_per_token(y) if scale is None else quantize_per_tensor(y, scale)


def kernel_takes(x: torch.Tensor) -> bool:
    """Whether the CUDA kernel runs this input's shape and dtype (else the reference does)."""
    K2 = x.shape[-1] if x.dim() else 0
    return x.dtype in (torch.bfloat16, torch.float16) and K2 % 16 == 0 and 16 <= K2 <= 2 * MAX_K


def silu_mul_fp8_quant(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if use_kernel(x, "silu_mul_fp8_quant") and kernel_takes(x):
        return torch.ops.cublade.silu_mul_fp8_quant(x, scale)
    return silu_mul_fp8_quant_ref(x, scale)


@register_fake("cublade::silu_mul_fp8_quant")
def _silu_mul_fp8_quant_fake(x, scale=None):
    q_shape = (*x.shape[:-1], x.shape[-1] // 2)
    s_shape = (1,) if scale is not None else (*x.shape[:-1], 1)
    return (torch.empty(q_shape, dtype=FP8_DTYPE, device=x.device),
            torch.empty(s_shape, dtype=torch.float32, device=x.device))
