// RMSNorm (optionally after a residual add) and FP8 E4M3 quantization of its output in one kernel: the two ops a
// decode step runs before every FP8 W8A8 projection fed by a norm (qkv after input_layernorm, gate_up after
// post_attention_layernorm), fused by cublade's compile pass (plugin/vllm/fusion.py).
//   h = x (+ residual) in fp32; residual_out = h rounded to x's dtype
//   y = T(T(h * rsqrt(mean(h^2) + eps)) * weight)        vLLM's native rms_norm / fused_add_rms_norm
//   dynamic: scale = max(amax_row(y) / 448, 1/(448*512)), q = e4m3(y / scale)   (fp8_quant_per_token's rule)
//   static:  q = e4m3(y * (1 / scale))                                           (fp8_quant_per_tensor's rule)
// One CTA per row, the row in registers from the load to the store (read once). Against the two kernels it
// replaces, one site of a CUDA-graphed chain takes 2.31 us against 3.41 at one 4096-wide token on the H200
// (benchmarks/tuning/norm_quant.cu). Only mean(h^2)'s summation order differs from the torch ops (docs/kernels.md).
#define CUBLADE_KERNELS_ONLY  // framework-free (no torch header); the torch wrapper is rms_norm_fp8_quant_torch.cpp
#include "common.cuh"

#include <type_traits>

namespace cublade {
namespace {

constexpr int kThreads = 256;

template <InDtype T>
__device__ __forceinline__ float round_to(float v) {
  return Elem<T>::to_float(Elem<T>::from_float(v));
}

// kResidual: the add before the norm. kStatic: the per-tensor static scale (else dynamic per token).
template <InDtype T, int VPT, bool kResidual, bool kStatic>
__global__ void __launch_bounds__(kThreads)
rms_norm_fp8_quant_kernel(RmsNormFp8QuantArgs a) {
  // the GEMM after it (fp8_gemm_wgmma) is a programmatic dependent launch that may start streaming its weights now
  asm volatile("griddepcontrol.launch_dependents;" :::);
  using E = typename Elem<T>::type;
  __shared__ float red[kThreads / 32];
  const int64_t row = blockIdx.x;
  const int nvec = static_cast<int>(a.K / 8);
  const E* x = static_cast<const E*>(a.x) + row * a.x_row_stride;

  // Every load first (x, the residual, the norm weight), then the math: written in one loop, nvcc kept each vector's
  // loads behind the previous vector's residual store (which may alias x) and the weight's behind the block sum, so
  // a thread made up to 3 round trips to memory where one suffices.
  const E* w_row = static_cast<const E*>(a.weight);
  uint4 xv[VPT], rv[VPT], wv[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    if (idx >= nvec) continue;
    xv[i] = ld_nc_v4(x + idx * 8);
    if constexpr (kResidual) rv[i] = ld_nc_v4(static_cast<const E*>(a.residual) + row * a.K + idx * 8);
    wv[i] = ld_nc_v4(w_row + idx * 8);
  }

  float h[VPT][8];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    if (idx >= nvec) continue;
    vec_to_float<T>(xv[i], h[i]);
    if constexpr (kResidual) {
      float r[8];
      vec_to_float<T>(rv[i], r);
#pragma unroll
      for (int j = 0; j < 8; ++j) h[i][j] = __fadd_rn(h[i][j], r[j]);
      *reinterpret_cast<uint4*>(static_cast<E*>(a.residual_out) + row * a.K + idx * 8) = pack8_rn<T>(h[i]);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) ss = __fadd_rn(ss, __fmul_rn(h[i][j], h[i][j]));  // pow(2), then the sum
  }
  const float inv_rms = rsqrtf(__fadd_rn(__fdiv_rn(block_sum<kThreads>(ss, red), static_cast<float>(a.K)), a.eps));

  uint4 yv[VPT];
  uint32_t acc = 0;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    if (idx >= nvec) continue;
    float w[8], y[8];
    vec_to_float<T>(wv[i], w);
#pragma unroll
    for (int j = 0; j < 8; ++j) y[j] = __fmul_rn(round_to<T>(__fmul_rn(h[i][j], inv_rms)), w[j]);
    yv[i] = pack8_rn<T>(y);
    if constexpr (!kStatic) acc = absmax_vec<T>(acc, yv[i]);
  }

  float s, y_rcp;
  bool fast = true;
  if constexpr (kStatic) {
    s = *a.static_scale;
    y_rcp = __frcp_rn(s);
    if (row == 0 && threadIdx.x == 0) a.scale[0] = s;
  } else {
    s = fp8_dynamic_scale(block_max<kThreads>(absmax_finish<T>(acc), red));
    if (threadIdx.x == 0) a.scale[row] = s;
    fast = div_fast_ok(s);  // every finite row's scale; NaN / Inf rows take the IEEE division
    y_rcp = __frcp_rn(s);
  }
  uint8_t* q = a.q + row * a.K;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    if (idx >= nvec) continue;
    st_cs_v2(q + idx * 8, quantize_vec_e4m3<T, kStatic>(yv[i], s, y_rcp, fast));
  }
}

template <InDtype T, bool kResidual, bool kStatic>
cudaError_t launch_typed(const RmsNormFp8QuantArgs& a, cudaStream_t stream) {
  const int64_t nvec = a.K / 8;
  const dim3 grid(static_cast<unsigned>(a.M));
  if (nvec <= kThreads) rms_norm_fp8_quant_kernel<T, 1, kResidual, kStatic><<<grid, kThreads, 0, stream>>>(a);
  else if (nvec <= 2 * kThreads) rms_norm_fp8_quant_kernel<T, 2, kResidual, kStatic><<<grid, kThreads, 0, stream>>>(a);
  else if (nvec <= 4 * kThreads) rms_norm_fp8_quant_kernel<T, 4, kResidual, kStatic><<<grid, kThreads, 0, stream>>>(a);
  else rms_norm_fp8_quant_kernel<T, 8, kResidual, kStatic><<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <InDtype T>
cudaError_t launch_dtype(const RmsNormFp8QuantArgs& a, cudaStream_t stream) {
  const bool res = a.residual != nullptr, st = a.static_scale != nullptr;
  if (res) return st ? launch_typed<T, true, true>(a, stream) : launch_typed<T, true, false>(a, stream);
  return st ? launch_typed<T, false, true>(a, stream) : launch_typed<T, false, false>(a, stream);
}

}  // namespace

cudaError_t launch_rms_norm_fp8_quant(const RmsNormFp8QuantArgs& a, cudaStream_t stream) {
  if (a.M == 0) return cudaSuccess;
  if (a.K <= 0 || a.K % 8 || a.K > kRmsNormFp8QuantMaxK || (a.dtype != InDtype::kBF16 && a.dtype != InDtype::kF16))
    return cudaErrorInvalidValue;
  return a.dtype == InDtype::kBF16 ? launch_dtype<InDtype::kBF16>(a, stream) : launch_dtype<InDtype::kF16>(a, stream);
}

}  // namespace cublade
