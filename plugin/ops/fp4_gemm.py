"""FP4 (MXFP4 / NVFP4) weight GEMM for MoE experts on Hopper: FP4 storage, bf16 math, one call per expert
linear of a layer (all experts at once), or per dense FP4 linear.

    rp = fp4_repack(weight_packed, weight_scale, fmt, global_scale)   # once, at load time; [E, N, K/2] or [N, K/2]
    y = fp4_gemm(x_sorted, rp.packed, rp.row_scale, fmt, rp.size_n, expert_offsets, max_m)

`fp4_gemm(x, packed, row_scale, fmt, size_n, expert_offsets=None, max_m=0, split_k=0, routed_experts=0)
-> bf16 [T, size_n]`
  x               bf16 [T, K], K % 32 == 0; with experts, the rows sorted by expert: rows
                  expert_offsets[e] .. expert_offsets[e+1]-1 go through expert e (the grid covers only the
                  experts with rows, at most T of them)
  packed, row_scale   fp4_repack's output (row_scale None for MXFP4)
  fmt             "mxfp4" | "nvfp4" (cublade.numerics.fp4.Fp4Format)
  size_n          output features N (per expert)
  expert_offsets  int32 [E+1] on x's device, offsets[0] = 0, offsets[E] = T; None when packed holds one expert
                  (int64 is accepted and converted)
  max_m           an upper bound on the rows of any one expert (0: T). It picks the streaming kernel's tokens per
                  pass (8 / 16 / 32); a bound below the truth only costs extra passes, never correctness; a tight
                  one is fastest. Decode: the batch size.
  split_k         K splits per thread-block cluster of the streaming kernel (1..8; any of them forces that kernel),
                  0 = automatic: the streaming kernel below 16 rows per expert (T over min(E, T) experts), the
                  wgmma ("wide") kernel from there (prefill).
  routed_experts  the experts x's rows were routed over, when more than packed holds (expert parallel: the
                  model's; other ranks' rows sit after offsets[E] and are not computed); the rows per expert above
                  are then T over min(routed_experts, T). 0: E. Speed only.
  Row m of the result is x[m] @ W_e^T for the e with offsets[e] <= m < offsets[e+1]; rows outside every
  range (none when offsets[E] = T) are left unwritten. CUDA-graph safe: no host sync, no allocation but the
  output and, for the wide kernel, a workspace of x re-laid out (~(T + 128) x K x 2 bytes, from the caching
  allocator).
Numerics: W = e2m1 * block scale (exact in bf16) [* global scale in fp32 per row, NVFP4], products summed in
fp32 over all of K, rounded once to bf16. The kernel carries powers of two that cancel exactly (its codes are
worth code * 2^-126, its block scales * 2^126, less 2^k moved to the row factor): the same products and sums.
Reference: `fp4_gemm_ref` (the CPU path), equal to cublade.numerics.linear.fp4_linear_ref per expert up to fp32
summation order (and, for NVFP4, the order of the two fp32 scale products: (v * s) * g here, v * (s * g) there;
one rounding apart).

Repacked layout (kernels never see the checkpoint layout): one int32 blob per weight
  packed [E, ceil(N/64), ceil(K/512), 4, 1024 + 128]
with the tile geometry of w4a16_gemm (plugin/ops/w4a16_gemm.py: tile groups of 64 rows, chunks of 512 K, one
contiguous tile block per (expert, group, chunk, tile)):
  words 0..1023   8 packets x 32 lanes x 4 words; lane (g, t), word s (one mma k-step) holds rows g, g+8 at
                  K0 = 64*packet + 32*(s//2) + 8*t + 4*(s%2) .. +3 as 8 E2M1 codes j = 2i + h (fragment
                  register i, its low h = 0 / high h = 1 bf16): j=0 (row g, K0), 1 (g, K0+1), 2 (g+8, K0),
                  3 (g+8, K0+1), 4 (g, K0+2), 5 (g, K0+3), 6 (g+8, K0+2), 7 (g+8, K0+3). Code j's magnitude
                  (3 bits) is at bits 16h + 3i, its sign at bit 16h + 12 + i, so that two shifts and one LOP3
                  place register i's two codes as bf16 bit patterns (magnitude -> bits 6-8, sign -> 15).
  words 1024..    8 packets x 8 g x 8 bytes of scale records: MXFP4 bf16 [half][row g, g+8] = 2^(e-127) *
                  2^(126-k), a power of two (the NaN code stays NaN); NVFP4 e4m3 [block t//2][half][row g, g+8]
                  (the kernel multiplies it by 2^117).
  row_scale       fp32 [E, ceil(N/64)*64]: NVFP4 the global scale of each output row * 2^9 (padded rows 0);
                  MXFP4 2^k, where k > 0 only for an expert with a block scale above 2 (E8M0 > 128), else None.
                  (An MXFP4 expert whose nonzero blocks span more than 2^133 in scale would lose its smallest
                  weights to bf16 underflow; real checkpoints span a few dozen binades at most.)
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from cublade.numerics.constants import MX_BLOCK, NVFP4_BLOCK
from cublade.numerics.fp4 import Fp4Format, e2m1_decode, unpack_fp4
from cublade.numerics.int4 import pack_nibbles, unpack_nibbles
from cublade.numerics.mx import e8m0_to_float
from cublade.ops._dispatch import register_fake, use_kernel
from cublade.ops.w4a16_gemm import (CHUNK_K, CHUNK_PACKETS, GROUP_TILES, TILE_N, from_blob, pack_fragments, to_blob,
                                    unpack_fragments)

# Code j of a word (j = 2i + h: fragment register i, its low (h = 0) or high bf16) -> (row offset 0 = g / 8 = g+8,
# K offset from K0).
_ROW_OF_J = (0, 0, 8, 8, 0, 0, 8, 8)
_KOFF_OF_J = (0, 1, 0, 1, 2, 3, 2, 3)
# Where code j's bits sit in the kernel's word: magnitude (3 bits) at 16h + 3i, sign at 16h + 12 + i. The kernel
# shifts register i's two magnitudes to bits 6-8 / 22-24 and its signs to 15 / 31 at once (docs/kernels.md, fp4_gemm).
_J = torch.arange(8)
_MAG_AT = (16 * (_J % 2) + 3 * (_J // 2)).tolist()
_SIGN_AT = (16 * (_J % 2) + 12 + _J // 2).tolist()
# The kernel's codes are bf16 bit patterns worth code * 2^-126 (the e = 0 codes are bf16 subnormals); the block
# scales carry the 2^126 back. NVFP4 keeps 9 of it in the row factor so that 448 * 2^117 fits in bf16.
CODE_BIAS_LOG2 = 126
NVFP4_ROW_LOG2 = 9
_MX_MAX_E8M0 = 128  # 2^(128-127) * 2^126 = 2^127: the largest MXFP4 record without a row factor


def _spread_codes(words: torch.Tensor) -> torch.Tensor:
    """int32 words with code j in nibble j (pack_fragments) -> the kernel's bit layout (_MAG_AT, _SIGN_AT)."""
    u = unpack_nibbles(words).to(torch.int64)  # [..., 8]
    mag, sign = torch.tensor(_MAG_AT, device=u.device), torch.tensor(_SIGN_AT, device=u.device)
    w = (((u & 7) << mag) | ((u >> 3) << sign)).sum(dim=-1)  # disjoint bits: the sum is an OR, < 2^32
    return (w - ((w >= 2**31).to(torch.int64) << 32)).to(torch.int32)


def _gather_codes(words: torch.Tensor) -> torch.Tensor:
    """Inverse of _spread_codes."""
    w = (words.to(torch.int64) & 0xFFFFFFFF).unsqueeze(-1)
    mag, sign = torch.tensor(_MAG_AT, device=w.device), torch.tensor(_SIGN_AT, device=w.device)
    return pack_nibbles(((w >> mag) & 7) | (((w >> sign) & 1) << 3))


class FP4Packed(NamedTuple):
    packed: torch.Tensor  # int32 [E, ceil(N/64), ceil(K/512), 4, 1152]
    row_scale: torch.Tensor | None  # fp32 [E, ceil(N/64)*64] (nvfp4)
    size_n: int
    size_k: int
    fmt: str  # an Fp4Format value, as the kernel takes it


def fp4_repack(weight_packed: torch.Tensor, weight_scale: torch.Tensor, fmt: Fp4Format | str,
               global_scale: torch.Tensor | None = None) -> FP4Packed:
    """Checkpoint FP4 tensors (cublade.numerics.fp4) -> the kernel's layout.

    weight_packed  uint8 [E, N, K/2] or [N, K/2] (element 2i low nibble, 2i+1 high)
    weight_scale   mxfp4: uint8 E8M0 [.., N, K/32]; nvfp4: e4m3 [.., N, K/16]
    global_scale   nvfp4 only: fp32 with one value per expert ([E], [E, 1], or a scalar / [1] without experts),
                   or [E, P]: P parts splitting the N rows equally (vLLM's fused w13 = [w1; w3] has P = 2).
    """
    op = "fp4_repack"
    fmt = Fp4Format.lookup(fmt, "FP4 format", op)
    dense = weight_packed.dim() == 2
    if dense:
        weight_packed, weight_scale = weight_packed.unsqueeze(0), weight_scale.unsqueeze(0)
    if weight_packed.dtype != torch.uint8 or weight_packed.dim() != 3:
        raise ValueError(f"{op}: weight_packed must be uint8 [E, N, K/2] or [N, K/2], got {weight_packed.dtype} "
                         f"{tuple(weight_packed.shape)}")
    E, N, K = weight_packed.shape[0], weight_packed.shape[1], weight_packed.shape[2] * 2
    if K % 32:
        raise ValueError(f"{op}: in_features K={K} must be a multiple of 32")
    block = fmt.block
    want_dtype = torch.uint8 if fmt is Fp4Format.MXFP4 else torch.float8_e4m3fn
    if weight_scale.shape != (E, N, K // block) or weight_scale.dtype != want_dtype:
        raise ValueError(f"{op}: {fmt} weight_scale must be {want_dtype} [E={E}, N={N}, K/{block}={K // block}], "
                         f"got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    if fmt is Fp4Format.MXFP4 and global_scale is not None:
        raise ValueError(f"{op}: mxfp4 has no global scale")
    if fmt is Fp4Format.NVFP4 and global_scale is None:
        raise ValueError(f"{op}: nvfp4 needs the global scale (weight_global_scale)")
    dev = weight_packed.device
    if fmt is Fp4Format.MXFP4:
        # Per expert, k = how far its largest scale exceeds what a bf16 record can hold times 2^126; the row
        # factor 2^k puts it back in fp32. Exact unless an expert's nonzero blocks span over 2^133 in scale.
        finite = torch.where(weight_scale == 255, torch.zeros_like(weight_scale), weight_scale)
        mx_shift = (finite.reshape(E, -1).amax(dim=1).to(torch.int64) - _MX_MAX_E8M0).clamp(min=0).tolist()
    T = -(-N // (TILE_N * GROUP_TILES)) * GROUP_TILES
    C = -(-K // CHUNK_K)
    P = C * CHUNK_PACKETS
    Np, Kp = T * TILE_N, C * CHUNK_K

    blobs = []
    for e in range(E):
        nib = torch.zeros((Np, Kp), dtype=torch.uint8, device=dev)
        nib[:N, :K] = unpack_fp4(weight_packed[e])
        words = _spread_codes(pack_fragments(nib, _ROW_OF_J, _KOFF_OF_J))  # [T, P, 32, 4]
        if fmt is Fp4Format.MXFP4:
            s = torch.zeros((Np, Kp // MX_BLOCK), dtype=torch.bfloat16, device=dev)
            # 2^(e-127) * 2^(126 - k): a power of two, exact in bf16 (e = 255 stays NaN)
            s[:N, :K // MX_BLOCK] = torch.ldexp(e8m0_to_float(weight_scale[e]),
                                                torch.tensor(float(CODE_BIAS_LOG2 - mx_shift[e]), device=dev))
            rec = s.reshape(T, 2, 8, P, 2).permute(0, 3, 2, 4, 1)  # [T, P, g, half, row]
        else:
            s = torch.zeros((Np, Kp // NVFP4_BLOCK), dtype=torch.float8_e4m3fn, device=dev)
            s[:N, :K // NVFP4_BLOCK] = weight_scale[e]
            rec = s.reshape(T, 2, 8, P, 2, 2).permute(0, 3, 2, 5, 4, 1)  # [T, P, g, block, half, row]
        rec = rec.contiguous().view(torch.uint8).reshape(T, C, -1)  # 8 packets x 64 bytes per chunk
        blobs.append(to_blob(words, rec))
    packed = torch.stack(blobs)

    row_scale = None
    if fmt is Fp4Format.MXFP4 and any(mx_shift):
        row_scale = torch.tensor([2.0 ** k for k in mx_shift], device=dev).unsqueeze(1).repeat(1, Np)
    if fmt is Fp4Format.NVFP4:
        gs = global_scale.float().to(dev)
        gs = gs.reshape(1, -1) if dense else gs.reshape(E, -1)
        parts = gs.shape[1]
        if gs.shape[0] != E or N % parts:
            raise ValueError(f"{op}: global_scale must hold one value per expert, or [E, P] with P dividing "
                             f"N={N}; got shape {tuple(global_scale.shape)} for E={E}")
        row_scale = torch.zeros((E, Np), dtype=torch.float32, device=dev)
        row_scale[:, :N] = gs.repeat_interleave(N // parts, dim=1) * 2.0 ** NVFP4_ROW_LOG2  # exact
    return FP4Packed(packed, row_scale, N, K, fmt.value)


def fp4_dequant_repacked(packed: torch.Tensor, row_scale: torch.Tensor | None, fmt: Fp4Format | str, size_n: int,
                         size_k: int) -> torch.Tensor:
    """The blob back to fp32 weights [E, N, K]: e2m1 * (the kernel's block scale * 2^-126) [* row_scale]: MXFP4
    (e2m1 * 2^(e-127-k)) * 2^k, NVFP4 (e2m1 * s * 2^-9) * (global * 2^9), each the checkpoint's value."""
    fmt = Fp4Format.lookup(fmt, "FP4 format", "fp4_dequant_repacked")
    words, recs = from_blob(packed, torch.uint8)  # [E, T, P, 32, 4], [E, T, C, 512 bytes]
    E, T, C = recs.shape[0], recs.shape[1], recs.shape[2]
    P = C * CHUNK_PACKETS
    w = []
    for e in range(E):
        v = e2m1_decode(unpack_fragments(_gather_codes(words[e]), _ROW_OF_J, _KOFF_OF_J))  # [T*16, P*64]
        if fmt is Fp4Format.MXFP4:
            s = recs[e].reshape(T, P, 8, 2, 2, 2).contiguous().view(torch.bfloat16).reshape(T, P, 8, 2, 2)
            s = s.permute(0, 4, 2, 1, 3).reshape(T * TILE_N, P * 2).float()  # [row, block of 32]
            s = torch.ldexp(s, torch.tensor(-float(CODE_BIAS_LOG2)))  # exact (at worst an fp32 subnormal)
            block = MX_BLOCK
        else:
            s = recs[e].reshape(T, P, 8, 2, 2, 2).contiguous().view(torch.float8_e4m3fn)
            s = s.permute(0, 5, 2, 1, 4, 3).reshape(T * TILE_N, P * 4).float()  # [row, block of 16]
            s = torch.ldexp(s, torch.tensor(-float(NVFP4_ROW_LOG2)))  # the kernel's s * 2^117 * 2^-126
            block = NVFP4_BLOCK
        we = (v.reshape(T * TILE_N, -1, block) * s.unsqueeze(-1)).reshape(T * TILE_N, -1)
        if row_scale is not None:
            we = we * row_scale[e].float().unsqueeze(-1)
        w.append(we[:size_n, :size_k])
    return torch.stack(w)


def fp4_gemm_ref(x: torch.Tensor, packed: torch.Tensor, row_scale: torch.Tensor | None, fmt: str, size_n: int,
                 expert_offsets: torch.Tensor | None = None, max_m: int = 0, split_k: int = 0) -> torch.Tensor:
    """Per expert: x[rows of e] @ W_e^T in fp32, rounded to bf16 (rows outside every range stay 0)."""
    w = fp4_dequant_repacked(packed, row_scale, fmt, size_n, x.shape[-1])
    E = w.shape[0]
    if expert_offsets is None:
        if E != 1:
            raise ValueError(f"fp4_gemm: packed holds {E} experts: pass expert_offsets [{E + 1}]")
        return (x.float() @ w[0].t()).to(x.dtype)
    offs = expert_offsets.tolist()
    y = torch.zeros((x.shape[0], size_n), dtype=torch.float32, device=x.device)
    for e in range(E):
        if offs[e + 1] > offs[e]:
            y[offs[e]:offs[e + 1]] = x[offs[e]:offs[e + 1]].float() @ w[e].t()
    return y.to(x.dtype)


def fp4_gemm(x: torch.Tensor, packed: torch.Tensor, row_scale: torch.Tensor | None, fmt: str, size_n: int,
             expert_offsets: torch.Tensor | None = None, max_m: int = 0, split_k: int = 0,
             routed_experts: int = 0) -> torch.Tensor:
    if expert_offsets is not None and expert_offsets.dtype != torch.int32:
        expert_offsets = expert_offsets.to(torch.int32)
    if use_kernel(x, "fp4_gemm"):
        return torch.ops.cublade.fp4_gemm(x, packed, row_scale, fmt, size_n, expert_offsets, max_m, split_k,
                                          routed_experts)
    return fp4_gemm_ref(x, packed, row_scale, fmt, size_n, expert_offsets, max_m, split_k)


@register_fake("cublade::fp4_gemm")
def _fp4_gemm_fake(x: torch.Tensor, packed: torch.Tensor, row_scale: torch.Tensor | None, format: str, size_n: int,
                   expert_offsets: torch.Tensor | None = None, max_m: int = 0, split_k: int = 0,
                   routed_experts: int = 0) -> torch.Tensor:
    return x.new_empty((x.shape[0], size_n))
