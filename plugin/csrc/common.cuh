// Shared device helpers for cublade's kernels (framework-free: no torch).
// Conventions (docs/kernels.md, "File convention"): strides in elements; launchers return cudaError_t, never allocate.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "launchers.h"

namespace cublade {

inline int in_dtype_size(InDtype t) { return t == InDtype::kF32 ? 4 : 2; }

constexpr float kF8E4M3Max = 448.0f;
// Floor of dynamic per-token / per-tensor scales: 1/(448*512), the same float as vLLM's
// min_scaling_factor and cublade.constants.FP8_MIN_SCALE (rounded once to fp32).
constexpr float kFp8MinScale = 1.0f / (448.0f * 512.0f);

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// True when p is aligned to `bytes`.
inline bool is_aligned(const void* p, int bytes) {
  return (reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes)) == 0;
}

// ---- loads and stores ------------------------------------------------------------------------------
// Streaming 16-byte load through the read-only (non-coherent) path. No L1::no_allocate hint: on the H200 it
// cost 6-10 % in every streaming kernel here (benchmarks/tuning/quant_sweep.cu, bf16 16384x8192,
// same run: per-token 110.2 -> 100.5 us, MXFP8 quant 111.9 -> 100.9 us, per-tensor cast 108.7 -> 100.1 us,
// the copy of the same bytes 99.2 us), and the L2::128B/256B prefetch hints gained nothing on top.
__device__ __forceinline__ uint4 ld_nc_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// 16-byte load marked evict-first in L1 and L2 (read once; do not displace data still wanted in L2).
__device__ __forceinline__ uint4 ld_cs_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Evict-first (streaming) stores: outputs are not re-read by this kernel.
__device__ __forceinline__ void st_cs_v4(void* p, uint4 v) {
  asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};"
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ void st_cs_v2(void* p, uint2 v) {
  asm volatile("st.global.cs.v2.u32 [%0], {%1, %2};" :: "l"(p), "r"(v.x), "r"(v.y) : "memory");
}
__device__ __forceinline__ void st_cs_u32(void* p, uint32_t v) {
  asm volatile("st.global.cs.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// ---- element conversions -----------------------------------------------------------------------------
// The bf16 in the low / high half of a 32-bit word, as an fp32 (exact: a bf16 is an fp32's top 16 bits).
__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xFFFF0000u); }

template <InDtype T> struct Elem;
template <> struct Elem<InDtype::kBF16> {
  using type = __nv_bfloat16;
  static constexpr int kPerVec = 8;  // elements per 16-byte vector
  __device__ __forceinline__ static float to_float(type v) { return __bfloat162float(v); }
  __device__ __forceinline__ static type from_float(float v) { return __float2bfloat16_rn(v); }
};
template <> struct Elem<InDtype::kF16> {
  using type = __half;
  static constexpr int kPerVec = 8;
  __device__ __forceinline__ static float to_float(type v) { return __half2float(v); }
  __device__ __forceinline__ static type from_float(float v) { return __float2half_rn(v); }
};
template <> struct Elem<InDtype::kF32> {
  using type = float;
  static constexpr int kPerVec = 4;
  __device__ __forceinline__ static float to_float(type v) { return v; }
  __device__ __forceinline__ static type from_float(float v) { return v; }
};

// Packs 8 fp32 values into one 16-byte vector of T (bf16 / fp16), each rounded to nearest even.
template <InDtype T>
__device__ __forceinline__ uint4 pack8_rn(const float (&f)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if constexpr (T == InDtype::kBF16) {
      const __nv_bfloat162 p = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
      w[j] = *reinterpret_cast<const uint32_t*>(&p);
    } else {
      const __half2 p = __floats2half2_rn(f[2 * j], f[2 * j + 1]);
      w[j] = *reinterpret_cast<const uint32_t*>(&p);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Widen the elements of one 16-byte vector to fp32 (exact for all three types).
template <InDtype T>
__device__ __forceinline__ void vec_to_float(const uint4& v, float (&f)[Elem<T>::kPerVec]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  if constexpr (T == InDtype::kF32) {
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = __uint_as_float(w[i]);
  } else if constexpr (T == InDtype::kBF16) {
    // bf16 is the top half of an fp32: a shift / mask, exact.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __half2 h = *reinterpret_cast<const __half2*>(&w[i]);
      const float2 p = __half22float2(h);
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
}

// Two fp32 -> two E4M3 bytes (lo = a, hi = b): round to nearest even, finite saturation (|x| > 448 and
// +-inf give +-448), NaN -> NaN. One instruction on sm_89+.
__device__ __forceinline__ uint16_t f32x2_to_e4m3x2(float a, float b) {
  uint16_t r;
  asm("{ .reg .b16 t;\n"
      "  cvt.rn.satfinite.e4m3x2.f32 t, %2, %1;\n"  // first source goes to the upper byte
      "  mov.b16 %0, t; }"
      : "=h"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ uint32_t f32x4_to_e4m3x4(float a, float b, float c, float d) {
  return static_cast<uint32_t>(f32x2_to_e4m3x2(a, b)) |
         (static_cast<uint32_t>(f32x2_to_e4m3x2(c, d)) << 16);
}
__device__ __forceinline__ uint8_t f32_to_e4m3(float a) {
  return static_cast<uint8_t>(f32x2_to_e4m3x2(a, 0.0f) & 0xFF);
}

// Two E4M3 bytes (lo, hi) -> fp32, exact (E4M3 -> f16 is exact, f16 -> f32 too); NaN stays NaN.
__device__ __forceinline__ float2 e4m3x2_to_f32x2(uint16_t v) {
  uint32_t h2;
  asm("{ .reg .b16 t; mov.b16 t, %1; cvt.rn.f16x2.e4m3x2 %0, t; }" : "=r"(h2) : "h"(v));
  return __half22float2(*reinterpret_cast<const __half2*>(&h2));
}

// ---- NaN-propagating max (torch.amax semantics; fmaxf would drop NaN) ----------------------------------
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
// |x| max over packed pairs, NaN-propagating; the abs clears the sign bits (NaN stays NaN).
__device__ __forceinline__ uint32_t absmax_bf16x2(uint32_t acc, uint32_t v) {
  uint32_t r;
  const uint32_t a = v & 0x7FFF7FFFu;
  asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(acc), "r"(a));
  return r;
}
__device__ __forceinline__ uint32_t absmax_f16x2(uint32_t acc, uint32_t v) {
  uint32_t r;
  const uint32_t a = v & 0x7FFF7FFFu;
  asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(r) : "r"(acc), "r"(a));
  return r;
}

// Running |x| max of one 16-byte vector, kept packed for 16-bit types (two elements per instruction).
// `acc` holds two packed 16-bit maxima (or one fp32 in .x for kF32); absmax_finish() widens it.
template <InDtype T>
__device__ __forceinline__ uint32_t absmax_vec(uint32_t acc, const uint4& v) {
  if constexpr (T == InDtype::kBF16) {
    acc = absmax_bf16x2(acc, v.x); acc = absmax_bf16x2(acc, v.y);
    acc = absmax_bf16x2(acc, v.z); acc = absmax_bf16x2(acc, v.w);
  } else if constexpr (T == InDtype::kF16) {
    acc = absmax_f16x2(acc, v.x); acc = absmax_f16x2(acc, v.y);
    acc = absmax_f16x2(acc, v.z); acc = absmax_f16x2(acc, v.w);
  } else {
    float m = __uint_as_float(acc);
    m = max_nan(m, fabsf(__uint_as_float(v.x))); m = max_nan(m, fabsf(__uint_as_float(v.y)));
    m = max_nan(m, fabsf(__uint_as_float(v.z))); m = max_nan(m, fabsf(__uint_as_float(v.w)));
    acc = __float_as_uint(m);
  }
  return acc;
}
// Packed accumulator -> fp32 max (exact widening). Start accumulators at 0 (+0 in every format).
template <InDtype T>
__device__ __forceinline__ float absmax_finish(uint32_t acc) {
  if constexpr (T == InDtype::kBF16) {
    return max_nan(__uint_as_float(acc << 16), __uint_as_float(acc & 0xFFFF0000u));
  } else if constexpr (T == InDtype::kF16) {
    const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&acc));
    return max_nan(p.x, p.y);
  } else {
    return __uint_as_float(acc);
  }
}

__device__ __forceinline__ float warp_max_nan(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max_nan(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

// Sum / NaN-propagating max of one value per thread over a CTA of kThreads threads: every thread gets the same
// value (warp shuffles, then the warps' partials added in one fixed order). red: kThreads / 32 floats of shared
// memory, free again when these return.
template <int kThreads>
__device__ __forceinline__ float block_sum(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = red[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) s += red[w];
  __syncthreads();
  return s;
}
template <int kThreads>
__device__ __forceinline__ float block_max(float v, float* red) {
  v = warp_max_nan(v);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float m = red[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) m = max_nan(m, red[w]);
  __syncthreads();
  return m;
}

// Dynamic FP8 scale from an fp32 abs-max: amax / 448 (IEEE division), floored at 1/(448*512), NaN kept.
__device__ __forceinline__ float fp8_dynamic_scale(float amax) {
  return max_nan(__fdiv_rn(amax, kF8E4M3Max), kFp8MinScale);
}

// ---- division ----------------------------------------------------------------------------------------
// a / b rounded to nearest even, bit-identical to __fdiv_rn(a, b), in 1 FMUL + 4 FFMA instead of the ~20
// instructions (and a convergence barrier) of the compiler's IEEE division; y = __frcp_rn(b) once per scale.
// Markstein's argument: q0 = a*y is within 2 ulp of a/b; one correction makes it faithful; for a faithful q
// the residual a - b*q is exact in an FMA, and q + r*y with y = RN(1/b) is then the correctly rounded a/b.
// Valid when nothing overflows or underflows on the way: callers guarantee b finite with
// 2^-60 <= |b| <= 2^125 (div_fast_ok) and a*y finite. Where |a| is so small that the residual underflows,
// |a/b| < 2^-34 and the result still rounds to +-0 in E4M3, the only use of it here.
__device__ __forceinline__ bool div_fast_ok(float b) {
  const float ab = fabsf(b);
  return ab >= 0x1p-60f && ab <= 0x1p125f;  // false for NaN and inf
}
__device__ __forceinline__ float div_rn_fast(float a, float b, float y) {
  const float q0 = __fmul_rn(a, y);
  float r = __fmaf_rn(-q0, b, a);
  float q = __fmaf_rn(r, y, q0);
  r = __fmaf_rn(-q, b, a);
  q = __fmaf_rn(r, y, q);
  // The corrections turn a zero quotient into +0 (-0 + +0 = +0): the sign of a/b is the sign of a*y.
  return copysignf(q, q0);
}

// One 16-byte vector of T quantized to 8 E4M3 bytes with a row's (or the tensor's) scale s, rcp = __frcp_rn(s):
// kStatic multiplies by rcp (fp8_quant_per_tensor's rule), else divides by s (fp8_quant_per_token's: the fast
// division where div_fast_ok(s), the IEEE one otherwise). The fused norm / activation kernels' last step.
template <InDtype T, bool kStatic>
__device__ __forceinline__ uint2 quantize_vec_e4m3(const uint4& v, float s, float rcp, bool fast) {
  float f[8];
  vec_to_float<T>(v, f);
#pragma unroll
  for (int j = 0; j < 8; ++j)
    f[j] = kStatic ? __fmul_rn(f[j], rcp) : fast ? div_rn_fast(f[j], s, rcp) : __fdiv_rn(f[j], s);
  return make_uint2(f32x4_to_e4m3x4(f[0], f[1], f[2], f[3]), f32x4_to_e4m3x4(f[4], f[5], f[6], f[7]));
}

}  // namespace cublade
