// MXFP8 blob decoding shared by the Hopper kernels (mxfp8_gemm.cu) and the sm_80-89 streaming kernel
// (sm80/lowbit_gemm_sm80.cu): e4m3 codes and E8M0 block exponents -> the exact bf16 weights as mma.m16n8k16 A fragments.
// Plain integer and bf16 arithmetic (PRMT, LOP3, HMUL2.BF16): sm_80 and later. The blob: mxfp8_gemm.cu's header.
#pragma once

#include "w4a16_gemm.cuh"
#include "w4a16_gemm.h"

namespace cublade {
namespace mxfp8 {
namespace {  // one copy per translation unit (internal linkage, as the kernels instantiated with these)

using lowbit::hmul2_bf16;

// One word of a row's codes (K0, K0 + 2, K0 + 1, K0 + 3 in bytes 0..3) -> bf16 pairs (K0, K0 + 1) and (K0 + 2, K0 + 3),
// each code * 2^-120: magnitudes to bits 4-10 / 20-26, signs to 15 / 31.
__device__ __forceinline__ void e4m3_pairs(uint32_t w, uint32_t& lo, uint32_t& hi) {
  lo = lowbit::and_or(w << 4, 0x07F007F0u, (w << 8) & 0x80008000u);  // bytes 0, 2
  hi = lowbit::and_or(w >> 4, 0x07F007F0u, w & 0x80008000u);         // bytes 1, 3
}

// A packet's record word (e of rows g, g + 8 in half 0, then half 1) -> the bf16 pairs (f, f) of rows g and g + 8 for
// half h, f = 2^(e - 7): the codes' 2^-120 times the block scale 2^(e - 127). bf16 bits of f: (e + 120) << 7.
__device__ __forceinline__ void factors(uint32_t r, int h, uint32_t& f_lo, uint32_t& f_hi) {
  const uint32_t v = (lowbit::prmt(r, 0u, h == 0 ? 0x4140u : 0x4342u) + 0x00780078u) << 7;  // (f[g], f[g + 8])
  f_lo = lowbit::prmt(v, v, 0x1010u);
  f_hi = lowbit::prmt(v, v, 0x3232u);
}

// k-step's A fragment from the words of rows g and g + 8: registers (g, K0..), (g + 8, K0..), (g, K0 + 2..),
// (g + 8, K0 + 2..), times the block factors.
__device__ __forceinline__ void dequant_step(uint32_t wg, uint32_t wg8, uint32_t f_g, uint32_t f_g8, uint32_t (&a)[4]) {
  uint32_t lo, hi;
  e4m3_pairs(wg, lo, hi);
  a[0] = hmul2_bf16(lo, f_g);
  a[2] = hmul2_bf16(hi, f_g);
  e4m3_pairs(wg8, lo, hi);
  a[1] = hmul2_bf16(lo, f_g8);
  a[3] = hmul2_bf16(hi, f_g8);
}

// Packet j's 4 k-steps -> A fragments (the exact weights). v0, v1: this lane's two vectors of the packet (halves 0,
// 1); srec: the records of the packets' K slice or stage.
__device__ __forceinline__ void dequant_packet(const uint4 v0, const uint4 v1, const unsigned char* srec, int j,
                                               int lane, uint32_t (&a)[4][4]) {
  const uint32_t r = *reinterpret_cast<const uint32_t*>(srec + (j * 8 + (lane >> 2)) * 4);
  uint32_t f0_lo, f0_hi, f1_lo, f1_hi;
  factors(r, 0, f0_lo, f0_hi);
  factors(r, 1, f1_lo, f1_hi);
  dequant_step(v0.x, v0.y, f0_lo, f0_hi, a[0]);
  dequant_step(v0.z, v0.w, f0_lo, f0_hi, a[1]);
  dequant_step(v1.x, v1.y, f1_lo, f1_hi, a[2]);
  dequant_step(v1.z, v1.w, f1_lo, f1_hi, a[3]);
}

constexpr int kCodePacketBytes = 1024;  // 16 rows x 64 K of 1-byte codes
constexpr int kBlockBytes = lowbit::kChunk * kCodePacketBytes + kMxfp8RecordBytes;  // a tile block: 8448 bytes
static_assert(kBlockBytes == 4 * (2 * kLowbitTileWords + kMxfp8RecordBytes / 4), "w4a16_gemm.h's geometry");

// MXFP8 packets for the streaming kernel: the weights are exact in bf16, the mma's sum all of K in fp32.
template <int NT_>
struct Mxfp8Policy {
  using T = __nv_bfloat16;
  static constexpr int NT = NT_;
  static constexpr int kPacketBytes = kCodePacketBytes;
  static constexpr int kSBytes = kMxfp8RecordBytes;  // 32 bytes of records per packet per tile
  struct State {};
  template <int kSliceK>
  __device__ static const unsigned char* slice_records(const unsigned char* srec, int slice) {
    return srec + slice * (kSliceK / lowbit::kPacketK) * 32;
  }
  __device__ static const float* row_scale(const lowbit::GemmParams&, int) { return nullptr; }
  template <int j, int kSliceK>
  __device__ static void packet(State&, const uint4 (&q)[2], const unsigned char* srec, const uint4 (&xc)[2][NT],
                                float (&acc)[NT][4], int lane) {
    uint32_t a[4][4];
    dequant_packet(q[0], q[1], srec, j, lane, a);
    lowbit::mma_packet<T>(acc, a, xc);
  }
};

// ---- dequantize (the prefill path) ----
// One CTA per (tile group, chunk), one warp per tile block (its ~8.4 KB of the blob contiguous), no shared memory:
// each lane loads its 16 vectors and 8 record words before any use, then writes rows g and g + 8 of its 8-K runs as
// 16-byte bf16 vectors (the 4 lanes of a row cover 64 contiguous bytes per store). The same dequant_step as the GEMMs,
// so the prefill weights are the decode weights bit for bit.
constexpr int kDequantThreads = 32 * lowbit::kGroupTiles;


// Two bf16 weights times a row's fp32 scale, the product rounded to fp32, then to bf16 (as torch's
// (w.float() * s).to(bfloat16)).
__device__ __forceinline__ uint32_t scale_bf16x2(uint32_t v, float f) {
  const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  const __nv_bfloat162 r = __floats2bfloat162_rn(x.x * f, x.y * f);
  return *reinterpret_cast<const uint32_t*>(&r);
}

template <bool kRowScale>
__device__ __forceinline__ void dequant_packed(const unsigned char* __restrict__ packed, int chunks, int N, int K,
                                               __nv_bfloat16* __restrict__ out, const float* __restrict__ row_scale) {
  const int tile = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t row = static_cast<int64_t>(blockIdx.x / chunks) * kLowbitGroupRows + tile * lowbit::kTileN + g;  // and +8
  if (row - g >= N) return;  // a padding tile (warp-uniform)
  const int64_t k_chunk = static_cast<int64_t>(blockIdx.x % chunks) * kLowbitChunkK;
  const unsigned char* blk =
      packed + (static_cast<int64_t>(blockIdx.x) * lowbit::kGroupTiles + tile) * kBlockBytes;

  uint4 q[lowbit::kChunk][2];
#pragma unroll
  for (int p = 0; p < lowbit::kChunk; ++p)
#pragma unroll
    for (int h = 0; h < 2; ++h) q[p][h] = ld_nc_v4(blk + p * kCodePacketBytes + h * 512 + lane * 16);
  uint32_t rec[lowbit::kChunk];
#pragma unroll
  for (int p = 0; p < lowbit::kChunk; ++p)
    rec[p] = __ldg(reinterpret_cast<const uint32_t*>(blk + lowbit::kChunk * kCodePacketBytes) + p * 8 + g);

  const bool lo_ok = row < N, hi_ok = row + 8 < N;
  float f_row_lo = 1.0f, f_row_hi = 1.0f;
  if constexpr (kRowScale) {
    if (lo_ok) f_row_lo = __ldg(row_scale + row);
    if (hi_ok) f_row_hi = __ldg(row_scale + row + 8);
  }
  __nv_bfloat16* out_lo = out + row * K + k_chunk + 8 * t;
  __nv_bfloat16* out_hi = out_lo + static_cast<int64_t>(8) * K;
#pragma unroll
  for (int p = 0; p < lowbit::kChunk; ++p) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k = lowbit::kPacketK * p + 32 * h;  // chunk-relative K of this half; the lane's 8 start at k + 8t
      if (k_chunk + k + 8 * t >= K) continue;  // K % 32 == 0: the lane's 8 are all in or all out
      uint32_t f_lo, f_hi;
      factors(rec[p], h, f_lo, f_hi);
      uint32_t s0[4], s1[4];  // k-steps 2h, 2h + 1: K0 .. K0 + 3 and K0 + 4 .. K0 + 7 of rows g, g + 8
      dequant_step(q[p][h].x, q[p][h].y, f_lo, f_hi, s0);
      dequant_step(q[p][h].z, q[p][h].w, f_lo, f_hi, s1);
      if constexpr (kRowScale) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          s0[i] = scale_bf16x2(s0[i], i % 2 ? f_row_hi : f_row_lo);
          s1[i] = scale_bf16x2(s1[i], i % 2 ? f_row_hi : f_row_lo);
        }
      }
      if (lo_ok) __stwb(reinterpret_cast<uint4*>(out_lo + k), make_uint4(s0[0], s0[2], s1[0], s1[2]));
      if (hi_ok) __stwb(reinterpret_cast<uint4*>(out_hi + k), make_uint4(s0[1], s0[3], s1[1], s1[3]));
    }
  }
}


__global__ void __launch_bounds__(kDequantThreads)
dequant_packed_kernel(const unsigned char* __restrict__ packed, int chunks, int N, int K,
                      __nv_bfloat16* __restrict__ out) {
  dequant_packed<false>(packed, chunks, N, K, out, nullptr);
}

#ifdef CUBLADE_MXFP8_SCALED_DEQUANT  // only the library that launches it (cublade._C_sm80) compiles it
// The same with each row's weights times row_scale[row] (fp8 codes stored with unit exponents: W8A16's prefill).
__global__ void __launch_bounds__(kDequantThreads)
dequant_packed_scaled_kernel(const unsigned char* __restrict__ packed, int chunks, int N, int K,
                             __nv_bfloat16* __restrict__ out, const float* __restrict__ row_scale) {
  dequant_packed<true>(packed, chunks, N, K, out, row_scale);
}
#endif

}  // namespace
}  // namespace mxfp8
}  // namespace cublade
