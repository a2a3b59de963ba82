// SiLU-and-mul and FP8 E4M3 quantization of its output in one kernel: the two ops a decode step runs between a gated
// MLP's gate_up projection and its FP8 W8A8 down projection, fused by cublade's compile pass (plugin/vllm/fusion.py).
//   x [M, 2K]: gate g = x[:, :K], up u = x[:, K:] (vLLM's SiluAndMul layout)
//   y = T(g / (1 + exp(-g)) * u)     fp32 math (IEEE division, expf), rounded once to x's dtype T: what Inductor
//                                    generates for vLLM's native SiluAndMul (its silu decomposition, the silu's own
//                                    rounding to T elided in the fused pointwise kernel)
//   dynamic: scale = max(amax_row(y) / 448, 1/(448*512)), q = e4m3(y / scale)   (fp8_quant_per_token's rule)
//   static:  q = e4m3(y * (1 / scale))                                           (fp8_quant_per_tensor's rule)
// A row is split over C CTAs of 256 threads, each CTA's slice in registers from the load to the store (read once).
// At fewer rows than SMs, C is the smallest power of two that leaves each CTA at most 2048 of the row's elements (at
// most 8, and no more than keep the grid within 3.5 CTAs an SM): one CTA a row is latency-bound there (a decode
// step's few 14336-wide rows would each wait on one SM's loads). Dynamic scales need the row's abs-max, so those C
// CTAs form a thread-block cluster: each CTA reduces its slice, the cluster's maximum goes through distributed shared
// memory, then every CTA quantizes its slice. At least as many rows as SMs fill the GPU by themselves: C is then the
// fewest CTAs whose registers hold the row (1 up to K = 16384). A static scale needs no reduction: the same split,
// without a cluster.
#define CUBLADE_KERNELS_ONLY  // framework-free (no torch header); the torch wrapper is silu_mul_fp8_quant_torch.cpp
#include "common.cuh"

#include <cooperative_groups.h>

namespace cublade {
namespace {
// Names of their own: benchmarks/tuning/norm_quant.cu compiles this file in one program with rms_norm_fp8_quant.cu.
namespace silu_quant {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kMaxVpt = 8;                           // 16-byte vectors a thread holds
constexpr int kMaxVecsPerCta = kThreads * kMaxVpt;   // 2048 vectors: 16384 elements
constexpr int64_t kSplitElems = 2048;                // a CTA's share of a row at fewer rows than SMs
static_assert(kSiluMulFp8QuantMaxK == kSiluMulFp8QuantMaxCtas * kMaxVecsPerCta * 8, "the widest row fills 8 CTAs");

// y = T(g / (1 + exp(-g)) * u) for one vector of 8 gates and the 8 ups beside them. Every step rounds as the torch
// ops of the reference do (the intrinsics keep nvcc from contracting the add or the multiply into an FMA).
template <InDtype T>
__device__ __forceinline__ uint4 silu_mul_vec(const uint4& gv, const uint4& uv) {
  float g[8], u[8], y[8];
  vec_to_float<T>(gv, g);
  vec_to_float<T>(uv, u);
#pragma unroll
  for (int j = 0; j < 8; ++j) y[j] = __fmul_rn(__fdiv_rn(g[j], __fadd_rn(1.0f, expf(-g[j]))), u[j]);
  return pack8_rn<T>(y);
}

// CTA b of the grid: row b / C, slice b % C of it (vectors [slice * per_cta, (slice + 1) * per_cta) of the row's
// K / 8); with kCluster the C CTAs of a row are one cluster (the grid's consecutive blocks), slice its block rank.
// kStatic: the per-tensor static scale, no reduction (never with kCluster); else dynamic per token, where C > 1 needs
// kCluster.
template <InDtype T, int VPT, bool kCluster, bool kStatic>
__global__ void __launch_bounds__(kThreads)
silu_mul_fp8_quant_kernel(SiluMulFp8QuantArgs a, int C, int per_cta) {
  static_assert(!(kCluster && kStatic), "a static scale needs no cluster");
  // the GEMM after it (fp8_gemm_wgmma) is a programmatic dependent launch that may start streaming its weights now
  asm volatile("griddepcontrol.launch_dependents;" :::);
  using E = typename Elem<T>::type;
  const int64_t row = blockIdx.x / C;
  const int slice = static_cast<int>(blockIdx.x % C);
  const int nvec = static_cast<int>(a.K / 8);
  const int v0 = slice * per_cta, v1 = min(nvec, v0 + per_cta);
  const E* g = static_cast<const E*>(a.x) + row * a.x_row_stride;
  const E* u = g + a.K;

  uint4 yv[VPT];
  uint32_t acc = 0;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int idx = v0 + threadIdx.x + i * kThreads;
    if (idx >= v1) continue;
    yv[i] = silu_mul_vec<T>(ld_nc_v4(g + idx * 8), ld_nc_v4(u + idx * 8));
    if constexpr (!kStatic) acc = absmax_vec<T>(acc, yv[i]);
  }

  float s, y_rcp;
  bool fast = true;
  if constexpr (kStatic) {
    s = *a.static_scale;
    y_rcp = __frcp_rn(s);
    if (blockIdx.x == 0 && threadIdx.x == 0) a.scale[0] = s;
  } else {
    __shared__ float red[kThreads / 32];
    float amax = block_max<kThreads>(absmax_finish<T>(acc), red);
    if constexpr (kCluster) {
      // The slices' maxima through distributed shared memory: each CTA publishes its own, the cluster barrier makes
      // them visible (and guarantees every CTA of the cluster runs), then every thread reads all C of them, in rank
      // order, so every CTA computes the same scale.
      __shared__ float slice_max;
      const cg::cluster_group cluster = cg::this_cluster();
      if (threadIdx.x == 0) slice_max = amax;
      cluster.sync();
      amax = 0.f;  // +0: no maximum is below it (NaN propagates through max_nan)
#pragma unroll
      for (int r = 0; r < kSiluMulFp8QuantMaxCtas; ++r)
        if (r < C) amax = max_nan(amax, *cluster.map_shared_rank(&slice_max, r));
      cluster.barrier_arrive();  // done reading the others' slice_max; the matching wait is before the exit
    }
    s = fp8_dynamic_scale(amax);
    if (slice == 0 && threadIdx.x == 0) a.scale[row] = s;
    fast = div_fast_ok(s);  // every finite row's scale; NaN / Inf rows take the IEEE division
    y_rcp = __frcp_rn(s);
  }

  uint8_t* q = a.q + row * a.K;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int idx = v0 + threadIdx.x + i * kThreads;
    if (idx >= v1) continue;
    st_cs_v2(q + idx * 8, quantize_vec_e4m3<T, kStatic>(yv[i], s, y_rcp, fast));
  }
  // No CTA leaves while another of its cluster may still read its slice_max (shared memory ends with the CTA).
  if constexpr (kCluster) cg::this_cluster().barrier_wait();
}

template <InDtype T, int VPT, bool kCluster, bool kStatic>
cudaError_t launch_kernel(const SiluMulFp8QuantArgs& a, int C, int per_cta, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(a.M * C));
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if constexpr (kCluster) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(C);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&cfg, silu_mul_fp8_quant_kernel<T, VPT, kCluster, kStatic>, a, C, per_cta);
}

// The fewest vectors a thread holds (1, 2, 4 or 8) for per_cta vectors a CTA.
template <InDtype T, bool kCluster, bool kStatic>
cudaError_t launch_vpt(const SiluMulFp8QuantArgs& a, int C, int per_cta, cudaStream_t stream) {
  if (per_cta <= kThreads) return launch_kernel<T, 1, kCluster, kStatic>(a, C, per_cta, stream);
  if (per_cta <= 2 * kThreads) return launch_kernel<T, 2, kCluster, kStatic>(a, C, per_cta, stream);
  if (per_cta <= 4 * kThreads) return launch_kernel<T, 4, kCluster, kStatic>(a, C, per_cta, stream);
  return launch_kernel<T, 8, kCluster, kStatic>(a, C, per_cta, stream);
}

template <InDtype T>
cudaError_t launch_dtype(const SiluMulFp8QuantArgs& a, int C, int per_cta, cudaStream_t stream) {
  if (a.static_scale != nullptr) return launch_vpt<T, false, true>(a, C, per_cta, stream);
  return C > 1 ? launch_vpt<T, true, false>(a, C, per_cta, stream) : launch_vpt<T, false, false>(a, C, per_cta, stream);
}

// CTAs per row (the file's header says why): the fewest, as a power of two, whose registers hold the row; at fewer
// rows than SMs at least enough that each holds at most kSplitElems elements, up to kSiluMulFp8QuantMaxCtas, but no
// more than keep the grid within 3.5 CTAs an SM: beyond that the wider clusters cost more than their shorter slices
// save (benchmarks/tuning/norm_quant.cu on the H200, K 14336, CTAs a row 1 / 2 / 4 / 8: 64 rows 7.57 / 6.29 / 5.17 /
// 5.29 us, 112 rows 7.67 / 6.93 / 6.41 / 6.86, 128 rows 7.72 / 6.97 / 7.24 / 7.74; up to 48 rows 8 is within 6% of
// the best).
int ctas_per_row(const SiluMulFp8QuantArgs& a) {
  if (a.ctas_per_row > 0) return a.ctas_per_row;
  const int64_t nvec = a.K / 8;
  int fit = 1;
  while (static_cast<int64_t>(fit) * kMaxVecsPerCta < nvec) fit *= 2;
  if (a.M >= a.num_sms) return fit;
  int split = 1;
  // the next split's grid, M * 2 * split CTAs, within 3.5 an SM
  while (split < kSiluMulFp8QuantMaxCtas && split * kSplitElems < a.K && 4 * a.M * split <= 7 * a.num_sms) split *= 2;
  return split > fit ? split : fit;
}

}  // namespace silu_quant
}  // namespace

cudaError_t launch_silu_mul_fp8_quant(const SiluMulFp8QuantArgs& a, cudaStream_t stream) {
  using namespace silu_quant;
  if (a.M == 0) return cudaSuccess;
  if (a.K < 8 || a.K % 8 || a.K > kSiluMulFp8QuantMaxK || a.x_row_stride % 8 ||
      (a.dtype != InDtype::kBF16 && a.dtype != InDtype::kF16) || a.ctas_per_row < 0 ||
      a.ctas_per_row > kSiluMulFp8QuantMaxCtas)
    return cudaErrorInvalidValue;
  const int C = ctas_per_row(a);
  const int64_t per_cta = ceil_div(a.K / 8, C);
  if (per_cta > kMaxVecsPerCta) return cudaErrorInvalidValue;  // a ctas_per_row too small for the row
  const int p = static_cast<int>(per_cta);
  return a.dtype == InDtype::kBF16 ? launch_dtype<InDtype::kBF16>(a, C, p, stream)
                                   : launch_dtype<InDtype::kF16>(a, C, p, stream);
}

}  // namespace cublade
