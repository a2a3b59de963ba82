// Dynamic per-token FP8 E4M3 quantization: x [M, K] (bf16/fp16/fp32) -> q e4m3 [M, K], scale fp32 [M].
//   scale = max(amax_row / 448, 1/(448*512)) (NaN kept), q = e4m3(x / scale) (IEEE division, as vLLM's
//   dynamic_per_token_scaled_fp8_quant, so the bytes match vLLM's op), saturating at +-448.
// Values forms (kV): the same E4M3 values written as bf16 or fp16 (exact in both), the activations of fp8_gemm.cu.
// Layout and the reasons: docs/kernels.md, "fp8_quant_per_token".
#define CUBLADE_KERNELS_ONLY  // framework-free (no torch header); the torch wrapper is fp8_quant_per_token_torch.cpp
#include "common.cuh"

namespace cublade {
namespace {

constexpr int kWarpRowsPerBlock = 8;      // warp-per-row mode: 8 rows per 256-thread block
constexpr int kMaxVecsWarpMode = 32 * 8;  // rows up to 256 vectors (K <= 2048 bf16) take a warp
constexpr int kMaxThreads = 1024;
constexpr int kMaxVecsFast = kMaxThreads * 8;  // longer rows go to the two-read fallback

// Four E4M3 bytes -> their four values as bf16 or fp16 (exact): fp16 straight from the conversion instruction,
// bf16 through fp32.
template <Fp8Values kV>
__device__ __forceinline__ uint2 e4m3x4_to_values(uint32_t w) {
  uint32_t lo, hi;
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; cvt.rn.f16x2.e4m3x2 %1, h; }"
      : "=r"(lo), "=r"(hi) : "r"(w));
  if constexpr (kV == Fp8Values::kF16) return make_uint2(lo, hi);
  const float2 l = __half22float2(*reinterpret_cast<const __half2*>(&lo));
  const float2 h = __half22float2(*reinterpret_cast<const __half2*>(&hi));
  const __nv_bfloat162 a = __floats2bfloat162_rn(l.x, l.y), b = __floats2bfloat162_rn(h.x, h.y);
  return make_uint2(*reinterpret_cast<const uint32_t*>(&a), *reinterpret_cast<const uint32_t*>(&b));
}

// Quantize one 16-byte input vector with the row's scale and store its 8 (or 4) fp8 bytes, or in a values form their
// values as bf16 / fp16; dst: the vector's first output element.
// kFast: s passed div_fast_ok (every finite row scale does: s >= 1/(448*512), s <= bf16/fp32 max / 448), and
// then every x of the row is finite with |x / s| <= 448, so div_rn_fast is exact; a row with NaN/Inf has a
// NaN/Inf scale and takes the IEEE division.
template <InDtype T, bool kFast, Fp8Values kV>
__device__ __forceinline__ void quant_store_div(const uint4& v, float s, float y, uint8_t* dst) {
  constexpr int N = Elem<T>::kPerVec;
  float f[N];
  vec_to_float<T>(v, f);
#pragma unroll
  for (int i = 0; i < N; ++i) f[i] = kFast ? div_rn_fast(f[i], s, y) : __fdiv_rn(f[i], s);
  if constexpr (kV != Fp8Values::kCodes) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const uint2 o = e4m3x4_to_values<kV>(f32x4_to_e4m3x4(f[i], f[i + 1], f[i + 2], f[i + 3]));
      st_cs_v2(dst + 2 * i, o);
    }
  } else if constexpr (N == 8) {
    uint2 o;
    o.x = f32x4_to_e4m3x4(f[0], f[1], f[2], f[3]);
    o.y = f32x4_to_e4m3x4(f[4], f[5], f[6], f[7]);
    st_cs_v2(dst, o);
  } else {
    st_cs_u32(dst, f32x4_to_e4m3x4(f[0], f[1], f[2], f[3]));
  }
}

// Fast path. The row stays in registers (VPT vectors per thread) between the abs-max and the cast, so it
// is read from DRAM once. kWarpPerRow: a warp owns a row (shuffles only); else the block owns one row.
template <InDtype T, int VPT, bool kWarpPerRow, Fp8Values kV>
__global__ void __launch_bounds__(kMaxThreads)
per_token_vec_kernel(const typename Elem<T>::type* __restrict__ x, int64_t M, int nvec, int64_t row_stride,
                     uint8_t* __restrict__ q, int64_t K, float* __restrict__ scale) {
  constexpr int N = Elem<T>::kPerVec;
  // its GEMM (fp8_gemm on the values forms, fp8_gemm_wgmma on the codes) is a programmatic dependent launch that may
  // start streaming its weights now (a no-op before any other kernel)
  asm volatile("griddepcontrol.launch_dependents;" :::);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int64_t row;
  int t, nthreads;
  if constexpr (kWarpPerRow) {
    row = static_cast<int64_t>(blockIdx.x) * kWarpRowsPerBlock + warp;
    if (row >= M) return;  // whole warp leaves; no block-wide barrier in this mode
    t = lane;
    nthreads = 32;
  } else {
    row = blockIdx.x;
    t = threadIdx.x;
    nthreads = blockDim.x;
  }
  const typename Elem<T>::type* xr = x + row * row_stride;

  uint4 v[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int idx = t + i * nthreads;
    v[i] = idx < nvec ? ld_nc_v4(xr + static_cast<int64_t>(idx) * N) : make_uint4(0, 0, 0, 0);
  }
  uint32_t acc = 0;
#pragma unroll
  for (int i = 0; i < VPT; ++i) acc = absmax_vec<T>(acc, v[i]);  // zero padding does not change the max
  float amax = warp_max_nan(absmax_finish<T>(acc));

  if constexpr (!kWarpPerRow) {
    __shared__ float warp_max[kMaxThreads / 32];
    if (lane == 0) warp_max[warp] = amax;
    __syncthreads();
    const int nwarps = blockDim.x >> 5;
    amax = warp_max[0];
    for (int w = 1; w < nwarps; ++w) amax = max_nan(amax, warp_max[w]);
  }
  const float s = fp8_dynamic_scale(amax);
  if (t == 0) scale[row] = s;

  constexpr int kOutBytes = kV == Fp8Values::kCodes ? 1 : 2;
  uint8_t* qr = q + row * K * kOutBytes;
  if (div_fast_ok(s)) {  // uniform over the row
    const float y = __frcp_rn(s);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int idx = t + i * nthreads;
      if (idx < nvec) quant_store_div<T, true, kV>(v[i], s, y, qr + static_cast<int64_t>(idx) * N * kOutBytes);
    }
  } else {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int idx = t + i * nthreads;
      if (idx < nvec)
        quant_store_div<T, false, kV>(v[i], s, 0.0f, qr + static_cast<int64_t>(idx) * N * kOutBytes);
    }
  }
}

// Fallback: any K, any strides, unaligned views. One block per row, reads the row twice, byte stores.
template <InDtype T, Fp8Values kV>
__global__ void __launch_bounds__(256)
per_token_scalar_kernel(const typename Elem<T>::type* __restrict__ x, int64_t M, int64_t K, int64_t row_stride,
                        int64_t col_stride, uint8_t* __restrict__ q, float* __restrict__ scale) {
  const int64_t row = blockIdx.x;
  const typename Elem<T>::type* xr = x + row * row_stride;
  float amax = 0.0f;
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x) amax = max_nan(amax, fabsf(Elem<T>::to_float(xr[k * col_stride])));
  amax = warp_max_nan(amax);
  __shared__ float warp_max[8];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = warp_max[0];
  for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) amax = max_nan(amax, warp_max[w]);
  const float s = fp8_dynamic_scale(amax);
  if (threadIdx.x == 0) scale[row] = s;
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
    const uint8_t c = f32_to_e4m3(__fdiv_rn(Elem<T>::to_float(xr[k * col_stride]), s));
    if constexpr (kV == Fp8Values::kBF16)
      reinterpret_cast<__nv_bfloat16*>(q)[row * K + k] = __float2bfloat16_rn(e4m3x2_to_f32x2(c).x);
    else if constexpr (kV == Fp8Values::kF16)
      reinterpret_cast<__half*>(q)[row * K + k] = __float2half_rn(e4m3x2_to_f32x2(c).x);
    else
      q[row * K + k] = c;
  }
}

template <InDtype T, int VPT, bool kWarpPerRow, Fp8Values kV>
cudaError_t launch_vec(const void* x, int64_t M, int nvec, int64_t row_stride, uint8_t* q, int64_t K,
                       float* scale, int threads, cudaStream_t stream) {
  const int64_t grid = kWarpPerRow ? ceil_div(M, kWarpRowsPerBlock) : M;
  per_token_vec_kernel<T, VPT, kWarpPerRow, kV><<<static_cast<unsigned>(grid), threads, 0, stream>>>(
      static_cast<const typename Elem<T>::type*>(x), M, nvec, row_stride, q, K, scale);
  return cudaGetLastError();
}

template <InDtype T, Fp8Values kV>
cudaError_t launch_typed(const Fp8QuantPerTokenArgs& a, cudaStream_t stream) {
  constexpr int N = Elem<T>::kPerVec;
  const void* x = a.x;
  const int64_t M = a.M, K = a.K, row_stride = a.row_stride, col_stride = a.col_stride;
  uint8_t* q = a.q;
  float* scale = a.scale;
  const bool fast = col_stride == 1 && K % N == 0 && row_stride % N == 0 && is_aligned(x, 16) &&
                    K / N <= kMaxVecsFast;
  if (!fast) {
    per_token_scalar_kernel<T, kV><<<static_cast<unsigned>(M), 256, 0, stream>>>(
        static_cast<const typename Elem<T>::type*>(x), M, K, row_stride, col_stride, q, scale);
    return cudaGetLastError();
  }
  const int nvec = static_cast<int>(K / N);
  if (nvec <= kMaxVecsWarpMode) {
    const int threads = 32 * kWarpRowsPerBlock;
    if (nvec <= 32) return launch_vec<T, 1, true, kV>(x, M, nvec, row_stride, q, K, scale, threads, stream);
    if (nvec <= 64) return launch_vec<T, 2, true, kV>(x, M, nvec, row_stride, q, K, scale, threads, stream);
    if (nvec <= 128) return launch_vec<T, 4, true, kV>(x, M, nvec, row_stride, q, K, scale, threads, stream);
    return launch_vec<T, 8, true, kV>(x, M, nvec, row_stride, q, K, scale, threads, stream);
  }
  // Block per row: 4 vectors per thread while that takes at most 256 threads, else 8. Measured on the H200
  // (bf16, M = 16384; VPT x threads): K = 4096 4x128 56.4 us, 2x256 56.7, 8x64 57.5; K = 8192 4x256
  // 108.9 us, 8x128 110.6, 2x512 114.1; K = 14336 8x224 183.6 us, 4x448 195.7, 16x128 198.3.
  if (ceil_div(nvec, 4) <= 256) {
    const int threads = static_cast<int>(ceil_div(ceil_div(nvec, 4), 32) * 32);
    return launch_vec<T, 4, false, kV>(x, M, nvec, row_stride, q, K, scale, threads, stream);
  }
  const int threads = static_cast<int>(ceil_div(ceil_div(nvec, 8), 32) * 32);
  return launch_vec<T, 8, false, kV>(x, M, nvec, row_stride, q, K, scale, threads, stream);
}

}  // namespace

// x: [M, K] with strides (row_stride, col_stride) in elements; q: contiguous [M, K] bytes (bf16 / fp16 in a values
// form); scale: [M].
cudaError_t launch_fp8_quant_per_token(const Fp8QuantPerTokenArgs& a, cudaStream_t stream) {
  if (a.M == 0) return cudaSuccess;
  if (a.values != Fp8Values::kCodes) {  // the values forms are the bf16 activations' (fp8_gemm's)
    if (a.dtype != InDtype::kBF16) return cudaErrorInvalidValue;
    return a.values == Fp8Values::kF16 ? launch_typed<InDtype::kBF16, Fp8Values::kF16>(a, stream)
                                       : launch_typed<InDtype::kBF16, Fp8Values::kBF16>(a, stream);
  }
  switch (a.dtype) {
    case InDtype::kBF16: return launch_typed<InDtype::kBF16, Fp8Values::kCodes>(a, stream);
    case InDtype::kF16: return launch_typed<InDtype::kF16, Fp8Values::kCodes>(a, stream);
    case InDtype::kF32: return launch_typed<InDtype::kF32, Fp8Values::kCodes>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cublade
