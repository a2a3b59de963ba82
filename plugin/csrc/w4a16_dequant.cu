// W4A16 dequant for prefill: the repacked int4 blob (w4a16_repack) -> the dense weight W[N, K] in bf16 / fp16,
// w = (u - z) * s in fp32 (z = 8 symmetric), rounded once to the output dtype (round to nearest even). The
// product is exact in fp32 (|u - z| <= 15 times an 8-bit bf16 significand, subnormals included), so the result
// is bit for bit the reference's: cublade.ops.w4a16_gemm.w4a16_dequant_repacked(...).to(dtype). For large M
// the vLLM method dequantizes once and calls cuBLAS, which beats re-reading the weights per 32-token pass of
// w4a16_gemm (docs/kernels.md, "w4a16_gemm", "Large M").
//
// The blob (documented in w4a16_gemm.cu and plugin/ops/w4a16_gemm.py): int32 [ceil(N/64), ceil(K/512), 4 tiles,
// 1024 + record words]; per tile block 8 packets x 32 lanes x 4 words (16 bytes), then the chunk's scale
// records [512/G][8 g] (s[g], s[g+8]) bf16 (asymmetric: then (z[g], z[g+8])). Lane (g, t), word s holds rows g
// and g+8 at K0(s) = 64*packet + 32*(s/2) + 8*t + 4*(s%2) .. +3, nibble j at bits 4j: row g at K0..K0+3 in
// j = 0, 4, 2, 6; row g+8 in j = 1, 5, 3, 7. So words 0, 1 hold 8 consecutive K (8t .. 8t+7 of the packet's
// first 32) of both rows, words 2, 3 the same 8 of its second 32: each lane writes four 16-byte vectors per
// packet, and in each store instruction the 4 lanes of a row (t = 0..3) cover 64 contiguous bytes.
#define CUBLADE_KERNELS_ONLY  // framework-free (no torch header); the torch wrapper is w4a16_dequant_torch.cpp
#include "common.cuh"
#include "w4a16_gemm.h"

#include <type_traits>

namespace cublade {
namespace {

constexpr int kTileN = 16;                         // rows per tile block (one warp)
constexpr int kTiles = kLowbitGroupRows / kTileN;  // tile blocks per (tile group, chunk) = warps per CTA
constexpr int kPackets = kLowbitChunkK / 64;       // 16-byte vectors per lane per tile block
constexpr int kThreads = 32 * kTiles;

// 2^23 + u (u < 16) as an fp32 from its bits: OR u into the mantissa of 2^23 (ulp 1). Subtracting 2^23 + z gives
// u - z exactly, without an integer-to-float conversion (I2F issues at a fraction of the FADD rate).
constexpr uint32_t kMagic = 0x4B000000u;
constexpr float kMagicF = 8388608.0f;

template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {  // a in the low half (the lower address)
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

// 8 consecutive K of one row from words (w0: K0..K0+3, w1: K0+4..K0+7); sh = 0 for row g, 4 for row g+8.
// zb = 2^23 + z, s: the group's scale (fp32, exact from bf16).
template <typename T>
__device__ __forceinline__ uint4 dequant8(uint32_t w0, uint32_t w1, int sh, float zb, float s) {
  auto w = [&](uint32_t q, int j) { return (__uint_as_float(kMagic | ((q >> (4 * j + sh)) & 0xFu)) - zb) * s; };
  return make_uint4(pack2<T>(w(w0, 0), w(w0, 4)), pack2<T>(w(w0, 2), w(w0, 6)),
                    pack2<T>(w(w1, 0), w(w1, 4)), pack2<T>(w(w1, 2), w(w1, 6)));
}

// One lane's share of one (tile group, chunk) block of the blob: its 8 packet vectors and its rows' scale records
// (s pair[, z pair] of rows g, g+8), all loads issued before any use. Rows row and row + 8; k_chunk: the chunk's
// first K. padding: the warp's tile lies past N (warp-uniform).
template <int GS, bool ASYM>
struct BlockLoad {
  using Rec = typename std::conditional<ASYM, uint2, uint32_t>::type;
  static constexpr int kGS = GS == 0 ? kLowbitChunkK : GS;
  static constexpr int kGroups = kLowbitChunkK / kGS;  // groups per chunk
  static constexpr int kBlockWords = kLowbitTileWords + kGroups * 8 * static_cast<int>(sizeof(Rec) / 4);
  int g, t;
  int64_t row, k_chunk;
  bool padding;
  uint4 q[kPackets];
  Rec rec[kGroups];

  __device__ __forceinline__ BlockLoad(const uint32_t* __restrict__ packed, int chunks, int N) {
    const int tile = threadIdx.x / 32, lane = threadIdx.x % 32;
    g = lane / 4; t = lane % 4;
    row = static_cast<int64_t>(blockIdx.x / chunks) * kLowbitGroupRows + tile * kTileN + g;  // and + 8
    k_chunk = static_cast<int64_t>(blockIdx.x % chunks) * kLowbitChunkK;
    padding = row - g >= N;
    if (padding) return;
    const uint32_t* blk = packed + (static_cast<int64_t>(blockIdx.x) * kTiles + tile) * kBlockWords;
#pragma unroll
    for (int p = 0; p < kPackets; ++p) q[p] = ld_nc_v4(blk + (p * 32 + lane) * 4);
    const Rec* recs = reinterpret_cast<const Rec*>(blk + kLowbitTileWords) + g;
#pragma unroll
    for (int i = 0; i < kGroups; ++i) rec[i] = __ldg(recs + i * 8);
  }
};

// One CTA per (tile group, chunk), one warp per tile block: the CTA's 4 tile blocks are contiguous in the blob
// (one ~17 KB span), and small CTAs (one per 64 x 512 of the weight) leave little tail at the end of the grid.
// Each lane issues its 8 word loads and its scale-record loads before any use (128 B+ in flight per lane: the
// memory-level parallelism a bandwidth-bound kernel needs; no shared memory, no barriers), then converts and
// stores. GS: 32 / 64 / 128, or 0 = per channel (one record per chunk, repeated by the repack). The outputs use
// default (write-back) stores, not evict-first: the GEMM reads them right after, so what still sits in L2 hits.
template <typename T, int GS, bool ASYM>
__global__ void __launch_bounds__(kThreads)
w4a16_dequant_kernel(const uint32_t* __restrict__ packed, int chunks, int N, int K, T* __restrict__ out) {
  using B = BlockLoad<GS, ASYM>;
  using Rec = typename B::Rec;
  B b(packed, chunks, N);
  if (b.padding) return;  // a padding tile (warp-uniform)
  const int t = b.t;
  const int64_t row = b.row, k_chunk = b.k_chunk;
  const bool lo_ok = row < N, hi_ok = row + 8 < N;
  T* out_lo = out + row * K + k_chunk + 8 * t;
  T* out_hi = out_lo + static_cast<int64_t>(8) * K;
#pragma unroll
  for (int p = 0; p < kPackets; ++p) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k = 64 * p + 32 * h;  // chunk-relative K of this half-packet; the lane's 8 start at k + 8t
      if (k_chunk + k + 8 * t >= K) continue;  // K % 8 == 0: the lane's 8 are all in or all out
      const Rec r = b.rec[k / B::kGS];
      float z_lo = 8.0f, z_hi = 8.0f, s_lo, s_hi;
      if constexpr (ASYM) {
        s_lo = bf16_lo(r.x); s_hi = bf16_hi(r.x);
        z_lo = bf16_lo(r.y); z_hi = bf16_hi(r.y);
      } else {
        s_lo = bf16_lo(r); s_hi = bf16_hi(r);
      }
      const uint32_t w0 = h ? b.q[p].z : b.q[p].x, w1 = h ? b.q[p].w : b.q[p].y;
      // __stwb: one 16-byte store (nvcc 13.0 split one plain uint4 assignment of this loop into four 4-byte ones)
      if (lo_ok) __stwb(reinterpret_cast<uint4*>(out_lo + k), dequant8<T>(w0, w1, 0, kMagicF + z_lo, s_lo));
      if (hi_ok) __stwb(reinterpret_cast<uint4*>(out_hi + k), dequant8<T>(w0, w1, 4, kMagicF + z_hi, s_hi));
    }
  }
}

template <typename T, int GS, bool ASYM>
cudaError_t launch_typed(const W4a16DequantArgs& a, cudaStream_t stream) {
  const int chunks = static_cast<int>(ceil_div(a.K, kLowbitChunkK));
  const int64_t blocks = ceil_div(a.N, kLowbitGroupRows) * chunks;
  w4a16_dequant_kernel<T, GS, ASYM><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const uint32_t*>(a.packed), chunks, static_cast<int>(a.N), static_cast<int>(a.K),
      static_cast<T*>(a.out));
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_dtype(const W4a16DequantArgs& a, cudaStream_t stream) {
  return with_int4_group(a.group_size, a.asym, [&](auto gs, auto asym) {
    return launch_typed<T, decltype(gs)::value, decltype(asym)::value>(a, stream);
  });
}


// The FP8 form of the same blob (w4a16_dequant_fp8): codes[n, k] = e4m3(u - z), exact (|u - z| <= 15), and the
// scales as fp32 scale_t[k / 128, n] (per channel: the row's scale repeated per 128 K), for a GEMM on FP8 tensor
// cores that applies the weight scales per 1 x 128 block. Same CTA / lane mapping as w4a16_dequant_kernel; each
// lane stores 8 bytes per half-packet, and the t = 0 lanes of rows g, g + 8 store the chunk's 4 scales.
template <int GS, bool ASYM>
__global__ void __launch_bounds__(kThreads)
w4a16_dequant_fp8_kernel(const uint32_t* __restrict__ packed, int chunks, int N, int K, uint8_t* __restrict__ out,
                         float* __restrict__ scale_t) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890  // no E4M3 conversion before sm_89 (cublade._C_sm80's sm_80 / 86)
  __trap();
#else
  using B = BlockLoad<GS, ASYM>;
  using Rec = typename B::Rec;
  B b(packed, chunks, N);
  if (b.padding) return;  // a padding tile (warp-uniform)
  const int t = b.t;
  const int64_t row = b.row, k_chunk = b.k_chunk;
  const bool lo_ok = row < N, hi_ok = row + 8 < N;
  uint8_t* out_lo = out + row * K + k_chunk + 8 * t;
  uint8_t* out_hi = out_lo + static_cast<int64_t>(8) * K;
  auto codes8 = [](uint32_t w0, uint32_t w1, int sh, float zb) {
    auto c = [&](uint32_t w, int j) { return __uint_as_float(kMagic | ((w >> (4 * j + sh)) & 0xFu)) - zb; };
    return make_uint2(f32x4_to_e4m3x4(c(w0, 0), c(w0, 4), c(w0, 2), c(w0, 6)),
                      f32x4_to_e4m3x4(c(w1, 0), c(w1, 4), c(w1, 2), c(w1, 6)));
  };
#pragma unroll
  for (int p = 0; p < kPackets; ++p) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k = 64 * p + 32 * h;
      if (k_chunk + k + 8 * t >= K) continue;
      float z_lo = 8.0f, z_hi = 8.0f;
      if constexpr (ASYM) {
        const Rec r = b.rec[k / B::kGS];
        z_lo = bf16_lo(r.y); z_hi = bf16_hi(r.y);
      }
      const uint32_t w0 = h ? b.q[p].z : b.q[p].x, w1 = h ? b.q[p].w : b.q[p].y;
      if (lo_ok) *reinterpret_cast<uint2*>(out_lo + k) = codes8(w0, w1, 0, kMagicF + z_lo);
      if (hi_ok) *reinterpret_cast<uint2*>(out_hi + k) = codes8(w0, w1, 4, kMagicF + z_hi);
    }
  }
  if (t != 0) return;
#pragma unroll
  for (int j = 0; j < kLowbitChunkK / 128; ++j) {  // the chunk's 128-K blocks
    const int64_t kb = k_chunk / 128 + j;
    if (kb * 128 >= K) break;
    const Rec r = b.rec[(j * 128) / B::kGS];
    uint32_t sw;
    if constexpr (ASYM) sw = r.x; else sw = r;
    if (lo_ok) scale_t[kb * N + row] = bf16_lo(sw);
    if (hi_ok) scale_t[kb * N + row + 8] = bf16_hi(sw);
  }
#endif
}

template <int GS, bool ASYM>
cudaError_t launch_fp8_typed(const W4a16DequantFp8Args& a, cudaStream_t stream) {
  const int chunks = static_cast<int>(ceil_div(a.K, kLowbitChunkK));
  const int64_t blocks = ceil_div(a.N, kLowbitGroupRows) * chunks;
  w4a16_dequant_fp8_kernel<GS, ASYM><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const uint32_t*>(a.packed), chunks, static_cast<int>(a.N), static_cast<int>(a.K),
      static_cast<uint8_t*>(a.codes), a.scale_t);
  return cudaGetLastError();
}

}  // namespace

// packed: the int4 blob [ceil(N/64), ceil(K/512), 4, 1024 + w4a16_gemm_sbytes/4] (16-byte aligned); out:
// contiguous [N, K] of out_dtype (bf16 or fp16). K % 8 == 0 (and K % group_size == 0, as the repack requires).
cudaError_t launch_w4a16_dequant(const W4a16DequantArgs& a, cudaStream_t stream) {
  const int64_t N = a.N, K = a.K;
  if (N == 0 || K == 0) return cudaSuccess;
  if (N < 0 || K < 0 || K % 8 != 0 || N > INT32_MAX || K > INT32_MAX - kLowbitChunkK || !is_aligned(a.packed, 16) ||
      ceil_div(N, kLowbitGroupRows) * ceil_div(K, kLowbitChunkK) > INT32_MAX)
    return cudaErrorInvalidValue;
  switch (a.out_dtype) {
    case InDtype::kBF16: return launch_dtype<__nv_bfloat16>(a, stream);
    case InDtype::kF16: return launch_dtype<__half>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

// codes: contiguous [N, K] E4M3; scale_t: contiguous [K/128, N] fp32. Group size 128 or -1, K % 128 == 0.
cudaError_t launch_w4a16_dequant_fp8(const W4a16DequantFp8Args& a, cudaStream_t stream) {
  const int64_t N = a.N, K = a.K;
  if (N == 0 || K == 0) return cudaSuccess;
  if (N < 0 || K < 0 || K % 128 != 0 || N > INT32_MAX || K > INT32_MAX - kLowbitChunkK || !is_aligned(a.packed, 16) ||
      !is_aligned(a.codes, 8) || ceil_div(N, kLowbitGroupRows) * ceil_div(K, kLowbitChunkK) > INT32_MAX)
    return cudaErrorInvalidValue;
  switch (a.group_size) {
    case 128: return a.asym ? launch_fp8_typed<128, true>(a, stream) : launch_fp8_typed<128, false>(a, stream);
    case -1: return a.asym ? launch_fp8_typed<0, true>(a, stream) : launch_fp8_typed<0, false>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cublade
