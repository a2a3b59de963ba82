// int4 blob decoding shared by the Hopper kernels (w4a16_gemm.cu) and the sm_80-89 streaming kernel
// (sm80/lowbit_gemm_sm80.cu): nibbles and group scale records -> bf16 / fp16 mma.m16n8k16 A fragments, each group's
// sum scaled in fp32. Plain integer and 16-bit float arithmetic: sm_80 and later. The blob: w4a16_gemm.cu's header.
#pragma once

#include "w4a16_gemm.cuh"

namespace cublade {
namespace int4 {
namespace {  // one copy per translation unit (internal linkage, as the kernels instantiated with these)

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
// either way; the consumers' latency is not what limits M = 1.)
template <typename T_, int NT_, int GS, bool ASYM>
struct Int4Policy {
  using T = T_;
  static constexpr int NT = NT_;
  static constexpr int kPacketBytes = 512;
  using Rec = typename std::conditional<ASYM, uint2, uint32_t>::type;
  static constexpr int kRecGS = GS == 0 ? lowbit::kChunk * lowbit::kPacketK : GS;  // K per scale record
  static constexpr int kRecBytes = static_cast<int>(sizeof(Rec));
  static constexpr int kSBytes = lowbit::kChunk * lowbit::kPacketK / kRecGS * 8 * kRecBytes;  // per tile block

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
  __device__ static void packet(State& st, const uint4 (&qv)[1], const unsigned char* srec, const uint4 (&xc)[2][NT],
                                float (&acc)[NT][4], int lane) {
    const uint4 q = qv[0];
    constexpr int kGS = GS == 0 ? kSliceK : GS;  // group within the slice
    constexpr bool kStart0 = (j * lowbit::kPacketK) % kGS == 0;
    constexpr bool kStart1 = kGS == 32;
    constexpr bool kFlush0 = kGS == 32;
    constexpr bool kFlush1 = ((j + 1) * lowbit::kPacketK) % kGS == 0;
    constexpr int kGroup0 = GS == 0 ? 0 : j * lowbit::kPacketK / kGS;  // record (within the slice) of half 0
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

}  // namespace
}  // namespace int4
}  // namespace cublade
