// The routing glue around the grouped FP4 expert GEMMs (plugin/vllm/moe.py, CubladeFp4MoE.apply):
//   moe_route:    top-k expert ids [T, k] + x [T, H] -> rows sorted by expert (xs [T*k, H], a row per routed
//                 (token, slot)), expert_offsets [E+1], and pos [T*k]: where row i = t*k + j went (-1: dropped)
//   moe_finalize: y [T*k, N] (the expert outputs in xs's order) -> out[t] = sum_j w[t, j] * y[pos[t*k + j]]
//   silu_mul:     h [M, 2I] (w13's output: gate | up) -> a [M, I] = silu(h[:, :I]) * h[:, I:], the input of w2
// They replace ~20 small torch kernels (argsort, scatter_add, cumsum, gathers, where, index_copy, casts, the
// weighted sum), ~50 us of launch-bound work per MoE layer at decode under a CUDA graph.
// Numerics: moe_route copies rows bit for bit; moe_finalize forms each product w * y in fp32 and adds them in
// j order from 0 (no FMA), as the reference's (y.float() * w.float()).sum(dim=1) does, and rounds once.
// silu_mul rounds like the reference's two torch ops: silu in fp32 (x / (1 + expf(-x))) rounded to the input type,
// then the product in fp32 rounded again; one kernel instead of two, reading h once.
// The order of rows inside an expert's range comes from shared-memory atomics, so it may differ between runs;
// each row's GEMM result does not depend on its place, so the layer's output does not either.
#define CUBLADE_KERNELS_ONLY  // framework-free (no torch header); the torch wrapper is moe_glue_torch.cpp
#include "common.cuh"
#include "launchers.h"

namespace cublade {
namespace {

constexpr int kRouteThreads = 1024;  // = kMoeMaxExperts: the scan gives each thread one expert
static_assert(kRouteThreads == kMoeMaxExperts, "moe_route scans one expert per thread");

// One CTA: rows per expert (shared atomics), their exclusive sum (the offsets), then each row's place:
// pos[i] = offsets[e] + its arrival among the rows of e; src[p] = i.
template <typename Id>
__global__ void __launch_bounds__(kRouteThreads)
moe_route_kernel(const Id* __restrict__ ids, int64_t n, int E, int* __restrict__ offsets, int* __restrict__ pos,
                 int* __restrict__ src) {
  __shared__ int count[kRouteThreads];  // rows per expert, then the next free place of each expert
  __shared__ int scan[kRouteThreads];
  const int e = threadIdx.x;
  count[e] = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += kRouteThreads) {
    const int64_t x = ids[i];
    if (x >= 0 && x < E) atomicAdd(&count[x], 1);
  }
  __syncthreads();
  const int c = count[e];
  scan[e] = c;
  __syncthreads();
  for (int d = 1; d < kRouteThreads; d <<= 1) {  // inclusive scan (Hillis-Steele)
    const int v = e >= d ? scan[e - d] : 0;
    __syncthreads();
    scan[e] += v;
    __syncthreads();
  }
  if (e < E) {
    offsets[e] = scan[e] - c;
    count[e] = scan[e] - c;
  }
  if (e == E - 1) offsets[E] = scan[e];
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += kRouteThreads) {
    const int64_t x = ids[i];
    int p = -1;
    if (x >= 0 && x < E) {
      p = atomicAdd(&count[x], 1);
      src[p] = static_cast<int>(i);
    }
    pos[i] = p;
  }
}

// xs[p] = x[src[p] / k] for the routed rows (p < offsets[E]); the others stay unwritten (no expert reads them).
__global__ void moe_gather_kernel(const uint4* __restrict__ x, int64_t x_stride16, const int* __restrict__ src,
                                  const int* __restrict__ offsets, int E, int k, int64_t row16,
                                  uint4* __restrict__ xs) {
  const int64_t p = blockIdx.x;
  if (p >= offsets[E]) return;
  const uint4* in = x + static_cast<int64_t>(src[p] / k) * x_stride16;
  uint4* out = xs + p * row16;
  for (int64_t c = threadIdx.x; c < row16; c += blockDim.x) out[c] = in[c];
}

// out[t, c..c+7] (one 16-byte vector per thread): sum over j of w[t, j] * y[pos[t*k + j], c..] in fp32, from 0, in
// j order; a dropped row adds w * 0 (the reference zeroes its row).
template <InDtype YT, InDtype WT>
__global__ void moe_finalize_kernel(const typename Elem<YT>::type* __restrict__ y, int64_t y_stride,
                                    const int* __restrict__ pos, const typename Elem<WT>::type* __restrict__ w, int k,
                                    int64_t H, typename Elem<YT>::type* __restrict__ out) {
  using T = typename Elem<YT>::type;
  static_assert(Elem<YT>::kPerVec == 8, "y is a 16-bit type: 8 columns per vector");
  const int64_t t = blockIdx.x;
  const int64_t c = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * 8;
  if (c >= H) return;
  float acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
  for (int j = 0; j < k; ++j) {
    const int p = pos[t * k + j];
    const float wj = Elem<WT>::to_float(w[t * k + j]);
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (p >= 0) v = *reinterpret_cast<const uint4*>(y + p * y_stride + c);
    float e[8];
    vec_to_float<YT>(v, e);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(e[i], wj));
  }
  uint4 o;
  T* oe = reinterpret_cast<T*>(&o);
#pragma unroll
  for (int i = 0; i < 8; ++i) oe[i] = Elem<YT>::from_float(acc[i]);
  *reinterpret_cast<uint4*>(out + t * H + c) = o;
}

template <InDtype YT, InDtype WT>
cudaError_t finalize_as(const MoeFinalizeArgs& a, cudaStream_t stream) {
  using T = typename Elem<YT>::type;
  constexpr int kThreads = 128;
  const dim3 grid(static_cast<unsigned>(a.T), static_cast<unsigned>(ceil_div(a.H / 8, kThreads)));
  moe_finalize_kernel<YT, WT><<<grid, kThreads, 0, stream>>>(
      static_cast<const T*>(a.y), a.y_stride, a.pos, static_cast<const typename Elem<WT>::type*>(a.w), a.k, a.H,
      static_cast<T*>(a.out));
  return cudaGetLastError();
}

template <InDtype YT>
cudaError_t finalize_w(const MoeFinalizeArgs& a, cudaStream_t stream) {
  switch (a.w_dtype) {
    case InDtype::kF32: return finalize_as<YT, InDtype::kF32>(a, stream);
    case InDtype::kBF16: return finalize_as<YT, InDtype::kBF16>(a, stream);
    case InDtype::kF16: return finalize_as<YT, InDtype::kF16>(a, stream);
  }
  return cudaErrorInvalidValue;
}

// 8 outputs per thread: one 16-byte load of the gate half, one of the up half, one 16-byte store.
template <InDtype DT>
__global__ void silu_mul_kernel(const typename Elem<DT>::type* __restrict__ h, int64_t h_stride, int64_t I,
                                typename Elem<DT>::type* __restrict__ out) {
  using T = typename Elem<DT>::type;
  const int64_t m = blockIdx.x, c = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * 8;
  if (c >= I) return;
  const T* row = h + m * h_stride;
  const uint4 g = *reinterpret_cast<const uint4*>(row + c), u = *reinterpret_cast<const uint4*>(row + I + c);
  const T* ge = reinterpret_cast<const T*>(&g);
  const T* ue = reinterpret_cast<const T*>(&u);
  uint4 o;
  T* oe = reinterpret_cast<T*>(&o);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float x = Elem<DT>::to_float(ge[i]);
    const T s = Elem<DT>::from_float(x / (1.0f + expf(-x)));
    oe[i] = Elem<DT>::from_float(Elem<DT>::to_float(s) * Elem<DT>::to_float(ue[i]));
  }
  *reinterpret_cast<uint4*>(out + m * I + c) = o;
}

template <InDtype DT>
cudaError_t silu_mul_as(const SiluMulArgs& a, cudaStream_t stream) {
  using T = typename Elem<DT>::type;
  constexpr int kThreads = 128;
  const dim3 grid(static_cast<unsigned>(a.M), static_cast<unsigned>(ceil_div(a.I / 8, kThreads)));
  silu_mul_kernel<DT><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(a.h), a.h_stride, a.I,
                                                      static_cast<T*>(a.out));
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_silu_mul(const SiluMulArgs& a, cudaStream_t stream) {
  if (a.I % 8 || a.h_stride % 8) return cudaErrorInvalidValue;
  if (a.M == 0 || a.I == 0) return cudaSuccess;
  if (a.dtype == InDtype::kBF16) return silu_mul_as<InDtype::kBF16>(a, stream);
  if (a.dtype == InDtype::kF16) return silu_mul_as<InDtype::kF16>(a, stream);
  return cudaErrorInvalidValue;
}

cudaError_t launch_moe_route(const MoeRouteArgs& a, cudaStream_t stream) {
  const int64_t n = a.n;
  const int E = a.E, k = a.k;
  if (E < 1 || E > kMoeMaxExperts || k < 1 || a.row_bytes % 16 || a.x_stride_bytes % 16) return cudaErrorInvalidValue;
  if (a.ids64)
    moe_route_kernel<int64_t><<<1, kRouteThreads, 0, stream>>>(static_cast<const int64_t*>(a.ids), n, E, a.offsets,
                                                               a.pos, a.src);
  else
    moe_route_kernel<int32_t><<<1, kRouteThreads, 0, stream>>>(static_cast<const int32_t*>(a.ids), n, E, a.offsets,
                                                               a.pos, a.src);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess || n == 0) return err;
  moe_gather_kernel<<<static_cast<unsigned>(n), 128, 0, stream>>>(static_cast<const uint4*>(a.x),
                                                                  a.x_stride_bytes / 16, a.src, a.offsets, E, k,
                                                                  a.row_bytes / 16, static_cast<uint4*>(a.xs));
  return cudaGetLastError();
}

cudaError_t launch_moe_finalize(const MoeFinalizeArgs& a, cudaStream_t stream) {
  if (a.H % 8 || a.y_stride % 8 || a.k < 1) return cudaErrorInvalidValue;
  if (a.T == 0 || a.H == 0) return cudaSuccess;
  if (a.y_dtype == InDtype::kBF16) return finalize_w<InDtype::kBF16>(a, stream);
  if (a.y_dtype == InDtype::kF16) return finalize_w<InDtype::kF16>(a, stream);
  return cudaErrorInvalidValue;
}

}  // namespace cublade
