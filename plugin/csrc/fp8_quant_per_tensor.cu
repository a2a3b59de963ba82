// Per-tensor FP8 E4M3 quantization, dynamic (scale from the tensor's abs-max) or static (given scale).
//   dynamic: scale = max(amax / 448, 1/(448*512)) (NaN kept); q = e4m3(x * (1/scale)), the reciprocal
//   rounded once to fp32 (vLLM's scaled_fp8_quant per-tensor path does the same), saturating at +-448.
// Two kernels, no host sync: amax partials per block into a workspace, then a cast pass that reduces the
// partials itself. Layout and the reasons: docs/kernels.md, "fp8_quant_per_tensor".
#define CUBLADE_KERNELS_ONLY  // framework-free (no torch header); the torch wrapper is fp8_quant_per_tensor_torch.cpp
#include "common.cuh"

namespace cublade {
namespace {

constexpr int kThreads = 256;
constexpr int kAmaxBlocksPerSm = 4;  // persistent amax grid; 4 or 8 per SM measured the same (4.1 TB/s)
constexpr int kUnroll = 4;           // independent 16-byte loads in flight per thread

__device__ __forceinline__ float block_max_nan(float v, float* smem) {
  v = warp_max_nan(v);
  if ((threadIdx.x & 31) == 0) smem[threadIdx.x >> 5] = v;
  __syncthreads();
  v = smem[0];
  for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) v = max_nan(v, smem[w]);
  __syncthreads();  // smem may be reused by the caller
  return v;
}

// ---- pass 1: abs-max partials --------------------------------------------------------------------------
// Contiguous, 16-byte-aligned x seen as nvec vectors plus a scalar tail of n - nvec*N elements.
template <InDtype T>
__global__ void __launch_bounds__(kThreads)
amax_flat_kernel(const typename Elem<T>::type* __restrict__ x, int64_t nvec, int64_t n, float* __restrict__ partials) {
  constexpr int N = Elem<T>::kPerVec;
  __shared__ float smem[kThreads / 32];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t acc = 0;
  for (; i + (kUnroll - 1) * stride < nvec; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = __ldg(reinterpret_cast<const uint4*>(x + (i + u * stride) * N));
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc = absmax_vec<T>(acc, v[u]);
  }
  for (; i < nvec; i += stride) acc = absmax_vec<T>(acc, __ldg(reinterpret_cast<const uint4*>(x + i * N)));
  float m = absmax_finish<T>(acc);
  if (blockIdx.x == 0)
    for (int64_t e = nvec * N + threadIdx.x; e < n; e += blockDim.x) m = max_nan(m, fabsf(Elem<T>::to_float(x[e])));
  m = block_max_nan(m, smem);
  if (threadIdx.x == 0) partials[blockIdx.x] = m;
}

// Any strides: element e of the [M, K] view at x[(e / K) * rs + (e % K) * cs].
template <InDtype T>
__global__ void __launch_bounds__(kThreads)
amax_strided_kernel(const typename Elem<T>::type* __restrict__ x, int64_t M, int64_t K, int64_t rs, int64_t cs,
                    float* __restrict__ partials) {
  __shared__ float smem[kThreads / 32];
  const int64_t n = M * K;
  float m = 0.0f;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    m = max_nan(m, fabsf(Elem<T>::to_float(x[(e / K) * rs + (e % K) * cs])));
  m = block_max_nan(m, smem);
  if (threadIdx.x == 0) partials[blockIdx.x] = m;
}

// ---- pass 2: cast --------------------------------------------------------------------------------------
// The scale: reduced from the amax partials (dynamic) or read (static); block 0 writes it out.
__device__ __forceinline__ float cast_scale(const float* __restrict__ partials, int nparts,
                                            const float* __restrict__ static_scale, float* __restrict__ scale_out,
                                            float* smem) {
  float s;
  if (partials != nullptr) {
    float m = 0.0f;
    for (int j = threadIdx.x; j < nparts; j += blockDim.x) m = max_nan(m, partials[j]);
    s = fp8_dynamic_scale(block_max_nan(m, smem));
  } else {
    s = *static_scale;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_out = s;
  return s;
}

template <InDtype T>
__device__ __forceinline__ void quant_store_mul(const uint4& v, float inv, uint8_t* dst) {
  constexpr int N = Elem<T>::kPerVec;
  float f[N];
  vec_to_float<T>(v, f);
#pragma unroll
  for (int i = 0; i < N; ++i) f[i] = __fmul_rn(f[i], inv);
  if constexpr (N == 8) {
    st_cs_v2(dst, make_uint2(f32x4_to_e4m3x4(f[0], f[1], f[2], f[3]), f32x4_to_e4m3x4(f[4], f[5], f[6], f[7])));
  } else {
    st_cs_u32(dst, f32x4_to_e4m3x4(f[0], f[1], f[2], f[3]));
  }
}

// Two adjacent 16-byte input vectors -> their 2N fp8 bytes in one store (16 bytes for 16-bit inputs).
template <InDtype T>
__device__ __forceinline__ void quant_store_pair(const uint4& a, const uint4& b, float inv, uint8_t* dst) {
  constexpr int N = Elem<T>::kPerVec;
  float f[2 * N];
  vec_to_float<T>(a, *reinterpret_cast<float(*)[N]>(&f[0]));
  vec_to_float<T>(b, *reinterpret_cast<float(*)[N]>(&f[N]));
#pragma unroll
  for (int i = 0; i < 2 * N; ++i) f[i] = __fmul_rn(f[i], inv);
  if constexpr (N == 8) {
    st_cs_v4(dst, make_uint4(f32x4_to_e4m3x4(f[0], f[1], f[2], f[3]), f32x4_to_e4m3x4(f[4], f[5], f[6], f[7]),
                             f32x4_to_e4m3x4(f[8], f[9], f[10], f[11]), f32x4_to_e4m3x4(f[12], f[13], f[14], f[15])));
  } else {
    st_cs_v2(dst, make_uint2(f32x4_to_e4m3x4(f[0], f[1], f[2], f[3]), f32x4_to_e4m3x4(f[4], f[5], f[6], f[7])));
  }
}

// One-shot grid over PAIRS of adjacent 16-byte vectors (32 bytes in, one 16-byte fp8 store for 16-bit inputs,
// as vLLM's static kernel does): block b owns the kPairs*kThreads consecutive pairs from b*kPairs*kThreads,
// thread t pairs t, t+256. The data loads are issued before the scale is known (they do not depend on it).
// Measured on the H200 (stand-alone harness, bf16 -> fp8, 16384 x 8192, 8-byte stores): one-shot 98.8 us
// (4.07 TB/s) against 105-107 us for a persistent grid-stride loop (its loads land megabytes apart) and
// 105 us for a TMA bulk-copy pipeline; in the benchmark (cold L2), vLLM's static kernel (row per block,
// 32-byte loads, 16-byte stores) beat the 8-byte-store version 100.3 us to 109.0 us, hence the pairs.
constexpr int kPairs = 2;
template <InDtype T>
__global__ void __launch_bounds__(kThreads)
cast_flat_kernel(const typename Elem<T>::type* __restrict__ x, int64_t nvec, int64_t n, uint8_t* __restrict__ q,
                 const float* __restrict__ partials, int nparts, const float* __restrict__ static_scale,
                 float* __restrict__ scale_out) {
  // the GEMM after it (fp8_gemm_wgmma) is a programmatic dependent launch that may start streaming its weights now
  asm volatile("griddepcontrol.launch_dependents;" :::);
  constexpr int N = Elem<T>::kPerVec;
  __shared__ float smem[kThreads / 32];
  const int64_t npair = nvec / 2;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * (kThreads * kPairs) + threadIdx.x;
  uint4 a[kPairs], b[kPairs];
#pragma unroll
  for (int u = 0; u < kPairs; ++u) {
    const int64_t p = base + u * kThreads;
    if (p < npair) {
      a[u] = ld_nc_v4(x + p * 2 * N);
      b[u] = ld_nc_v4(x + p * 2 * N + N);
    }
  }
  const float inv = __frcp_rn(cast_scale(partials, nparts, static_scale, scale_out, smem));
#pragma unroll
  for (int u = 0; u < kPairs; ++u) {
    const int64_t p = base + u * kThreads;
    if (p < npair) quant_store_pair<T>(a[u], b[u], inv, q + p * 2 * N);
  }
  if (blockIdx.x == gridDim.x - 1)  // an odd last vector and the elements past the last whole vector
    for (int64_t e = npair * 2 * N + threadIdx.x; e < n; e += blockDim.x)
      q[e] = f32_to_e4m3(__fmul_rn(Elem<T>::to_float(x[e]), inv));
}

template <InDtype T>
__global__ void __launch_bounds__(kThreads)
cast_strided_kernel(const typename Elem<T>::type* __restrict__ x, int64_t M, int64_t K, int64_t rs, int64_t cs,
                    uint8_t* __restrict__ q, const float* __restrict__ partials, int nparts,
                    const float* __restrict__ static_scale, float* __restrict__ scale_out) {
  __shared__ float smem[kThreads / 32];
  const float inv = __frcp_rn(cast_scale(partials, nparts, static_scale, scale_out, smem));
  const int64_t n = M * K;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    q[e] = f32_to_e4m3(__fmul_rn(Elem<T>::to_float(x[(e / K) * rs + (e % K) * cs]), inv));
}

template <InDtype T>
cudaError_t launch_typed(const Fp8QuantPerTensorArgs& a, cudaStream_t stream) {
  using E = typename Elem<T>::type;
  constexpr int N = Elem<T>::kPerVec;
  const E* x = static_cast<const E*>(a.x);
  const int64_t M = a.M, K = a.K, rs = a.row_stride, cs = a.col_stride;
  uint8_t* q = a.q;
  const float* static_scale = a.static_scale;
  float* scale_out = a.scale_out;
  float* workspace = a.workspace;
  const int num_sms = a.num_sms;
  const int64_t n = M * K;
  const bool flat = (M == 1 || rs == K) && (K == 1 || cs == 1) && is_aligned(x, 16);
  const int64_t nvec = flat ? n / N : 0;
  // amax: persistent, grid-stride (read-only streams reach 4.1 TB/s either way); few partials for the cast
  const int64_t amax_work = flat ? ceil_div(nvec, kUnroll) : n;
  const int amax_grid = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(int64_t(num_sms) * kAmaxBlocksPerSm, ceil_div(amax_work, kThreads))));
  const float* partials = nullptr;
  if (static_scale == nullptr) {
    if (flat) amax_flat_kernel<T><<<amax_grid, kThreads, 0, stream>>>(x, nvec, n, workspace);
    else amax_strided_kernel<T><<<amax_grid, kThreads, 0, stream>>>(x, M, K, rs, cs, workspace);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    partials = workspace;
  }
  if (flat) {
    const int64_t grid = std::max<int64_t>(1, ceil_div(nvec / 2, kThreads * kPairs));
    cast_flat_kernel<T><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(x, nvec, n, q, partials, amax_grid,
                                                                                static_scale, scale_out);
  } else {
    const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(int64_t(num_sms) * 8, ceil_div(n, kThreads))));
    cast_strided_kernel<T><<<grid, kThreads, 0, stream>>>(x, M, K, rs, cs, q, partials, amax_grid, static_scale,
                                                          scale_out);
  }
  return cudaGetLastError();
}

}  // namespace

// Floats of workspace the dynamic path needs (one partial max per block of the persistent grid).
int64_t fp8_quant_per_tensor_workspace_floats(int num_sms) { return static_cast<int64_t>(num_sms) * kAmaxBlocksPerSm; }

// x: [M, K] view with strides (row_stride, col_stride) in elements; q: contiguous [M, K]; static_scale: nullptr
// for the dynamic path (then workspace must hold fp8_quant_per_tensor_workspace_floats(num_sms) floats);
// scale_out: one float, receives the scale used.
cudaError_t launch_fp8_quant_per_tensor(const Fp8QuantPerTensorArgs& a, cudaStream_t stream) {
  switch (a.dtype) {
    case InDtype::kBF16: return launch_typed<InDtype::kBF16>(a, stream);
    case InDtype::kF16: return launch_typed<InDtype::kF16>(a, stream);
    case InDtype::kF32: return launch_typed<InDtype::kF32>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cublade
