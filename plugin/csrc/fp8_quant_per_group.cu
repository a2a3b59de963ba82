// Dynamic FP8 E4M3 quantization per group of 128 consecutive elements of a row: x [M, K] (bf16/fp16) ->
// q e4m3 [M, K], scale fp32 [K/128, M] (a row of scales per group: the column-major [M, K/128] that a blockwise
// 1x128-scaled FP8 GEMM reads). Per group: scale = max(amax / 448, 1/(448*512)) (NaN kept), q = e4m3(x / scale)
// (IEEE division, saturating at +-448): the per-token rule applied to each 128-element group.
// Layout: 16 lanes own one group (one 16-byte vector each), the abs-max is 4 xor-shuffles, every lane scales and
// stores its 8 bytes, the group's first lane writes the scale. 256 threads, 2 vectors per thread in flight.
#define CUBLADE_KERNELS_ONLY  // framework-free (no torch header); the torch wrapper is fp8_quant_per_group_torch.cpp
#include "common.cuh"

namespace cublade {
namespace {

constexpr int kGroup = 128;
constexpr int kThreads = 256;
constexpr int kUnroll = 2;  // vectors per thread: lanes (l, l + 256) of the block's span

template <InDtype T>
__global__ void __launch_bounds__(kThreads)
fp8_quant_per_group_kernel(const uint4* __restrict__ x, int64_t M, int64_t K, int64_t row_stride_vec,
                           uint8_t* __restrict__ q, float* __restrict__ scale) {
  constexpr int kPer = Elem<T>::kPerVec;         // 8 elements per 16-byte vector
  constexpr int kLanes = kGroup / kPer;          // 16 lanes per group
  const int64_t vec_per_row = K / kPer;
  const int64_t nvec = M * vec_per_row;
  uint4 v[kUnroll];
  int64_t idx[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    idx[u] = static_cast<int64_t>(blockIdx.x) * kThreads * kUnroll + u * kThreads + threadIdx.x;
    const int64_t m = idx[u] / vec_per_row, c = idx[u] % vec_per_row;
    v[u] = idx[u] < nvec ? ld_nc_v4(x + m * row_stride_vec + c) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    // nvec is a multiple of 16 (K % 128 == 0), so a group's 16 lanes are all in or all out: the shuffles below
    // run with the full mask on every lane of the warp (out-of-range lanes hold zeros and store nothing).
    float amax = absmax_finish<T>(absmax_vec<T>(0u, v[u]));
#pragma unroll
    for (int o = kLanes / 2; o > 0; o >>= 1) amax = max_nan(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    if (idx[u] >= nvec) continue;
    const float s = fp8_dynamic_scale(amax);
    const int64_t m = idx[u] / vec_per_row, c = idx[u] % vec_per_row;
    float f[kPer];
    vec_to_float<T>(v[u], f);
    if (div_fast_ok(s)) {  // uniform over the group
      const float y = __frcp_rn(s);
#pragma unroll
      for (int i = 0; i < kPer; ++i) f[i] = div_rn_fast(f[i], s, y);
    } else {
#pragma unroll
      for (int i = 0; i < kPer; ++i) f[i] = __fdiv_rn(f[i], s);
    }
    uint2 o;
    o.x = f32x4_to_e4m3x4(f[0], f[1], f[2], f[3]);
    o.y = f32x4_to_e4m3x4(f[4], f[5], f[6], f[7]);
    st_cs_v2(q + (m * K + c * kPer), o);
    if (c % kLanes == 0) scale[(c / kLanes) * M + m] = s;
  }
}

template <InDtype T>
cudaError_t launch_typed(const Fp8QuantPerGroupArgs& a, cudaStream_t stream) {
  const int64_t nvec = a.M * (a.K / Elem<T>::kPerVec);
  const int64_t blocks = ceil_div(nvec, static_cast<int64_t>(kThreads) * kUnroll);
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  fp8_quant_per_group_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const uint4*>(a.x), a.M, a.K, a.row_stride / Elem<T>::kPerVec, a.q, a.scale);
  return cudaGetLastError();
}

}  // namespace

// x: [M, K] bf16/fp16, unit column stride, rows 16-byte aligned (row_stride % 8 == 0), K % 128 == 0;
// q: contiguous [M, K]; scale: contiguous [K/128, M] fp32.
cudaError_t launch_fp8_quant_per_group(const Fp8QuantPerGroupArgs& a, cudaStream_t stream) {
  if (a.M == 0 || a.K == 0) return cudaSuccess;
  if (a.M < 0 || a.K % kGroup != 0 || a.row_stride % 8 != 0 || !is_aligned(a.x, 16) || !is_aligned(a.q, 8))
    return cudaErrorInvalidValue;
  switch (a.dtype) {
    case InDtype::kBF16: return launch_typed<InDtype::kBF16>(a, stream);
    case InDtype::kF16: return launch_typed<InDtype::kF16>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cublade
