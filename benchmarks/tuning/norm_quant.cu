// A decode step's RMSNorm (or SiLU-and-mul) and the per-token FP8 quantization after it, as a CUDA graph runs them:
// a residual add + RMSNorm kernel (a SiLU-and-mul kernel) followed by cublade's fp8_quant_per_token, two kernels as
// cublade's fp8 layers run without their compile pass, against one kernel that does both: for the norm sites
// cublade's rms_norm_fp8_quant (plugin/csrc/rms_norm_fp8_quant.cu), for SiLU-and-mul a one-CTA-a-row prototype. At
// one token Inductor's norm and cublade's quantization take 2.0-2.8 + 1.6 us a site in the 8B-shaped step's profile,
// vLLM's fused kernel 4.0 us (docs/decisions.md, "vLLM's RMSNorm + quantization fusion through its own quant op").
//
// Each row: 32 sites in one graph (norm sites chained through the residual: each reads the residual the one before
// wrote), us per site, the median of the replays. The fused kernel's E4M3 bytes and scales are checked against the
// two kernels' (the same bf16 values, the same quantization rule), and the norm's residuals against each other; a
// mismatch prints FAIL and the exit status is 1.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I plugin/csrc -I benchmarks/tuning \
//        benchmarks/tuning/norm_quant.cu -o /tmp/norm_quant
//   /tmp/norm_quant [reps] [M list, default 1,4,16,64,256] [norm K list, default 4096,8192]
//                   [silu_mul K list, default 14336; at most 16384]
#include "fp8_quant_per_token.cu"
#include "rms_norm_fp8_quant.cu"
#include "harness.cuh"

#include <cstring>
#include <type_traits>
#include <vector>

using namespace cublade;

namespace norm_quant {

constexpr int kThreads = 256;
constexpr int kLayers = 32;
constexpr float kEps = 1e-5f;

// The row's bf16 values yv (their packed abs-max in acc) quantized per token with cublade's rule: scale, E4M3 bytes.
template <int VPT>
__device__ __forceinline__ void quant_row(const uint4 (&yv)[VPT], uint32_t acc, int nvec, int64_t offset, float* red,
                                          uint8_t* __restrict__ q, float* __restrict__ scale) {
  const float s = fp8_dynamic_scale(block_max<kThreads>(absmax_finish<InDtype::kBF16>(acc), red));
  if (threadIdx.x == 0) *scale = s;
  const bool fast = div_fast_ok(s);
  const float yr = __frcp_rn(s);
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    if (idx >= nvec) continue;
    if (fast) quant_store_div<InDtype::kBF16, true, Fp8Values::kCodes>(yv[i], s, yr, q + offset + idx * 8);
    else quant_store_div<InDtype::kBF16, false, Fp8Values::kCodes>(yv[i], s, 0.f, q + offset + idx * 8);
  }
}

// One row per CTA: h = x + residual in fp32 (its bf16 rounding written back as the residual), y = bf16(bf16(h *
// rsqrt(mean(h^2) + eps)) * w), vLLM's native fused_add_rms_norm, in the order of cublade's fused kernel
// (rms_norm_fp8_quant.cu), whose bytes the check then expects.
template <int VPT>
__global__ void __launch_bounds__(kThreads)
add_rms_norm_kernel(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ residual,
                    const __nv_bfloat16* __restrict__ w, int nvec, __nv_bfloat16* __restrict__ y) {
  __shared__ float red[kThreads / 32];
  const int64_t row = blockIdx.x;
  const int64_t K = static_cast<int64_t>(nvec) * 8;
  float h[VPT][8];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    if (idx >= nvec) continue;
    float r[8];
    vec_to_float<InDtype::kBF16>(ld_nc_v4(x + row * K + idx * 8), h[i]);
    vec_to_float<InDtype::kBF16>(*reinterpret_cast<const uint4*>(residual + row * K + idx * 8), r);
    uint4 o;
    __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int j = 0; j < 8; ++j) h[i][j] = __fadd_rn(h[i][j], r[j]);
#pragma unroll
    for (int j = 0; j < 4; ++j) o2[j] = __floats2bfloat162_rn(h[i][2 * j], h[i][2 * j + 1]);
    *reinterpret_cast<uint4*>(residual + row * K + idx * 8) = o;
#pragma unroll
    for (int j = 0; j < 8; ++j) ss = __fadd_rn(ss, __fmul_rn(h[i][j], h[i][j]));
  }
  const float inv = rsqrtf(__fadd_rn(__fdiv_rn(block_sum<kThreads>(ss, red), static_cast<float>(K)), kEps));
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    if (idx >= nvec) continue;
    float wf[8];
    vec_to_float<InDtype::kBF16>(ld_nc_v4(w + idx * 8), wf);
    uint4 yv;
    __nv_bfloat162* y2 = reinterpret_cast<__nv_bfloat162*>(&yv);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      y2[j] = __floats2bfloat162_rn(
          __fmul_rn(__bfloat162float(__float2bfloat16_rn(__fmul_rn(h[i][2 * j], inv))), wf[2 * j]),
          __fmul_rn(__bfloat162float(__float2bfloat16_rn(__fmul_rn(h[i][2 * j + 1], inv))), wf[2 * j + 1]));
    *reinterpret_cast<uint4*>(y + row * K + idx * 8) = yv;
  }
}

// Runs f(std::integral_constant<int, VPT>) for a row of nvec 16-byte vectors: 2, 4 or 8 of them a thread.
template <class F>
cudaError_t by_vpt(int nvec, F&& f) {
  if (nvec <= kThreads * 2) f(std::integral_constant<int, 2>{});
  else if (nvec <= kThreads * 4) f(std::integral_constant<int, 4>{});
  else if (nvec <= kThreads * 8) f(std::integral_constant<int, 8>{});
  else return cudaErrorInvalidValue;
  return cudaGetLastError();
}

cudaError_t launch_norm(const __nv_bfloat16* x, __nv_bfloat16* residual, const __nv_bfloat16* w, int M, int K,
                        __nv_bfloat16* y, cudaStream_t s) {
  return by_vpt(K / 8, [&](auto vpt) {
    add_rms_norm_kernel<decltype(vpt)::value><<<M, kThreads, 0, s>>>(x, residual, w, K / 8, y);
  });
}

// cublade's fused kernel: the residual updated in place (x + residual -> residual), as the chain above does.
cudaError_t launch_fused_norm(const __nv_bfloat16* x, __nv_bfloat16* residual, const __nv_bfloat16* w, int M, int K,
                              uint8_t* q, float* scale, cudaStream_t s) {
  RmsNormFp8QuantArgs a;
  a.x = x, a.residual = residual, a.residual_out = residual, a.weight = w, a.dtype = InDtype::kBF16;
  a.M = M, a.K = K, a.x_row_stride = K, a.eps = kEps, a.q = q, a.scale = scale;
  return launch_rms_norm_fp8_quant(a, s);
}

// One row per CTA of x [M, 2K]: y = bf16(silu(a) * b) for a = x[:, :K], b = x[:, K:] (fp32 math), vLLM's SiLU-and-mul.
// kQuant: y quantized per token instead of written.
template <int VPT, bool kQuant>
__global__ void __launch_bounds__(kThreads)
silu_mul_kernel(const __nv_bfloat16* __restrict__ x, int nvec, __nv_bfloat16* __restrict__ y, uint8_t* __restrict__ q,
                float* __restrict__ scale) {
  __shared__ float red[kThreads / 32];
  const int64_t row = blockIdx.x;
  const int64_t K = static_cast<int64_t>(nvec) * 8;
  uint4 yv[VPT];
  uint32_t acc = 0;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    if (idx >= nvec) continue;
    const uint4 a = ld_nc_v4(x + row * 2 * K + idx * 8), b = ld_nc_v4(x + row * 2 * K + K + idx * 8);
    const __nv_bfloat162* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
    const __nv_bfloat162* b2 = reinterpret_cast<const __nv_bfloat162*>(&b);
    __nv_bfloat162* y2 = reinterpret_cast<__nv_bfloat162*>(&yv[i]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 fa = __bfloat1622float2(a2[j]), fb = __bfloat1622float2(b2[j]);
      y2[j] = __floats2bfloat162_rn(fa.x / (1.f + __expf(-fa.x)) * fb.x, fa.y / (1.f + __expf(-fa.y)) * fb.y);
    }
    if constexpr (kQuant) acc = absmax_vec<InDtype::kBF16>(acc, yv[i]);
    else *reinterpret_cast<uint4*>(y + row * K + idx * 8) = yv[i];
  }
  if constexpr (kQuant) quant_row<VPT>(yv, acc, nvec, row * K, red, q, scale + row);
}

template <bool kQuant>
cudaError_t launch_silu_mul(const __nv_bfloat16* x, int M, int K, __nv_bfloat16* y, uint8_t* q, float* scale,
                            cudaStream_t s) {
  return by_vpt(K / 8, [&](auto vpt) {
    silu_mul_kernel<decltype(vpt)::value, kQuant><<<M, kThreads, 0, s>>>(x, K / 8, y, q, scale);
  });
}

}  // namespace norm_quant

using namespace norm_quant;

int main(int argc, char** argv) {
  const int reps = harness::reps_arg(argc, argv);
  const std::vector<int> Ms = harness::sizes_arg(argc, argv, 2, {1, 4, 16, 64, 256});
  const std::vector<int> Ks = harness::sizes_arg(argc, argv, 3, {4096, 8192});
  const std::vector<int> silu_Ks = harness::sizes_arg(argc, argv, 4, {14336});
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs; %d sites a graph (norm sites chained through the residual), one graph replay, "
              "median of %d; us per site\n\n| site | M | K | op + quant (2 kernels) | fused | fused / 2 kernels | "
              "check |\n|---|---:|---:|---:|---:|---:|---|\n", prop.name, prop.multiProcessorCount, kLayers, reps);
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  int failures = 0;
  for (const bool silu : {false, true}) {
    for (int K : silu ? silu_Ks : Ks) {
      for (int M : Ms) {
        const size_t n = static_cast<size_t>(M) * K, nx = silu ? 2 * n : n;
        std::vector<__nv_bfloat16> hx(nx), hw(K);
        uint32_t seed = 12345u + M * 7u + K;
        auto rnd = [&] { seed = seed * 1664525u + 1013904223u; return (seed >> 8) * (1.0f / 16777216.0f) - 0.5f; };
        for (auto& v : hx) v = __float2bfloat16(4.0f * rnd());
        for (auto& v : hw) v = __float2bfloat16(1.0f + rnd());
        __nv_bfloat16 *x, *res, *w, *y;
        uint8_t *q1, *q2;
        float *s1, *s2;
        CK(cudaMalloc(&x, nx * 2)); CK(cudaMalloc(&res, n * 2)); CK(cudaMalloc(&w, K * 2)); CK(cudaMalloc(&y, n * 2));
        CK(cudaMalloc(&q1, n)); CK(cudaMalloc(&q2, n)); CK(cudaMalloc(&s1, M * 4)); CK(cudaMalloc(&s2, M * 4));
        CK(cudaMemcpy(x, hx.data(), nx * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(w, hw.data(), K * 2, cudaMemcpyHostToDevice));
        Fp8QuantPerTokenArgs qa;
        qa.x = y, qa.M = M, qa.K = K, qa.row_stride = K, qa.col_stride = 1, qa.q = q1, qa.scale = s1;
        auto two = [&] {
          if (silu) CK(launch_silu_mul<false>(x, M, K, y, nullptr, nullptr, st));
          else CK(launch_norm(x, res, w, M, K, y, st));
          CK(launch_fp8_quant_per_token(qa, st));
        };
        auto fused = [&] {
          if (silu) CK(launch_silu_mul<true>(x, M, K, nullptr, q2, s2, st));
          else CK(launch_fused_norm(x, res, w, M, K, q2, s2, st));
        };
        // the check: one site each, from the same residual
        std::vector<uint8_t> b1(n), b2(n);
        std::vector<float> c1(M), c2(M);
        std::vector<__nv_bfloat16> r1(n), r2(n);
        CK(cudaMemcpy(res, hx.data(), n * 2, cudaMemcpyHostToDevice));
        two();
        CK(cudaMemcpy(r1.data(), res, n * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(res, hx.data(), n * 2, cudaMemcpyHostToDevice));
        fused();
        CK(cudaMemcpy(r2.data(), res, n * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(b1.data(), q1, n, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(b2.data(), q2, n, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(c1.data(), s1, M * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(c2.data(), s2, M * 4, cudaMemcpyDeviceToHost));
        const bool ok = b1 == b2 && std::memcmp(c1.data(), c2.data(), M * 4) == 0 &&
                        std::memcmp(r1.data(), r2.data(), n * 2) == 0;
        failures += !ok;
        const double t2 = harness::graph_us(st, reps, [&] { for (int l = 0; l < kLayers; ++l) two(); }) / kLayers;
        const double t1 = harness::graph_us(st, reps, [&] { for (int l = 0; l < kLayers; ++l) fused(); }) / kLayers;
        std::printf("| %s | %d | %d | %.2f | %.2f | %.2fx | %s |\n", silu ? "silu_mul" : "add + rms_norm", M, K, t2,
                    t1, t1 / t2, ok ? (silu ? "bytes, scales equal" : "bytes, scales, residuals equal") : "FAIL");
        CK(cudaFree(x)); CK(cudaFree(res)); CK(cudaFree(w)); CK(cudaFree(y));
        CK(cudaFree(q1)); CK(cudaFree(q2)); CK(cudaFree(s1)); CK(cudaFree(s2));
      }
    }
  }
  return failures ? 1 : 0;
}
