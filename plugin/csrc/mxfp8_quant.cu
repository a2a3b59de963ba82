// MXFP8 quant / dequant: E4M3 elements, one E8M0 scale per 32 consecutive elements of the last dim.
//   quant:   e = the block's exponent (plugin/ops/mx.py: "rceil" ceil(log2(amax/448)), "floor"
//            floor(log2 amax) - 8; clamped to [-127, 127]; all-zero block -127; NaN block code 255),
//            q = e4m3(x * 2^-e) (exact power-of-two scaling, then RNE + saturation at +-448).
//   dequant: out = dtype(float(q) * 2^(code - 127)), one rounding (to the output dtype).
// Layout and the reasons: docs/kernels.md, "mxfp8_quant / mxfp8_dequant".
#define CUBLADE_KERNELS_ONLY  // framework-free (no torch header); the torch wrapper is mxfp8_quant_torch.cpp
#include "common.cuh"

namespace cublade {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // 16-byte vectors per thread, loads all issued before the first use
constexpr int kMxBlock = 32;
constexpr int kE8M0Bias = 127;
constexpr uint8_t kE8M0Nan = 255;

// floor(log2 a) and ceil(log2 a) of a positive finite fp32 from its bits (subnormals included).
__device__ __forceinline__ int floor_log2_pos(float a) {
  const uint32_t b = __float_as_uint(a);
  const int ex = static_cast<int>(b >> 23);
  const uint32_t man = b & 0x7FFFFFu;
  return ex != 0 ? ex - 127 : -149 + (31 - __clz(static_cast<int>(man)));
}
__device__ __forceinline__ int ceil_log2_pos(float a) {
  const uint32_t b = __float_as_uint(a);
  const int ex = static_cast<int>(b >> 23);
  const uint32_t man = b & 0x7FFFFFu;
  if (ex != 0) return ex - 127 + (man != 0);
  return -149 + (32 - __clz(static_cast<int>(man - 1)));  // man >= 1: a power of two keeps its exponent
}

// E8M0 code of a block from its abs-max (NaN-propagated), and the exact fp32 multiplier 2^-e.
template <bool kRceil>
__device__ __forceinline__ uint8_t e8m0_code(float amax, float& inv_scale) {
  if (isnan(amax)) {
    inv_scale = __uint_as_float(0x7FC00000u);  // x * NaN: the whole block becomes NaN, as in the reference
    return kE8M0Nan;
  }
  int e;
  if (amax == 0.0f) {
    e = -127;
  } else if (isinf(amax)) {
    e = 127;
  } else if (kRceil) {
    if (amax >= 0x1.cp-118f) {
      // e = ceil(log2(RN(amax / 448))) without the division: for amax = 1.m * 2^E, RN(amax / 448) <= 2^k iff
      // amax <= 448 * 2^k (no fp32 lies strictly between 448 * 2^k and 448 * 2^k * (1 + 2^-24), the largest
      // value that still rounds down to 2^k), so k = E - 8 when 1.m <= 1.75, else E - 7. Needs RN(amax/448)
      // normal, i.e. amax >= 448 * 2^-126 = 1.75 * 2^-118.
      const uint32_t b = __float_as_uint(amax);
      e = static_cast<int>(b >> 23) - 127 - 8 + ((b & 0x7FFFFFu) > 0x600000u);
    } else {
      // amax / 448 rounded once (IEEE division); an underflow to 0 means an exponent far below -127.
      const float v = __fdiv_rn(amax, kF8E4M3Max);
      e = v == 0.0f ? -127 : ceil_log2_pos(v);
    }
  } else {
    e = floor_log2_pos(amax) - 8;  // 8 = exponent of the largest power of two <= 448
  }
  e = min(max(e, -127), 127);
  // 2^-e: a normal float for e <= 126; 2^-127 is the subnormal with only mantissa bit 22 set.
  inv_scale = e <= 126 ? __uint_as_float(static_cast<uint32_t>(127 - e) << 23) : __uint_as_float(0x00400000u);
  return static_cast<uint8_t>(e + kE8M0Bias);
}

// One MX block = G lanes x one 16-byte vector each (G = 4 for 16-bit inputs, 8 for fp32). The grid covers
// nvec vectors; vector i of a contiguous x is at x + i*N; for row-strided x, row i / nvec_row. q and codes
// are contiguous.
template <InDtype T, bool kRceil>
__global__ void __launch_bounds__(kThreads)
mx_quant_kernel(const typename Elem<T>::type* __restrict__ x, int64_t nvec, int64_t nvec_row, int64_t row_stride,
                bool contiguous, uint8_t* __restrict__ q, uint8_t* __restrict__ codes) {
  constexpr int N = Elem<T>::kPerVec;
  constexpr int G = kMxBlock / N;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * (kThreads * kUnroll) + threadIdx.x;
  uint4 v[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t i = base + u * kThreads;
    v[u] = make_uint4(0, 0, 0, 0);
    if (i < nvec) {
      const int64_t off = contiguous ? i * N : (i / nvec_row) * row_stride + (i % nvec_row) * N;
      v[u] = ld_nc_v4(x + off);
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t i = base + u * kThreads;
    // All lanes shuffle (a whole MX block is either in range or not: nvec and the groups are multiples of G).
    float amax = absmax_finish<T>(absmax_vec<T>(0u, v[u]));
#pragma unroll
    for (int o = 1; o < G; o <<= 1) amax = max_nan(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    if (i < nvec) {
      float inv;
      const uint8_t code = e8m0_code<kRceil>(amax, inv);
      if ((threadIdx.x & (G - 1)) == 0) codes[i / G] = code;
      float f[N];
      vec_to_float<T>(v[u], f);
#pragma unroll
      for (int k = 0; k < N; ++k) f[k] = __fmul_rn(f[k], inv);
      if constexpr (N == 8) {
        st_cs_v2(q + i * N, make_uint2(f32x4_to_e4m3x4(f[0], f[1], f[2], f[3]), f32x4_to_e4m3x4(f[4], f[5], f[6], f[7])));
      } else {
        st_cs_u32(q + i * N, f32x4_to_e4m3x4(f[0], f[1], f[2], f[3]));
      }
    }
  }
}

// Fallback for column-strided or unaligned views: one thread per MX block, scalar loads and stores.
template <InDtype T, bool kRceil>
__global__ void __launch_bounds__(kThreads)
mx_quant_scalar_kernel(const typename Elem<T>::type* __restrict__ x, int64_t M, int64_t K, int64_t rs, int64_t cs,
                       uint8_t* __restrict__ q, uint8_t* __restrict__ codes) {
  const int64_t nblk_row = K / kMxBlock;
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= M * nblk_row) return;
  const int64_t row = b / nblk_row, k0 = (b % nblk_row) * kMxBlock;
  const typename Elem<T>::type* xr = x + row * rs;
  float amax = 0.0f;
  for (int k = 0; k < kMxBlock; ++k) amax = max_nan(amax, fabsf(Elem<T>::to_float(xr[(k0 + k) * cs])));
  float inv;
  codes[b] = e8m0_code<kRceil>(amax, inv);
  for (int k = 0; k < kMxBlock; ++k) q[row * K + k0 + k] = f32_to_e4m3(__fmul_rn(Elem<T>::to_float(xr[(k0 + k) * cs]), inv));
}

template <InDtype T, bool kRceil>
cudaError_t quant_typed(const Mxfp8QuantArgs& a, cudaStream_t stream) {
  using E = typename Elem<T>::type;
  constexpr int N = Elem<T>::kPerVec;
  const E* x = static_cast<const E*>(a.x);
  const int64_t M = a.M, K = a.K, rs = a.row_stride, cs = a.col_stride;
  uint8_t* q = a.q;
  uint8_t* codes = a.codes;
  const bool fast = cs == 1 && rs % N == 0 && is_aligned(x, 16);
  if (fast) {
    const int64_t nvec_row = K / N, nvec = M * nvec_row;
    const int64_t grid = ceil_div(nvec, kThreads * kUnroll);
    mx_quant_kernel<T, kRceil><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
        x, nvec, nvec_row, rs, rs == K || M == 1, q, codes);
  } else {
    const int64_t grid = ceil_div(M * (K / kMxBlock), kThreads);
    mx_quant_scalar_kernel<T, kRceil><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(x, M, K, rs, cs, q, codes);
  }
  return cudaGetLastError();
}

// ---- dequant -----------------------------------------------------------------------------------------
enum class OutDtype : int { kBF16 = 0, kF16 = 1, kF32 = 2 };

__device__ __forceinline__ float e8m0_to_float(uint8_t c) {
  if (c == kE8M0Nan) return __uint_as_float(0x7FC00000u);
  return c != 0 ? __uint_as_float(static_cast<uint32_t>(c) << 23) : __uint_as_float(0x00400000u);
}

// 16 fp8 values (one 16-byte load, half an MX block) per thread -> 16 outputs (2 or 4 16-byte stores).
template <OutDtype O>
__global__ void __launch_bounds__(kThreads)
mx_dequant_kernel(const uint8_t* __restrict__ q, const uint8_t* __restrict__ codes, int64_t n16,
                  void* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n16) return;
  const uint4 v = ld_nc_v4(q + i * 16);
  const float s = e8m0_to_float(__ldg(codes + i / 2));
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  float f[16];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 lo = e4m3x2_to_f32x2(static_cast<uint16_t>(w[k] & 0xFFFF));
    const float2 hi = e4m3x2_to_f32x2(static_cast<uint16_t>(w[k] >> 16));
    f[4 * k] = __fmul_rn(lo.x, s); f[4 * k + 1] = __fmul_rn(lo.y, s);
    f[4 * k + 2] = __fmul_rn(hi.x, s); f[4 * k + 3] = __fmul_rn(hi.y, s);
  }
  if constexpr (O == OutDtype::kF32) {
    uint4* o = reinterpret_cast<uint4*>(static_cast<float*>(out) + i * 16);
#pragma unroll
    for (int k = 0; k < 4; ++k)
      st_cs_v4(o + k, make_uint4(__float_as_uint(f[4 * k]), __float_as_uint(f[4 * k + 1]),
                                 __float_as_uint(f[4 * k + 2]), __float_as_uint(f[4 * k + 3])));
  } else {
    uint32_t p[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      if constexpr (O == OutDtype::kBF16) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * k], f[2 * k + 1]);
        p[k] = *reinterpret_cast<const uint32_t*>(&h);
      } else {
        const __half2 h = __floats2half2_rn(f[2 * k], f[2 * k + 1]);
        p[k] = *reinterpret_cast<const uint32_t*>(&h);
      }
    }
    uint4* o = reinterpret_cast<uint4*>(static_cast<uint16_t*>(out) + i * 16);
    st_cs_v4(o, make_uint4(p[0], p[1], p[2], p[3]));
    st_cs_v4(o + 1, make_uint4(p[4], p[5], p[6], p[7]));
  }
}

template <OutDtype O>
__device__ __forceinline__ void store_out(void* out, int64_t idx, float v) {
  if constexpr (O == OutDtype::kF32) static_cast<float*>(out)[idx] = v;
  else if constexpr (O == OutDtype::kBF16) static_cast<__nv_bfloat16*>(out)[idx] = __float2bfloat16_rn(v);
  else static_cast<__half*>(out)[idx] = __float2half_rn(v);
}

// Fallback for strided q / codes: one thread per element.
template <OutDtype O>
__global__ void __launch_bounds__(kThreads)
mx_dequant_scalar_kernel(const uint8_t* __restrict__ q, int64_t q_rs, int64_t q_cs, const uint8_t* __restrict__ codes,
                         int64_t c_rs, int64_t c_cs, int64_t M, int64_t K, void* __restrict__ out) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= M * K) return;
  const int64_t row = e / K, k = e % K;
  const uint8_t b = q[row * q_rs + k * q_cs];
  const float f = e4m3x2_to_f32x2(static_cast<uint16_t>(b)).x;
  store_out<O>(out, e, __fmul_rn(f, e8m0_to_float(codes[row * c_rs + (k / kMxBlock) * c_cs])));
}

template <OutDtype O>
cudaError_t dequant_typed(const Mxfp8DequantArgs& a, cudaStream_t stream) {
  const uint8_t* q = a.q;
  const uint8_t* codes = a.codes;
  const int64_t q_rs = a.q_row_stride, q_cs = a.q_col_stride, c_rs = a.codes_row_stride, c_cs = a.codes_col_stride;
  const int64_t M = a.M, K = a.K;
  void* out = a.out;
  const bool fast = q_cs == 1 && c_cs == 1 && (M == 1 || (q_rs == K && c_rs == K / kMxBlock)) && is_aligned(q, 16);
  if (fast) {
    const int64_t n16 = M * K / 16;
    mx_dequant_kernel<O><<<static_cast<unsigned>(ceil_div(n16, kThreads)), kThreads, 0, stream>>>(q, codes, n16, out);
  } else {
    mx_dequant_scalar_kernel<O><<<static_cast<unsigned>(ceil_div(M * K, kThreads)), kThreads, 0, stream>>>(
        q, q_rs, q_cs, codes, c_rs, c_cs, M, K, out);
  }
  return cudaGetLastError();
}

}  // namespace

// x: [M, K] (K % 32 == 0) with strides (row_stride, col_stride) in elements; q: contiguous [M, K]; codes:
// contiguous [M, K/32].
cudaError_t launch_mxfp8_quant(const Mxfp8QuantArgs& a, cudaStream_t stream) {
  if (a.M == 0 || a.K == 0) return cudaSuccess;
  if (a.K % kMxBlock != 0) return cudaErrorInvalidValue;
  switch (a.dtype) {
    case InDtype::kBF16:
      return a.rceil ? quant_typed<InDtype::kBF16, true>(a, stream) : quant_typed<InDtype::kBF16, false>(a, stream);
    case InDtype::kF16:
      return a.rceil ? quant_typed<InDtype::kF16, true>(a, stream) : quant_typed<InDtype::kF16, false>(a, stream);
    case InDtype::kF32:
      return a.rceil ? quant_typed<InDtype::kF32, true>(a, stream) : quant_typed<InDtype::kF32, false>(a, stream);
  }
  return cudaErrorInvalidValue;
}

// q: [M, K] e4m3 bytes with strides (q_row_stride, q_col_stride); codes: [M, K/32] with strides
// (codes_row_stride, codes_col_stride); out: contiguous [M, K] of out_dtype (0 bf16, 1 fp16, 2 fp32).
cudaError_t launch_mxfp8_dequant(const Mxfp8DequantArgs& a, cudaStream_t stream) {
  if (a.M == 0 || a.K == 0) return cudaSuccess;
  if (a.K % kMxBlock != 0) return cudaErrorInvalidValue;
  switch (static_cast<OutDtype>(a.out_dtype)) {
    case OutDtype::kBF16: return dequant_typed<OutDtype::kBF16>(a, stream);
    case OutDtype::kF16: return dequant_typed<OutDtype::kF16>(a, stream);
    case OutDtype::kF32: return dequant_typed<OutDtype::kF32>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cublade
