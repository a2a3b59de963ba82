"""W4A16 GEMM for decode: bf16/fp16 activations x int4 weights (the `w4a16` scheme), and the one-time repack of
the checkpoint layout into the kernel's.

    rp = w4a16_repack(weight_packed, weight_scale, weight_zero_point, group_size)   # once, at load time
    y = w4a16_gemm(x, rp.packed, rp.group_size, rp.symmetric, rp.size_n)          # every call

`w4a16_gemm(x [..., K], packed, group_size, symmetric, size_n, split_k=0, prefill=True) -> [..., size_n]` in x's dtype:
  y = x @ W^T, W = (u - z) * s in fp32 (the checkpoint's dequant, cublade.numerics.int4), summed in fp32, rounded
  once to x's dtype. On a GPU with the extension: `torch.ops.cublade.w4a16_gemm` (kernel: csrc/w4a16_gemm.cu);
  elsewhere the reference `w4a16_gemm_ref`, the same numbers up to fp32 summation order.
  Shapes the kernel takes: any M, any N, K % 8 == 0, K % group_size == 0, group_size in (32, 64, 128, -1); x
  bf16 or fp16. Up to 16 rows the streaming kernel (mma.sync, weights read once per 32 tokens); from 17 rows at
  group size 128 or per channel (from 9 on weights of 2^27 elements or more) the wide kernel (wgmma, 16 to 128
  tokens per pass, a workspace for x; with bf16 x at group size 128, from 160 rows, passes of 192 or 256 tokens on the
  weights rounded once to bf16); from 128 rows (448 for those group sizes, 640 on weights of 2^27 elements or
  more; with the rounded passes 257 under 2^25 elements, 640 under 2^26, else 1024) the prefill path:
  `w4a16_dequant` to x's dtype, then a cuBLAS GEMM (the weights rounded once to x's dtype; the reference keeps
  them in fp32). `prefill=False` keeps every M on the kernels with the weights exact, whose numerics do not depend
  on M beyond fp32 summation order (batch-invariant serving). `split_k` (K splits per thread-block cluster, 1..8, which also forces
  the streaming kernel at any M; 0 = automatic) is for tuning and tests.

`w4a16_dequant` (cublade.ops.w4a16_dequant) turns the same blob into a dense weight: the prefill path.

Repacked layout (the kernel's; kernels never see the checkpoint layout): one int32 blob
  packed [ceil(N/64), ceil(K/512), 4, 1024 + sbytes/4]
N is zero-padded to 64 rows (a tile group: 4 tiles of 16 rows), K to 512 (a chunk: 8 packets of 64). For
each (tile group, chunk, tile) the blob holds one contiguous tile block, so the kernel fetches a chunk of
the 4 tiles with one bulk copy:
  words 0..1023    8 packets x 32 lanes x 4 words. Lane (g, t) = (lane // 4, lane % 4), word s (one mma
                   k-step) holds rows g and g+8 of the tile at K0 = 64*packet + 32*(s//2) + 8*t + 4*(s%2) ..
                   K0+3 (packet-relative to the chunk), nibble j at bits 4j: j=0 (row g, K0), 4 (g, K0+1),
                   1 (g+8, K0), 5 (g+8, K0+1), 2 (g, K0+2), 6 (g, K0+3), 3 (g+8, K0+2), 7 (g+8, K0+3).
  then sbytes      the chunk's scale records, [512/G groups][8 g] x bf16 (s[row g], s[row g+8]); asymmetric
                   (s[g], s[g+8], z[g], z[g+8]) with z exact in bf16; per channel (G = -1): one record,
                   repeated in every chunk.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from cublade.numerics.constants import INT4_SYM_OFFSET, W4A16_GROUP_SIZES
from cublade.numerics.int4 import pack_nibbles, unpack_int4, unpack_nibbles
from cublade.ops._dispatch import register_fake, use_kernel

TILE_N = 16  # weight rows per tile (the mma's M)
GROUP_TILES = 4  # tiles per tile group (one CTA)
PACKET_K = 64  # K per 16-byte lane vector
CHUNK_PACKETS = 8  # packets per chunk (512 K)
CHUNK_K = CHUNK_PACKETS * PACKET_K

# Nibble j of a word -> (row offset in the tile: 0 = g, 8 = g+8; K offset from K0).
_ROW_OF_J = (0, 8, 0, 8, 0, 8, 0, 8)
_KOFF_OF_J = (0, 0, 2, 2, 1, 1, 3, 3)


class W4A16Packed(NamedTuple):
    packed: torch.Tensor  # int32 [ceil(N/64), ceil(K/512), 4, 1024 + sbytes/4]
    size_n: int
    size_k: int
    group_size: int
    symmetric: bool


def _check_group(op: str, K: int, group_size: int) -> int:
    if group_size not in W4A16_GROUP_SIZES:
        raise ValueError(f"{op}: group_size must be one of {W4A16_GROUP_SIZES}, got {group_size}")
    if group_size != -1 and K % group_size:
        raise ValueError(f"{op}: in_features K={K} is not a multiple of group_size={group_size}")
    return K if group_size == -1 else group_size


def record_words(group_size: int, symmetric: bool) -> int:
    """int32 words of scale records per tile block."""
    groups = 1 if group_size == -1 else CHUNK_K // group_size
    return groups * 8 * (2 if symmetric else 4) // 2


def pack_fragments(u: torch.Tensor, row_of_j: tuple, koff_of_j: tuple) -> torch.Tensor:
    """Nibbles [T*16, P*64] (T tiles, P packets) -> int32 [T, P, 32, 4]: lane (g, t), word s, nibble j holds row
    row_of_j[j] + g, K = 64p + 32(s//2) + 8t + 4(s%2) + koff_of_j[j]. Shared with fp4_gemm (another j order)."""
    T, P = u.shape[0] // TILE_N, u.shape[1] // PACKET_K
    v = u.reshape(T, 2, 8, P, 2, 4, 2, 4).permute(0, 3, 2, 5, 4, 6, 1, 7)  # (r, p, g, t, h, sl, rh, koff)
    rh = torch.tensor([o // 8 for o in row_of_j], device=u.device)
    ko = torch.tensor(koff_of_j, device=u.device)
    return pack_nibbles(v[..., rh, ko]).reshape(T, P, 32, 4)


def unpack_fragments(words: torch.Tensor, row_of_j: tuple, koff_of_j: tuple) -> torch.Tensor:
    """Inverse of pack_fragments: int32 [T, P, 32, 4] -> nibbles uint8 [T*16, P*64]."""
    T, P = words.shape[0], words.shape[1]
    nib = unpack_nibbles(words.reshape(T, P, 8, 4, 2, 2))  # (r, p, g, t, h, sl, j)
    u = torch.zeros((T, 2, 8, P, 2, 4, 2, 4), dtype=torch.uint8, device=words.device)
    for j in range(8):
        u[:, row_of_j[j] // 8, :, :, :, :, :, koff_of_j[j]] = nib[..., j].permute(0, 2, 1, 4, 3, 5)
    return u.reshape(T * TILE_N, P * PACKET_K)


def to_blob(words: torch.Tensor, records: torch.Tensor) -> torch.Tensor:
    """words int32 [T, P, 32, 4] + records (any dtype) [T, C, rec_bytes] per tile and chunk -> the blob
    int32 [T/4, C, 4, 1024 + rec_bytes/4] (T a multiple of 4, P = 8 C)."""
    T, P = words.shape[0], words.shape[1]
    C = P // CHUNK_PACKETS
    w = words.reshape(T // GROUP_TILES, GROUP_TILES, C, CHUNK_PACKETS * 128).permute(0, 2, 1, 3)
    r = records.contiguous().view(torch.uint8).view(torch.int32).reshape(T // GROUP_TILES, GROUP_TILES, C, -1)
    return torch.cat([w, r.permute(0, 2, 1, 3)], dim=-1).contiguous()


def from_blob(blob: torch.Tensor, rec_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The blob -> (words int32 [T, P, 32, 4], records rec_dtype [T, C, ...bytes]) (inverse of to_blob)."""
    TG, C, G4, W = blob.shape[-4:]
    lead = blob.shape[:-4]
    b = blob.reshape(-1, TG, C, G4, W).permute(0, 1, 3, 2, 4)  # (e, tg, tile, c, W)
    words = b[..., :1024].reshape(*lead, TG * G4, C * CHUNK_PACKETS, 32, 4)
    recs = b[..., 1024:].contiguous().view(torch.uint8).view(rec_dtype).reshape(*lead, TG * G4, C, -1)
    return words, recs


def w4a16_repack(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                 weight_zero_point: torch.Tensor | None, group_size: int) -> W4A16Packed:
    """Checkpoint layout (cublade.numerics.int4: int32 [N, K/8] nibbles along K, bf16 scales [N, K/G], optional
    uint8 zero points [N, K/G]) -> the kernel's blob (module docstring). Runs on the tensors' device."""
    op = "w4a16_repack"
    if weight_packed.dtype != torch.int32 or weight_packed.dim() != 2:
        raise ValueError(f"{op}: weight_packed must be int32 [N, K/8], got {weight_packed.dtype} "
                         f"{tuple(weight_packed.shape)}")
    N, K = weight_packed.shape[0], weight_packed.shape[1] * 8
    G = _check_group(op, K, group_size)
    ng = K // G
    if weight_scale.shape != (N, ng):
        raise ValueError(f"{op}: weight_scale must be [{N}, {ng}] for N={N}, K={K}, group_size={group_size}, "
                         f"got {tuple(weight_scale.shape)}")
    if weight_zero_point is not None and weight_zero_point.shape != (N, ng):
        raise ValueError(f"{op}: weight_zero_point must be [{N}, {ng}], got {tuple(weight_zero_point.shape)}")
    dev = weight_packed.device
    T = -(-N // (TILE_N * GROUP_TILES)) * GROUP_TILES  # tiles, padded to whole tile groups
    C = -(-K // CHUNK_K)  # chunks
    u = torch.zeros((T * TILE_N, C * CHUNK_K), dtype=torch.uint8, device=dev)
    u[:N, :K] = unpack_int4(weight_packed)
    words = pack_fragments(u, _ROW_OF_J, _KOFF_OF_J)

    gpc = 1 if group_size == -1 else CHUNK_K // G  # groups per chunk
    cols = [weight_scale.to(torch.bfloat16)]
    if weight_zero_point is not None:
        cols.append(weight_zero_point.to(torch.bfloat16))  # 0..15: exact
    recs = []
    for c in cols:
        if group_size == -1:
            c = c.expand(N, C)  # the per-channel record, repeated in every chunk
        full = torch.zeros((T * TILE_N, C * gpc), dtype=torch.bfloat16, device=dev)
        full[:N, :c.shape[1]] = c
        recs.append(full.reshape(T, 2, 8, C, gpc).permute(0, 3, 4, 2, 1))  # [T, C, gpc, g, (row g, g+8)]
    records = torch.cat(recs, dim=-1).reshape(T, C, -1)
    packed = to_blob(words, records)
    return W4A16Packed(packed, N, K, group_size, weight_zero_point is None)


def repacked_parts(packed: torch.Tensor, group_size: int, symmetric: bool, size_n: int,
                   size_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blob's unsigned nibbles u [N, K], zero points z and scales s [N, groups] (fp32; z = 8 when symmetric;
    per channel: one group)."""
    words, recs = from_blob(packed, torch.bfloat16)
    T, C = recs.shape[0], recs.shape[1]
    u = unpack_fragments(words, _ROW_OF_J, _KOFF_OF_J)[:size_n, :size_k].float()
    gpc = 1 if group_size == -1 else CHUNK_K // group_size
    ncol = 2 if symmetric else 4
    r = recs.reshape(T, C, gpc, 8, ncol).permute(0, 4, 3, 1, 2).float()  # [T, col, g, C, gpc]

    def rows(col0: int) -> torch.Tensor:  # [N, C*gpc] for (row g, row g+8) columns col0, col0+1
        return torch.stack([r[:, col0], r[:, col0 + 1]], dim=1).reshape(T * TILE_N, C * gpc)[:size_n]

    s = rows(0)
    z = torch.full_like(s, float(INT4_SYM_OFFSET)) if symmetric else rows(2)
    ng = 1 if group_size == -1 else size_k // group_size
    return u, z[:, :ng], s[:, :ng]


def w4a16_dequant_repacked(packed: torch.Tensor, group_size: int, symmetric: bool, size_n: int,
                           size_k: int) -> torch.Tensor:
    """The blob back to the fp32 weight [N, K]: w = (u - z) * s (z = 8 when symmetric)."""
    u, z, s = repacked_parts(packed, group_size, symmetric, size_n, size_k)
    if group_size == -1:
        return (u - z) * s
    ng = size_k // group_size
    ug = u.reshape(size_n, ng, group_size)
    return ((ug - z[:, :, None]) * s[:, :, None]).reshape(size_n, size_k)


def w4a16_gemm_ref(x: torch.Tensor, packed: torch.Tensor, group_size: int, symmetric: bool, size_n: int,
                   split_k: int = 0, prefill: bool = True) -> torch.Tensor:
    """x @ W^T with W dequantized in fp32 from the blob, summed in fp32, in x's dtype."""
    K = x.shape[-1]
    w = w4a16_dequant_repacked(packed, group_size, symmetric, size_n, K)
    y = x.reshape(-1, K).float() @ w.t()
    return y.to(x.dtype).reshape(*x.shape[:-1], size_n)


def w4a16_gemm(x: torch.Tensor, packed: torch.Tensor, group_size: int, symmetric: bool, size_n: int,
               split_k: int = 0, prefill: bool = True) -> torch.Tensor:
    if use_kernel(x, "w4a16_gemm"):
        return torch.ops.cublade.w4a16_gemm(x, packed, group_size, symmetric, size_n, split_k, prefill)
    return w4a16_gemm_ref(x, packed, group_size, symmetric, size_n, split_k, prefill)


@register_fake("cublade::w4a16_gemm")
def _w4a16_gemm_fake(x: torch.Tensor, packed: torch.Tensor, group_size: int, symmetric: bool, size_n: int,
                     split_k: int = 0, prefill: bool = True) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], size_n))



def w4a16_gemm_sm80(x: torch.Tensor, packed: torch.Tensor, group_size: int, symmetric: bool, size_n: int,
                    kernel_only: bool = False) -> torch.Tensor:
    """`w4a16_gemm_ref` on the sm_80-89 kernel (csrc/sm80/lowbit_gemm_sm80.cu: cp.async stages, mma.sync, the same
    blob and register dequant as the Hopper kernels; the same fp32 sums up to their order) where cublade._C_sm80 is
    built, on any GPU from sm_80 (the compute_80 PTX on later ones). From 64 rows, unless kernel_only, the op
    dequantizes the weight (w4a16_dequant's kernel, bit for bit) and runs cuBLAS."""
    if use_kernel(x, "w4a16_gemm_sm80"):
        return torch.ops.cublade.w4a16_gemm_sm80(x, packed, group_size, symmetric, size_n, kernel_only)
    return w4a16_gemm_ref(x, packed, group_size, symmetric, size_n)


@register_fake("cublade::w4a16_gemm_sm80", library="_C_sm80")
def _w4a16_gemm_sm80_fake(x: torch.Tensor, packed: torch.Tensor, group_size: int, symmetric: bool, size_n: int,
                          kernel_only: bool = False, tiles: int = 0) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], size_n))
