// Per-tensor FP8 E4M3 quantization, dynamic (scale from the tensor's abs-max) or static (given scale).
//   dynamic: scale = max(amax / 448, 1/(448*512)) (NaN kept); q = e4m3(x * (1/scale)), the reciprocal
//   rounded once to fp32 (vLLM's scaled_fp8_quant per-tensor path does the same), saturating at +-448.
// Two kernels, no host sync: amax partials per block into a workspace, then a cast pass that reduces the
// partials itself. Layout and the reasons: README.md, "fp8_quant_per_tensor".
#include "common.cuh"

namespace cublade {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;  // 2048 threads per SM: the persistent grids fill every SM once
constexpr int kUnroll = 4;       // independent 16-byte loads in flight per thread

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
  // Default caching here on purpose: what this pass reads last stays in L2 for the cast pass.
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

// Vectors are visited from the END of the tensor backwards (vector nvec-1-i for grid-stride index i): the
// amax pass read the tail last, so that part is still in L2 when the first cast blocks run. Evict-first
// loads and stores keep this pass from pushing out what it has not read yet.
template <InDtype T>
__global__ void __launch_bounds__(kThreads)
cast_flat_kernel(const typename Elem<T>::type* __restrict__ x, int64_t nvec, int64_t n, uint8_t* __restrict__ q,
                 const float* __restrict__ partials, int nparts, const float* __restrict__ static_scale,
                 float* __restrict__ scale_out) {
  constexpr int N = Elem<T>::kPerVec;
  __shared__ float smem[kThreads / 32];
  const float inv = __frcp_rn(cast_scale(partials, nparts, static_scale, scale_out, smem));
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < nvec; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = ld_cs_v4(x + (nvec - 1 - (i + u * stride)) * N);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) quant_store_mul<T>(v[u], inv, q + (nvec - 1 - (i + u * stride)) * N);
  }
  for (; i < nvec; i += stride) quant_store_mul<T>(ld_cs_v4(x + (nvec - 1 - i) * N), inv, q + (nvec - 1 - i) * N);
  if (blockIdx.x == gridDim.x - 1)
    for (int64_t e = nvec * N + threadIdx.x; e < n; e += blockDim.x)
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
cudaError_t launch_typed(const void* x_, int64_t M, int64_t K, int64_t rs, int64_t cs, uint8_t* q,
                         const float* static_scale, float* scale_out, float* workspace, int num_sms,
                         cudaStream_t stream) {
  using E = typename Elem<T>::type;
  constexpr int N = Elem<T>::kPerVec;
  const E* x = static_cast<const E*>(x_);
  const int64_t n = M * K;
  const int max_grid = num_sms * kBlocksPerSm;
  const bool flat = (M == 1 || rs == K) && (K == 1 || cs == 1) && is_aligned(x, 16);
  const int64_t nvec = flat ? n / N : 0;
  const int64_t work = flat ? ceil_div(nvec, kUnroll) : n;  // thread-iterations of the main loops
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_grid, ceil_div(work, kThreads))));
  const float* partials = nullptr;
  if (static_scale == nullptr) {
    if (flat) amax_flat_kernel<T><<<grid, kThreads, 0, stream>>>(x, nvec, n, workspace);
    else amax_strided_kernel<T><<<grid, kThreads, 0, stream>>>(x, M, K, rs, cs, workspace);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    partials = workspace;
  }
  if (flat) cast_flat_kernel<T><<<grid, kThreads, 0, stream>>>(x, nvec, n, q, partials, grid, static_scale, scale_out);
  else cast_strided_kernel<T><<<grid, kThreads, 0, stream>>>(x, M, K, rs, cs, q, partials, grid, static_scale, scale_out);
  return cudaGetLastError();
}

}  // namespace

// Floats of workspace the dynamic path needs (one partial max per block of the persistent grid).
int64_t fp8_quant_per_tensor_workspace_floats(int num_sms) { return static_cast<int64_t>(num_sms) * kBlocksPerSm; }

// x: [M, K] view with strides (rs, cs) in elements; q: contiguous [M, K]; static_scale: nullptr for the
// dynamic path (then workspace must hold fp8_quant_per_tensor_workspace_floats(num_sms) floats);
// scale_out: one float, receives the scale used.
cudaError_t launch_fp8_quant_per_tensor(const void* x, InDtype dtype, int64_t M, int64_t K, int64_t rs, int64_t cs,
                                        uint8_t* q, const float* static_scale, float* scale_out, float* workspace,
                                        int num_sms, cudaStream_t stream) {
  switch (dtype) {
    case InDtype::kBF16:
      return launch_typed<InDtype::kBF16>(x, M, K, rs, cs, q, static_scale, scale_out, workspace, num_sms, stream);
    case InDtype::kF16:
      return launch_typed<InDtype::kF16>(x, M, K, rs, cs, q, static_scale, scale_out, workspace, num_sms, stream);
    case InDtype::kF32:
      return launch_typed<InDtype::kF32>(x, M, K, rs, cs, q, static_scale, scale_out, workspace, num_sms, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cublade

#ifndef CUBLADE_LAUNCHER_ONLY
#include <ATen/ATen.h>
#include <torch/library.h>

namespace cublade {
namespace {

std::tuple<at::Tensor, at::Tensor> fp8_quant_per_tensor(const at::Tensor& x_in, const c10::optional<at::Tensor>& scale) {
  constexpr const char* op = "fp8_quant_per_tensor";
  const InDtype dt = in_dtype_of(op, "x", x_in);
  check_arch(op, x_in);
  if (scale.has_value()) check_scale_tensor(op, "scale", *scale, x_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor q = at::empty(x_in.sizes(), x_in.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scale_out = at::empty({1}, x_in.options().dtype(at::kFloat));
  if (x_in.numel() == 0) {
    CUBLADE_CHECK_VALUE(scale.has_value(), op, "dynamic quantization of an empty tensor (shape ", x_in.sizes(),
                        ") has no abs-max to take");
    scale_out.copy_(scale->reshape({1}));
    return {q, scale_out};
  }
  // The kernels see a [M, K] view: flat when x is contiguous, else rows of the last dim.
  const at::Tensor x = x_in.dim() == 0 ? x_in.reshape({1, 1})
                       : x_in.dim() == 2 ? x_in
                       : x_in.is_contiguous() ? x_in.view({1, x_in.numel()})
                                              : x_in.reshape({-1, x_in.size(-1)});
  const int nsm = sm_count(x_in);
  at::Tensor workspace;
  if (!scale.has_value())
    workspace = at::empty({fp8_quant_per_tensor_workspace_floats(nsm)}, x_in.options().dtype(at::kFloat));
  check_launch(op, launch_fp8_quant_per_tensor(
                       x.data_ptr(), dt, x.size(0), x.size(1), x.stride(0), x.stride(1),
                       static_cast<uint8_t*>(q.data_ptr()), scale.has_value() ? scale->data_ptr<float>() : nullptr,
                       scale_out.data_ptr<float>(), scale.has_value() ? nullptr : workspace.data_ptr<float>(), nsm,
                       current_stream()));
  return {q, scale_out};
}

}  // namespace

TORCH_LIBRARY_IMPL(cublade, CUDA, m) { m.impl("fp8_quant_per_tensor", &fp8_quant_per_tensor); }

}  // namespace cublade
#endif  // CUBLADE_LAUNCHER_ONLY
