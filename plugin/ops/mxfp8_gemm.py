"""MXFP8 weight GEMM (W8A16): bf16 activations x e4m3 weights with one E8M0 scale per 32 K (the `mxfp8` scheme),
and the one-time repack of the checkpoint layout into the kernels'.

    packed = mxfp8_repack(weight, weight_scale)            # once, at load time
    y = mxfp8_gemm(x, packed, size_n)                      # every call

`mxfp8_gemm(x [..., K] bf16, packed, size_n, split_k=0) -> bf16 [..., size_n]`: y = x @ W^T with W = e4m3 code *
  2^(e - 127) rounded to bf16 (exact for 3 <= e <= 134; the repack refuses e > 134), summed in fp32, rounded once to
  bf16. On a GPU with the extension `torch.ops.cublade.mxfp8_gemm` (csrc/mxfp8_gemm.cu): 1-16 rows on the streaming
  kernel (mma.sync), from 17 on the wide kernel (wgmma, up to 128 rows a pass, 256 from 192 rows left; a workspace
  for x), from 257 rows on weights under 2^25 elements (640 under 2^26, 1024 above) the prefill path
  (`mxfp8_dequant_packed`, then cuBLAS). Elsewhere the reference `mxfp8_gemm_ref`, the same numbers up to fp32
  summation order. `split_k` (1..8 forces the streaming kernel at any M; 0 = automatic) is for tuning and tests.

`mxfp8_dequant_packed(packed, size_n, size_k) -> bf16 [size_n, size_k]`: the weight the kernels multiply by, bit for
  bit (the prefill path's input to cuBLAS); equal to `mxfp8_dequant(weight, weight_scale, torch.bfloat16)`.

Why a repack: the kernels stream 64-row x 512-K tile blocks with one bulk copy each and read every weight from shared
memory as a ready mma fragment (csrc/w4a16_gemm.cuh). Layout, int32 blob [ceil(N/64), ceil(K/512), 4, 2048 + 64]
(N zero-padded to 64 rows, K to 512); per (tile group, chunk, tile of 16 rows) one tile block of 8448 bytes:
  bytes 0..8191    8 packets of 64 K x 2 halves x 32 lanes x 16 bytes. In half h of packet p, lane (g, t) =
                   (lane // 4, lane % 4) holds 4 words: (row g, k-step 2h), (g+8, 2h), (g, 2h+1), (g+8, 2h+1); the
                   word of k-step s holds the row's codes at K0 + 0, 2, 1, 3 (bytes 0..3), K0 = 64p + 32h + 8t + 4(s%2).
  bytes 8192..     the exponent records: [8 packets][8 g] x 4 bytes: e of (row g, half 0), (g+8, 0), (g, 1), (g+8, 1).
"""
from __future__ import annotations

import torch

from cublade.numerics.constants import MX_BLOCK
from cublade.numerics.fp8 import FP8_DTYPE
from cublade.numerics.mxfp8 import mxfp8_dequantize
from cublade.ops._dispatch import register_fake, use_kernel

TILE_N = 16  # rows per tile (the mma's M)
GROUP_TILES = 4  # tiles per tile group
PACKET_K = 64
CHUNK_K = 512
CODE_BYTES = CHUNK_K * TILE_N  # 8192 code bytes per tile block
RECORD_BYTES = 8 * 32  # exponent records per tile block
BLOCK_WORDS = (CODE_BYTES + RECORD_BYTES) // 4

# The kernels make each weight as a bf16 code * 2^-120 times the bf16 2^(e - 7): finite for e + 120 <= 254.
MAX_EXPONENT_CODE = 134
_BYTE_OF_KOFF = (0, 2, 1, 3)  # word byte -> K offset from K0 (bytes 0, 2: K0, K0+1; bytes 1, 3: K0+2, K0+3)


def why_not_repackable(weight_scale: torch.Tensor) -> str | None:
    """Why the kernels cannot take these E8M0 codes (None when they can): exponents above 134 (block scales above 2^7,
    or the NaN code 255) make the kernel's bf16 factor 2^(e - 7) overflow."""
    top = int(weight_scale.max()) if weight_scale.numel() else 0
    if top > MAX_EXPONENT_CODE:
        return (f"an E8M0 scale code of {top} (scale 2^{top - 127}) is above {MAX_EXPONENT_CODE}: the kernels' bf16 "
                f"factor 2^(e - 7) would overflow")
    return None


def mxfp8_repack(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """Checkpoint layout (e4m3 [N, K], uint8 E8M0 [N, K/32]) -> the kernels' blob (module docstring). Runs on the
    tensors' device."""
    op = "mxfp8_repack"
    if weight.dim() != 2 or weight.dtype not in (FP8_DTYPE, torch.uint8):
        raise ValueError(f"{op}: weight must be float8_e4m3fn [N, K], got {weight.dtype} {tuple(weight.shape)}")
    N, K = weight.shape
    if K % MX_BLOCK:
        raise ValueError(f"{op}: in_features K={K} is not a multiple of {MX_BLOCK}")
    if weight_scale.dtype != torch.uint8 or tuple(weight_scale.shape) != (N, K // MX_BLOCK):
        raise ValueError(f"{op}: weight_scale must be uint8 [{N}, {K // MX_BLOCK}], got {weight_scale.dtype} "
                         f"{tuple(weight_scale.shape)}")
    if (why := why_not_repackable(weight_scale)) is not None:
        raise ValueError(f"{op}: {why}")
    dev = weight.device
    T, C = -(-N // (TILE_N * GROUP_TILES)) * GROUP_TILES, -(-K // CHUNK_K)  # tiles (whole groups), chunks
    u = torch.zeros((T * TILE_N, C * CHUNK_K), dtype=torch.uint8, device=dev)
    u[:N, :K] = weight.view(torch.uint8)
    # row = 16 tile + 8 rh + g; K = 64 P + 32 h + 8 t + 4 sl + kk  ->  [T, P, h, g, t, sl, rh, byte]
    v = u.reshape(T, 2, 8, C * 8, 2, 4, 2, 4).permute(0, 3, 4, 2, 5, 6, 1, 7)
    codes = v[..., list(_BYTE_OF_KOFF)].reshape(T, C, CODE_BYTES)
    e = torch.zeros((T * TILE_N, C * CHUNK_K // MX_BLOCK), dtype=torch.uint8, device=dev)
    e[:N, :K // MX_BLOCK] = weight_scale
    # block b = 2 P + h of row 16 tile + 8 rh + g  ->  [T, C, P (8), g, h, rh]
    recs = e.reshape(T, 2, 8, C, 8, 2).permute(0, 3, 4, 2, 5, 1).reshape(T, C, RECORD_BYTES)
    blocks = torch.cat([codes, recs], dim=-1).reshape(T // GROUP_TILES, GROUP_TILES, C, -1).permute(0, 2, 1, 3)
    return blocks.contiguous().view(torch.int32)


def mxfp8_unrepack(packed: torch.Tensor, size_n: int, size_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The blob back to the checkpoint layout (e4m3 [N, K], uint8 E8M0 [N, K/32]): the inverse of mxfp8_repack."""
    TG, C = packed.shape[0], packed.shape[1]
    T = TG * GROUP_TILES
    b = packed.contiguous().view(torch.uint8).reshape(TG, C, GROUP_TILES, -1).permute(0, 2, 1, 3).reshape(T, C, -1)
    v = b[..., :CODE_BYTES].reshape(T, C * 8, 2, 8, 4, 2, 2, 4)  # [T, P, h, g, t, sl, rh, byte]
    v = v[..., list(_BYTE_OF_KOFF)]  # byte -> K offset (the permutation is its own inverse)
    u = v.permute(0, 6, 3, 1, 2, 4, 5, 7).reshape(T * TILE_N, C * CHUNK_K)
    r = b[..., CODE_BYTES:].reshape(T, C, 8, 8, 2, 2)  # [T, C, P, g, h, rh]
    e = r.permute(0, 5, 3, 1, 2, 4).reshape(T * TILE_N, C * CHUNK_K // MX_BLOCK)
    return (u[:size_n, :size_k].contiguous().view(FP8_DTYPE),
            e[:size_n, :size_k // MX_BLOCK].contiguous())


def mxfp8_dequant_packed_ref(packed: torch.Tensor, size_n: int, size_k: int) -> torch.Tensor:
    """The blob -> the bf16 weight [size_n, size_k]: code * 2^(e - 127) in fp32, rounded once."""
    q, e = mxfp8_unrepack(packed, size_n, size_k)
    return mxfp8_dequantize(q, e, torch.bfloat16)


def mxfp8_gemm_ref(x: torch.Tensor, packed: torch.Tensor, size_n: int, split_k: int = 0) -> torch.Tensor:
    """x @ W^T with the bf16 weights of the blob, summed in fp32, in x's dtype."""
    K = x.shape[-1]
    w = mxfp8_dequant_packed_ref(packed, size_n, K).float()
    y = x.reshape(-1, K).float() @ w.t()
    return y.to(x.dtype).reshape(*x.shape[:-1], size_n)


def mxfp8_gemm(x: torch.Tensor, packed: torch.Tensor, size_n: int, split_k: int = 0) -> torch.Tensor:
    if x.dtype != torch.bfloat16:  # here too: the CPU path refuses what the kernel refuses
        raise NotImplementedError(f"mxfp8_gemm: x must be bfloat16 (the kernel builds bf16 weights), got {x.dtype}")
    if use_kernel(x, "mxfp8_gemm"):
        return torch.ops.cublade.mxfp8_gemm(x, packed, size_n, split_k)
    return mxfp8_gemm_ref(x, packed, size_n, split_k)


@register_fake("cublade::mxfp8_gemm")
def _mxfp8_gemm_fake(x: torch.Tensor, packed: torch.Tensor, size_n: int, split_k: int = 0) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], size_n))


def mxfp8_dequant_packed(packed: torch.Tensor, size_n: int, size_k: int) -> torch.Tensor:
    if use_kernel(packed, "mxfp8_dequant_packed"):
        return torch.ops.cublade.mxfp8_dequant_packed(packed, size_n, size_k)
    return mxfp8_dequant_packed_ref(packed, size_n, size_k)


@register_fake("cublade::mxfp8_dequant_packed")
def _mxfp8_dequant_packed_fake(packed: torch.Tensor, size_n: int, size_k: int) -> torch.Tensor:
    return packed.new_empty((size_n, size_k), dtype=torch.bfloat16)


# ---- GPUs without Hopper's copy engine (sm_80 / 86 / 89): cublade._C_sm80 ----------------------------------------

def mxfp8_gemm_sm80_ref(x: torch.Tensor, packed: torch.Tensor, size_n: int, row_scale: torch.Tensor | None = None,
                        kernel_only: bool = False) -> torch.Tensor:
    """x @ W^T with the bf16 weights of the blob, summed in fp32, times row_scale [size_n] (fp32) when given, rounded
    once to x's dtype. With a blob of unit exponents (mxfp8_repack(q, 127)) and the fp8 weight scale as row_scale this
    is W8A16 on an `fp8` checkpoint's exact codes."""
    K = x.shape[-1]
    w = mxfp8_dequant_packed_ref(packed, size_n, K).float()
    y = x.reshape(-1, K).float() @ w.t()
    if row_scale is not None:
        y = y * row_scale.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], size_n)


def mxfp8_gemm_sm80(x: torch.Tensor, packed: torch.Tensor, size_n: int, row_scale: torch.Tensor | None = None,
                    kernel_only: bool = False) -> torch.Tensor:
    """`mxfp8_gemm_sm80_ref` on the sm_80-89 kernel (csrc/sm80/lowbit_gemm_sm80.cu: cp.async stages, mma.sync; the
    same fp32 sums up to their order) where cublade._C_sm80 is built, on any GPU from sm_80 (the compute_80 PTX on
    later ones). From 64 rows, unless kernel_only, the op dequantizes the weight and runs cuBLAS; with a row_scale the
    weight is then W * row_scale rounded once to bf16 (as vLLM's FP8 Marlin multiplies)."""
    if x.dtype != torch.bfloat16:
        raise NotImplementedError(f"mxfp8_gemm_sm80: x must be bfloat16 (the kernel builds bf16 weights), got "
                                  f"{x.dtype}")
    if use_kernel(x, "mxfp8_gemm_sm80"):
        return torch.ops.cublade.mxfp8_gemm_sm80(x, packed, row_scale, size_n, kernel_only)
    return mxfp8_gemm_sm80_ref(x, packed, size_n, row_scale, kernel_only)


@register_fake("cublade::mxfp8_gemm_sm80", library="_C_sm80")
def _mxfp8_gemm_sm80_fake(x: torch.Tensor, packed: torch.Tensor, row_scale: torch.Tensor | None, size_n: int,
                          kernel_only: bool = False, tiles: int = 0) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], size_n))


def unit_exponents(weight: torch.Tensor) -> torch.Tensor:
    """E8M0 code 127 (2^0) for every 32 K of an [N, K] fp8 weight: mxfp8_repack(weight, unit_exponents(weight)) is the
    blob of an `fp8` checkpoint's codes, whose scale then goes to mxfp8_gemm_sm80's row_scale."""
    N, K = weight.shape
    return torch.full((N, K // MX_BLOCK), 127, dtype=torch.uint8, device=weight.device)
