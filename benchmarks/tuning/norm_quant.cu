// A decode step's RMSNorm (or SiLU-and-mul) and the per-token FP8 quantization after it, as a CUDA graph runs them:
// a residual add + RMSNorm kernel (a SiLU-and-mul kernel) followed by cublade's fp8_quant_per_token, two kernels as
// cublade's fp8 layers run without their compile pass, against the one kernel that does both and the pass puts in
// their place: cublade's rms_norm_fp8_quant (plugin/csrc/rms_norm_fp8_quant.cu) at the norm sites, cublade's
// silu_mul_fp8_quant (plugin/csrc/silu_mul_fp8_quant.cu) at the SiLU-and-mul sites. At one token Inductor's norm and
// cublade's quantization take 2.0-2.8 + 1.6 us a site in the 8B-shaped step's profile, vLLM's fused kernel 4.0 us
// (docs/decisions.md, "vLLM's RMSNorm + quantization fusion through its own quant op").
//
// Each row: 32 sites in one graph (norm sites chained through the residual: each reads the residual the one before
// wrote), us per site, the median of the replays. The fused kernel's E4M3 bytes and scales are checked against the
// two kernels' (the same bf16 values, the same quantization rule), and the norm's residuals against each other; a
// mismatch prints FAIL and the exit status is 1. The SiLU-and-mul kernel of the two-kernel sites is a pointwise one
// (8 outputs a thread, a grid over the row), rounding y as the fused kernel does; Inductor's own for vLLM's native
// SiluAndMul divides with Triton's approximate division and is not this one. A second table times
// silu_mul_fp8_quant with each split of a row over 1, 2, 4 or 8 CTAs (its launcher's rule picks one of them).
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I plugin/csrc -I benchmarks/tuning \
//        benchmarks/tuning/norm_quant.cu -o /tmp/norm_quant
//   /tmp/norm_quant [reps] [M list, default 1,4,16,64,256] [norm K list, default 4096,8192]
//                   [silu_mul K list, default 14336; at most 131072]
#include "fp8_quant_per_token.cu"
#include "rms_norm_fp8_quant.cu"
#include "silu_mul_fp8_quant.cu"
#include "harness.cuh"

#include <cstring>
#include <type_traits>
#include <vector>

using namespace cublade;

namespace norm_quant {

constexpr int kThreads = 256;
constexpr int kLayers = 32;
constexpr float kEps = 1e-5f;

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

// y = bf16(g / (1 + exp(-g)) * u) for x [M, 2K] = g | u, the numerics of silu_mul_fp8_quant (one rounding): 8
// outputs a thread, one 16-byte load of each half, one 16-byte store; grid (M, K / 8 / 128).
__global__ void __launch_bounds__(128)
silu_mul_kernel(const __nv_bfloat16* __restrict__ x, int64_t K, __nv_bfloat16* __restrict__ y) {
  const int64_t row = blockIdx.x, c = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * 8;
  if (c >= K) return;
  const __nv_bfloat16* g = x + row * 2 * K;
  float gf[8], uf[8], yf[8];
  vec_to_float<InDtype::kBF16>(ld_nc_v4(g + c), gf);
  vec_to_float<InDtype::kBF16>(ld_nc_v4(g + K + c), uf);
#pragma unroll
  for (int j = 0; j < 8; ++j) yf[j] = __fmul_rn(__fdiv_rn(gf[j], __fadd_rn(1.0f, expf(-gf[j]))), uf[j]);
  uint4 o;
  __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
  for (int j = 0; j < 4; ++j) o2[j] = __floats2bfloat162_rn(yf[2 * j], yf[2 * j + 1]);
  *reinterpret_cast<uint4*>(y + row * K + c) = o;
}

cudaError_t launch_silu_mul(const __nv_bfloat16* x, int M, int K, __nv_bfloat16* y, cudaStream_t s) {
  silu_mul_kernel<<<dim3(M, static_cast<unsigned>(ceil_div(K / 8, 128))), 128, 0, s>>>(x, K, y);
  return cudaGetLastError();
}

// cublade's fused kernel; ctas_per_row 0: its launcher's rule.
cudaError_t launch_fused_silu(const __nv_bfloat16* x, int M, int K, uint8_t* q, float* scale, int num_sms,
                              int ctas_per_row, cudaStream_t s) {
  SiluMulFp8QuantArgs a;
  a.x = x, a.dtype = InDtype::kBF16, a.M = M, a.K = K, a.x_row_stride = 2 * static_cast<int64_t>(K);
  a.q = q, a.scale = scale, a.num_sms = num_sms, a.ctas_per_row = ctas_per_row;
  return launch_silu_mul_fp8_quant(a, s);
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
  const int sms = prop.multiProcessorCount;
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
          if (silu) CK(launch_silu_mul(x, M, K, y, st));
          else CK(launch_norm(x, res, w, M, K, y, st));
          CK(launch_fp8_quant_per_token(qa, st));
        };
        auto fused = [&] {
          if (silu) CK(launch_fused_silu(x, M, K, q2, s2, sms, 0, st));
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

  // silu_mul_fp8_quant by CTAs a row: each split's bytes and scales against the rule's (the same values whatever the
  // split), us per site as above; "-" where a CTA's share would not fit its registers.
  std::printf("\n| silu_mul_fp8_quant | M | K | rule's CTAs a row | 1 | 2 | 4 | 8 | check |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|---|\n");
  for (int K : silu_Ks) {
    for (int M : Ms) {
      const size_t n = static_cast<size_t>(M) * K;
      std::vector<__nv_bfloat16> hx(2 * n);
      uint32_t seed = 777u + M * 7u + K;
      auto rnd = [&] { seed = seed * 1664525u + 1013904223u; return (seed >> 8) * (1.0f / 16777216.0f) - 0.5f; };
      for (auto& v : hx) v = __float2bfloat16(4.0f * rnd());
      __nv_bfloat16* x;
      uint8_t* q;
      float* sc;
      CK(cudaMalloc(&x, 2 * n * 2)); CK(cudaMalloc(&q, n)); CK(cudaMalloc(&sc, M * 4));
      CK(cudaMemcpy(x, hx.data(), 2 * n * 2, cudaMemcpyHostToDevice));
      SiluMulFp8QuantArgs rule;
      rule.M = M, rule.K = K, rule.num_sms = sms;
      std::vector<uint8_t> b0(n), b(n);
      std::vector<float> c0(M), c(M);
      CK(launch_fused_silu(x, M, K, q, sc, sms, 0, st));
      CK(cudaMemcpy(b0.data(), q, n, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(c0.data(), sc, M * 4, cudaMemcpyDeviceToHost));
      bool ok = true;
      std::printf("| | %d | %d | %d |", M, K, silu_quant::ctas_per_row(rule));
      for (int C : {1, 2, 4, 8}) {
        if (ceil_div(K / 8, C) > silu_quant::kMaxVecsPerCta) {
          std::printf(" - |");
          continue;
        }
        CK(cudaMemset(q, 0, n));
        CK(launch_fused_silu(x, M, K, q, sc, sms, C, st));
        CK(cudaMemcpy(b.data(), q, n, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(c.data(), sc, M * 4, cudaMemcpyDeviceToHost));
        ok = ok && b == b0 && std::memcmp(c.data(), c0.data(), M * 4) == 0;
        const double t = harness::graph_us(st, reps, [&] {
          for (int l = 0; l < kLayers; ++l) CK(launch_fused_silu(x, M, K, q, sc, sms, C, st));
        }) / kLayers;
        std::printf(" %.2f |", t);
      }
      failures += !ok;
      std::printf(" %s |\n", ok ? "bytes, scales equal" : "FAIL");
      CK(cudaFree(x)); CK(cudaFree(q)); CK(cudaFree(sc));
    }
  }
  return failures ? 1 : 0;
}
