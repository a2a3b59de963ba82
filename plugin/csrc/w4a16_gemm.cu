// W4A16 GEMM for decode: y[M, N] = x[M, K] (bf16/fp16) @ dequant(W)[N, K]^T, W int4 with one bf16 scale
// (and, asymmetric, one zero point) per group of 32/64/128 K or per output channel. Numerics: the
// reference's w = (u - z) * s in fp32, summed in fp32 (cublade.ops.w4a16_gemm.w4a16_gemm_ref).
//
// Layout and the reasons: README.md, "w4a16_gemm"; the repacked tensors: w4a16_gemm.cuh and
// plugin/ops/w4a16_gemm.py (w4a16_repack).
//   packed  int32 [ceil(N/64), ceil(K/512), 4 tiles, 1024 + sbytes/4]: per tile block, 8 packets x 32 lanes x 4
//           words, then the chunk's scale records. Nibble u of lane (g, t), k-step s, in word s at bits 4j:
//           j=0 (row g, K0), 4 (g, K0+1), 1 (g+8, K0), 5 (g+8, K0+1), 2 (g, K0+2), 6 (g, K0+3), 3 (g+8, K0+2),
//           7 (g+8, K0+3), so that one mask+OR per pair gives the fragment register order.
//           Scale records: [512/G groups][8 g] x (s[row g], s[row g+8]) bf16, asymmetric (s[g], s[g+8], z[g],
//           z[g+8]) (z exact in bf16); per channel: one group, repeated in every chunk.
#define CUBLADE_KERNELS_ONLY  // the torch wrapper is w4a16_gemm_torch.cpp
#include "w4a16_gemm.cuh"
#include "w4a16_gemm.h"

static_assert(cublade::kLowbitGroupRows == cublade::lowbit::kGroupTiles * cublade::lowbit::kTileN &&
                  cublade::kLowbitChunkK == cublade::lowbit::kChunk * cublade::lowbit::kPacketK &&
                  cublade::kLowbitTileWords == cublade::lowbit::kChunk * 128 &&
                  cublade::kLowbitMaxSplit == cublade::lowbit::kMaxSplit,
              "w4a16_gemm.h and w4a16_gemm.cuh disagree on the blob geometry");

#include <algorithm>

namespace cublade {
namespace {

using lowbit::kPacketK;
using lowbit::kTileN;

// int4 -> 16-bit float without a conversion instruction: OR the nibble u into the low mantissa bits of
// 128.0 (bf16 0x4300: ulp 1 for 128..255) or 1024.0 (fp16 0x6400: ulp 1 for 1024..2047); the result is
// exactly 128 + u (1024 + u); subtracting 128 + z (1024 + z) leaves u - z, exact. Two nibbles 16 bits
// apart become one packed pair with a single mask-and-OR (one LOP3).
template <typename T> struct Int4Magic;
template <> struct Int4Magic<__nv_bfloat16> {
  static constexpr uint32_t kBase = 0x43004300u;  // (128, 128)
  static constexpr float kBaseF = 128.0f;
};
template <> struct Int4Magic<__half> {
  static constexpr uint32_t kBase = 0x64006400u;  // (1024, 1024)
  static constexpr float kBaseF = 1024.0f;
};

template <typename T>
__device__ __forceinline__ uint32_t sub2(uint32_t a, uint32_t b) {
  uint32_t d;
  if constexpr (lowbit::is_bf16<T>()) {
    const __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                     *reinterpret_cast<const __nv_bfloat162*>(&b));
    d = *reinterpret_cast<const uint32_t*>(&r);
  } else {
    const __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
    d = *reinterpret_cast<const uint32_t*>(&r);
  }
  return d;
}

// (128 + z) as a packed pair (both halves equal) in T, from z as a float (exact: z <= 15).
template <typename T>
__device__ __forceinline__ uint32_t bias_pair(float z) {
  const float b = Int4Magic<T>::kBaseF + z;
  uint32_t d;
  if constexpr (lowbit::is_bf16<T>()) {
    const __nv_bfloat162 r = __float2bfloat162_rn(b);
    d = *reinterpret_cast<const uint32_t*>(&r);
  } else {
    const __half2 r = __float2half2_rn(b);
    d = *reinterpret_cast<const uint32_t*>(&r);
  }
  return d;
}

// One k-step's A fragment from one word: a[0] (row g, K0..K0+1), a[1] (row g+8, K0..), a[2] (row g,
// K0+2..), a[3] (row g+8, K0+2..).
template <typename T>
__device__ __forceinline__ void dequant_int4(uint32_t q, uint32_t bias_lo, uint32_t bias_hi, uint32_t (&a)[4]) {
  constexpr uint32_t kMask = 0x000F000Fu, kBase = Int4Magic<T>::kBase;
  a[0] = sub2<T>(lowbit::and_or(q, kMask, kBase), bias_lo);
  a[1] = sub2<T>(lowbit::and_or(q >> 4, kMask, kBase), bias_hi);
  a[2] = sub2<T>(lowbit::and_or(q >> 8, kMask, kBase), bias_lo);
  a[3] = sub2<T>(lowbit::and_or(q >> 12, kMask, kBase), bias_hi);
}

// Scale record of one group for rows (g, g+8): fp32 scales and packed (base + z) subtrahends.
template <typename T, bool ASYM, typename Rec>
__device__ __forceinline__ void unpack_rec(const Rec& r, float& s_lo, float& s_hi, uint32_t& b_lo, uint32_t& b_hi) {
  if constexpr (ASYM) {
    s_lo = bf16_lo(r.x); s_hi = bf16_hi(r.x);
    b_lo = bias_pair<T>(bf16_lo(r.y)); b_hi = bias_pair<T>(bf16_hi(r.y));
  } else {
    s_lo = bf16_lo(r); s_hi = bf16_hi(r);
  }
}

// int4 packets for the streaming kernel (w4a16_gemm.cuh). GS: group size 32 / 64 / 128, or 0 for one group per
// output channel (handled as one group per K slice: the repack repeats the record in every chunk, and a per-row
// scale may multiply any partial sum). Each group's k-steps accumulate from zero into `part` (fp32); at the
// group's end acc += part * scale, in fp32, so the weights are never rounded. A K slice starts on a group
// boundary for every GS, so which packet starts / ends a group is known at compile time. (Summing alternate
// k-steps into two partial sums, two independent mma chains at NT = 1, did not change M = 1 on the H200: 43.95 us
// either way, benchmarks/runs/2026-11-22-1723-*; the consumers' latency is not what limits M = 1.)
template <typename T_, int NT_, int GS, bool ASYM>
struct Int4Policy {
  using T = T_;
  static constexpr int NT = NT_;
  using Rec = typename std::conditional<ASYM, uint2, uint32_t>::type;
  static constexpr int kRecGS = GS == 0 ? lowbit::kChunk * kPacketK : GS;  // K per scale record
  static constexpr int kRecBytes = static_cast<int>(sizeof(Rec));
  static constexpr int kSBytes = lowbit::kChunk * kPacketK / kRecGS * 8 * kRecBytes;  // per tile block

  __device__ static const float* row_scale(const lowbit::GemmParams&, int) { return nullptr; }

  struct State {
    float s_lo = 0.0f, s_hi = 0.0f;  // the running group's fp32 scales, rows g and g+8
    uint32_t b_lo = 0, b_hi = 0;     // and its packed (base + z) subtrahends
    float part[NT][4];               // the running group's sum
  };
  template <int kSliceK>
  __device__ static const unsigned char* slice_records(const unsigned char* srec, int slice) {
    if constexpr (GS == 0) {
      return srec;  // one record per row, the same in every slice
    } else {
      static_assert(kSliceK % GS == 0, "a K slice must hold whole groups");
      return srec + slice * (kSliceK / GS) * 8 * kRecBytes;
    }
  }
  __device__ static void flush(State& st, float (&acc)[NT][4]) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      acc[n][0] = fmaf(st.part[n][0], st.s_lo, acc[n][0]);
      acc[n][1] = fmaf(st.part[n][1], st.s_lo, acc[n][1]);
      acc[n][2] = fmaf(st.part[n][2], st.s_hi, acc[n][2]);
      acc[n][3] = fmaf(st.part[n][3], st.s_hi, acc[n][3]);
    }
  }
  template <int j, int kSliceK>
  __device__ static void packet(State& st, const uint4 q, const unsigned char* srec, const uint4 (&xc)[2][NT],
                                float (&acc)[NT][4], int lane) {
    constexpr int kGS = GS == 0 ? kSliceK : GS;  // group within the slice
    constexpr bool kStart0 = (j * kPacketK) % kGS == 0;
    constexpr bool kStart1 = kGS == 32;
    constexpr bool kFlush0 = kGS == 32;
    constexpr bool kFlush1 = ((j + 1) * kPacketK) % kGS == 0;
    constexpr int kGroup0 = GS == 0 ? 0 : j * kPacketK / kGS;  // record (within the slice) of half 0
    const Rec* recs = reinterpret_cast<const Rec*>(srec) + (lane >> 2);
    uint32_t b1_lo = st.b_lo, b1_hi = st.b_hi;
    [[maybe_unused]] float s1_lo = 0.0f, s1_hi = 0.0f;
    if constexpr (kStart0) {
      st.b_lo = st.b_hi = bias_pair<T>(8.0f);  // symmetric: z = 8
      unpack_rec<T, ASYM>(recs[kGroup0 * 8], st.s_lo, st.s_hi, st.b_lo, st.b_hi);
    }
    if constexpr (kStart1) {
      b1_lo = b1_hi = bias_pair<T>(8.0f);
      unpack_rec<T, ASYM>(recs[(kGroup0 + 1) * 8], s1_lo, s1_hi, b1_lo, b1_hi);
    }
    uint32_t a[4][4];
    dequant_int4<T>(q.x, st.b_lo, st.b_hi, a[0]);
    dequant_int4<T>(q.y, st.b_lo, st.b_hi, a[1]);
    dequant_int4<T>(q.z, kStart1 ? b1_lo : st.b_lo, kStart1 ? b1_hi : st.b_hi, a[2]);
    dequant_int4<T>(q.w, kStart1 ? b1_lo : st.b_lo, kStart1 ? b1_hi : st.b_hi, a[3]);
    auto half = [&](int h, bool first) {  // two k-steps into the group's sum
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        if (first) lowbit::mma_16816_first<T>(st.part[n], a[2 * h], xc[h][n].x, xc[h][n].y);
        else lowbit::mma_16816<T>(st.part[n], a[2 * h], xc[h][n].x, xc[h][n].y);
        lowbit::mma_16816<T>(st.part[n], a[2 * h + 1], xc[h][n].z, xc[h][n].w);
      }
    };
    half(0, kStart0);
    if constexpr (kFlush0) flush(st, acc);
    if constexpr (kStart1) { st.s_lo = s1_lo; st.s_hi = s1_hi; st.b_lo = b1_lo; st.b_hi = b1_hi; }
    half(1, kStart1);
    if constexpr (kFlush1) flush(st, acc);
  }
};

template <int GS, bool ASYM>
constexpr int int4_sbytes() { return Int4Policy<__nv_bfloat16, 1, GS, ASYM>::kSBytes; }

// Tokens per pass from M: 8 / 16 / 32 (lowbit::token_tiles); larger M makes several passes, each re-reading the
// weights (from L2 when they are still there). From 128 rows the torch op dequantizes and calls cuBLAS instead
// (w4a16_gemm_torch.cpp).
template <typename T, int GS, bool ASYM>
cudaError_t launch_nt(lowbit::GemmParams prm, int S, cudaStream_t stream) {
  const int nt = lowbit::token_tiles(prm.M);
  prm.xrows = std::min(8 * nt, prm.M);
  prm.sbytes = int4_sbytes<GS, ASYM>();
  if (nt == 1) return lowbit::launch_tpw<Int4Policy<T, 1, GS, ASYM>>(prm, 1, S, stream);
  if (nt == 2) return lowbit::launch_tpw<Int4Policy<T, 2, GS, ASYM>>(prm, 1, S, stream);
  return lowbit::launch_tpw<Int4Policy<T, 4, GS, ASYM>>(prm, 1, S, stream);
}

template <typename T>
cudaError_t launch_dtype(const lowbit::GemmParams& prm, int group_size, bool asym, int S, cudaStream_t stream) {
  switch (group_size) {
    case 32: return asym ? launch_nt<T, 32, true>(prm, S, stream) : launch_nt<T, 32, false>(prm, S, stream);
    case 64: return asym ? launch_nt<T, 64, true>(prm, S, stream) : launch_nt<T, 64, false>(prm, S, stream);
    case 128: return asym ? launch_nt<T, 128, true>(prm, S, stream) : launch_nt<T, 128, false>(prm, S, stream);
    case -1: return asym ? launch_nt<T, 0, true>(prm, S, stream) : launch_nt<T, 0, false>(prm, S, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

// Scale-record bytes per tile block (the repacked layout's last dim is 1024 + this / 4 int32 words).
int w4a16_gemm_sbytes(int group_size, bool asym) {
  switch (group_size) {
    case 32: return asym ? int4_sbytes<32, true>() : int4_sbytes<32, false>();
    case 64: return asym ? int4_sbytes<64, true>() : int4_sbytes<64, false>();
    case 128: return asym ? int4_sbytes<128, true>() : int4_sbytes<128, false>();
    case -1: return asym ? int4_sbytes<0, true>() : int4_sbytes<0, false>();
    default: return -1;
  }
}

// x: [M, K] (row stride x_stride elements, unit column stride, 16-byte aligned rows, K % 8 == 0); packed: the
// repacked blob above; out: [M, N] with row stride out_stride. split_k: K splits per cluster (0 = pick).
// sms: the multiprocessor count.
cudaError_t launch_w4a16_gemm(const void* x, InDtype dtype, int64_t M, int64_t K, int64_t x_stride,
                              const void* packed, int group_size, bool asym, void* out, int64_t out_stride,
                              int64_t N, int split_k, int sms, cudaStream_t stream) {
  if (M == 0 || N == 0) return cudaSuccess;
  lowbit::GemmParams prm = {};
  prm.x = x; prm.x_stride = x_stride; prm.M = static_cast<int>(M); prm.K = static_cast<int>(K);
  prm.w = static_cast<const unsigned char*>(packed);
  prm.tiles = static_cast<int>(ceil_div(N, kTileN));
  prm.groups = static_cast<int>(ceil_div(N, kTileN * lowbit::kGroupTiles));
  prm.chunks = static_cast<int>(ceil_div(K, lowbit::kChunk * kPacketK));
  prm.out = out; prm.out_stride = out_stride; prm.N = static_cast<int>(N);
  prm.sms = sms;
  const int S = split_k > 0 ? split_k : lowbit::pick_split(prm.groups, prm.chunks, sms);
  switch (dtype) {
    case InDtype::kBF16: return launch_dtype<__nv_bfloat16>(prm, group_size, asym, S, stream);
    case InDtype::kF16: return launch_dtype<__half>(prm, group_size, asym, S, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cublade

