"""W4A16 on FP8 tensor cores for large batches: `w4a16_gemm_fp8(x [..., K], packed, group_size, symmetric, size_n,
min_rows) -> [..., size_n]` in x's dtype, on the blob of `w4a16_repack` (group size 128 or per channel).

Calls with fewer than `min_rows` rows run `w4a16_gemm` (bf16 tensor-core math, the weights never rounded). From
`min_rows` rows the int4 values are taken as they are, exact in E4M3 (u - z in [-15, 15]), with their group scales
as 1 x 128 block scales (`w4a16_dequant_fp8`), the activations are quantized to E4M3 per 1 x 128 group
(`fp8_quant_per_group`), and one blockwise-scaled FP8 GEMM (`torch.nn.functional.scaled_mm`, cuBLASLt) sums in fp32
and applies both scales per 128-wide block of K. Hopper's FP8 tensor cores run at twice the bf16 rate; the cost is
the activations' E4M3 rounding (a relative error of about 2^-4 per element at worst, 2^-5 on average), the one
numerics change: the result is not w4a16_gemm's. Outputs therefore depend on whether a call has `min_rows` rows,
i.e. on the batch. The reference: `w4a16_gemm_fp8_ref` (the same quantization, fp32 sums).

The op is one `torch.library.custom_op`, so torch.compile treats the row test as part of an opaque op (no guard on
the batch size)."""
from __future__ import annotations

import torch

from cublade.numerics.linear import fp8_activations_per_group
from cublade.ops._dispatch import use_kernel
from cublade.ops.fp8_quant_per_group import fp8_quant_per_group
from cublade.ops.w4a16_dequant import w4a16_dequant_fp8
from cublade.ops.w4a16_gemm import w4a16_dequant_repacked, w4a16_gemm, w4a16_gemm_ref

def w4a16_gemm_fp8_ref(x: torch.Tensor, packed: torch.Tensor, group_size: int, symmetric: bool, size_n: int,
                       min_rows: int) -> torch.Tensor:
    _check_n(size_n)
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.shape[0] < min_rows:
        return w4a16_gemm_ref(x, packed, group_size, symmetric, size_n)
    # E4M3 activations times the exact weights (the FP8 form's codes times its block scales are those weights)
    y = fp8_activations_per_group(x2.float()) @ w4a16_dequant_repacked(packed, group_size, symmetric, size_n, K).t()
    return y.to(x.dtype).reshape(*x.shape[:-1], size_n)


def _check_n(size_n: int) -> None:
    if size_n % 16:
        raise NotImplementedError(f"w4a16_gemm_fp8: size_n={size_n} must be a multiple of 16 (cuBLASLt's FP8 "
                                  "GEMM needs 16-byte aligned weight rows)")


def _scaled_mm_blockwise(xq, sa, codes, sb, dtype) -> torch.Tensor:
    F = torch.nn.functional
    return F.scaled_mm(xq, codes.t(), sa, F.ScalingType.BlockWise1x128, sb, F.ScalingType.BlockWise1x128,
                       output_dtype=dtype)


def _pad_rows(x2: torch.Tensor, multiple: int) -> torch.Tensor:
    """x2 with zero rows appended up to a multiple of `multiple` (cuBLASLt reads the column-major 1 x 128
    activation scales with a leading dimension of M, which it needs 16-byte aligned: M % 4 == 0)."""
    pad = -x2.shape[0] % multiple
    return x2 if pad == 0 else torch.cat([x2, x2.new_zeros(pad, x2.shape[1])])


@torch.library.custom_op("cublade::w4a16_gemm_fp8", mutates_args=())
def w4a16_gemm_fp8(x: torch.Tensor, packed: torch.Tensor, group_size: int, symmetric: bool, size_n: int,
                   min_rows: int) -> torch.Tensor:
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if not use_kernel(x, "w4a16_dequant_fp8"):
        return w4a16_gemm_fp8_ref(x, packed, group_size, symmetric, size_n, min_rows)
    _check_n(size_n)
    M = x2.shape[0]
    if M < min_rows:
        return w4a16_gemm(x, packed, group_size, symmetric, size_n)
    xq, sa = fp8_quant_per_group(_pad_rows(x2, 4))
    codes, sb = w4a16_dequant_fp8(packed, group_size, symmetric, size_n, K)
    return _scaled_mm_blockwise(xq, sa, codes, sb, x.dtype)[:M].reshape(*x.shape[:-1], size_n)


@w4a16_gemm_fp8.register_fake
def _w4a16_gemm_fp8_fake(x, packed, group_size, symmetric, size_n, min_rows):
    return x.new_empty((*x.shape[:-1], size_n))


def blockwise_fp8_supported() -> bool:
    """True when this torch has the blockwise-scaled FP8 GEMM (torch.nn.functional.scaled_mm, 1 x 128 scales)."""
    F = torch.nn.functional
    return hasattr(F, "scaled_mm") and hasattr(getattr(F, "ScalingType", None), "BlockWise1x128")


