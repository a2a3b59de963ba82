// cublade's FP8 W8A8 wgmma GEMM (plugin/csrc/fp8_gemm_wgmma.cu) on its own: each (shape, M) point runs the
// launcher's plan and every other tile / K split it can run, checks each output against an fp32 reference kernel
// (the same E4M3 inputs; only the summation order differs, so the bf16 outputs may differ in the last bit), and
// prints the median time of calls each after a 256 MB read (L2 full of clean lines, as after the previous layer's
// GEMM in a step; do_bench's memset leaves it dirty, whose write-backs slow the small weights' calls), the weight
// bytes' TB/s and the TFLOP/s. A point whose output is off prints FAIL and the exit status is 1.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I plugin/csrc -I benchmarks/tuning \
//        benchmarks/tuning/fp8_wgmma.cu -o /tmp/fp8_wgmma
//   /tmp/fp8_wgmma [reps] [M list, default 16,64,128,256,512,1024] [KxN list, default Llama-3-8B's four]
#include "fp8_gemm_wgmma.cu"
#include "harness.cuh"

#include <cuda_fp8.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace cublade;

namespace {

__global__ void reference_kernel(const __nv_fp8_e4m3* x, const __nv_fp8_e4m3* w, const float* xs, const float* ws,
                                 int M, int N, int K, __nv_bfloat16* out) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x, m = blockIdx.y;
  if (n >= N) return;
  float acc = 0.f;
  for (int k = 0; k < K; ++k)
    acc = __fadd_rn(acc, __fmul_rn(float(x[int64_t(m) * K + k]), float(w[int64_t(n) * K + k])));
  out[int64_t(m) * N + n] = __float2bfloat16_rn(__fmul_rn(__fmul_rn(acc, xs[m]), ws[n]));
}

std::vector<std::pair<int, int>> shapes_arg(int argc, char** argv, int i) {
  if (argc <= i) return {{4096, 6144}, {4096, 4096}, {4096, 28672}, {14336, 4096}};
  std::vector<std::pair<int, int>> v;
  for (const char* p = argv[i]; *p;) {
    char* end;
    const int k = int(std::strtol(p, &end, 10));
    const int n = int(std::strtol(end + 1, &end, 10));
    v.push_back({k, n});
    p = *end ? end + 1 : end;
  }
  return v;
}

std::string plan_name(const Fp8WgmmaPlan& p) {
  return std::to_string(p.rows_split ? 128 : 64) + "r x " + std::to_string(p.rows_split ? p.tokens_per_wg : 2 * p.tokens_per_wg) +
         "t, split " + std::to_string(p.split_k) + (p.two_per_sm ? ", 2 a SM" : "");
}

}  // namespace

int main(int argc, char** argv) {
  harness::Device dev;
  harness::Flushes flush(dev);
  const int reps = harness::reps_arg(argc, argv);
  const std::vector<int> Ms = harness::sizes_arg(argc, argv, 2, {16, 64, 128, 256, 512, 1024});
  const auto shapes = shapes_arg(argc, argv, 3);
  std::printf("device: %s, %d SMs; median us of %d calls, each after a 256 MB read\n\n", dev.prop.name, dev.sms, reps);
  std::printf("| K x N | M | plan | us | weight TB/s | TFLOP/s | mean rel diff | max diff / |ref| | check |\n"
              "|---|---:|---|---:|---:|---:|---:|---:|---|\n");
  bool all_ok = true;
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> uni(0.5f, 1.5f);
  for (auto [K, N] : shapes) {
    const int Mmax = *std::max_element(Ms.begin(), Ms.end());
    std::vector<__nv_fp8_e4m3> hx(size_t(Mmax) * K), hw(size_t(N) * K);
    for (auto& v : hx) v = __nv_fp8_e4m3(normal(rng) * 32.f);
    for (auto& v : hw) v = __nv_fp8_e4m3(normal(rng) * 32.f);
    std::vector<float> hxs(Mmax), hws(N);
    for (auto& v : hxs) v = uni(rng) / 1024.f;
    for (auto& v : hws) v = uni(rng) / 1024.f;
    __nv_fp8_e4m3 *x, *w;
    float *xs, *ws;
    __nv_bfloat16 *out, *ref;
    CK(cudaMalloc(&x, hx.size()));
    CK(cudaMalloc(&w, hw.size()));
    CK(cudaMalloc(&xs, Mmax * 4));
    CK(cudaMalloc(&ws, N * 4));
    CK(cudaMalloc(&out, size_t(Mmax) * N * 2));
    CK(cudaMalloc(&ref, size_t(Mmax) * N * 2));
    CK(cudaMemcpy(x, hx.data(), hx.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(w, hw.data(), hw.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(xs, hxs.data(), Mmax * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(ws, hws.data(), N * 4, cudaMemcpyHostToDevice));
    for (int M : Ms) {
      reference_kernel<<<dim3((N + 127) / 128, M), 128, 0, dev.stream>>>(x, w, xs, ws, M, N, K, ref);
      CK(cudaGetLastError());
      std::vector<__nv_bfloat16> href(size_t(M) * N), hout(size_t(M) * N);
      CK(cudaMemcpyAsync(href.data(), ref, href.size() * 2, cudaMemcpyDeviceToHost, dev.stream));
      CK(cudaStreamSynchronize(dev.stream));
      double mean_ref = 0;
      for (auto v : href) mean_ref += std::fabs(__bfloat162float(v));
      mean_ref /= href.size();

      Fp8WgmmaArgs a;
      a.x = x; a.M = M; a.K = K; a.x_stride = K; a.x_scale = xs; a.x_scale_stride = 1;
      a.w = w; a.w_scale = ws; a.out = out; a.out_stride = N; a.N = N; a.sms = dev.sms;
      const Fp8WgmmaPlan chosen = plan_fp8_wgmma(M, N, K, dev.sms, false);
      std::vector<Fp8WgmmaPlan> plans = {chosen};
      const int per_pass = int(ceil_div(M, ceil_div(M, 256)));  // the launcher's tokens a pass
      for (bool rs : {true, false})
        for (bool two : {false, true})
          for (int sk : {1, 2, 4, 8}) {
            Fp8WgmmaPlan q;
            q.rows_split = rs;
            q.split_k = sk;
            q.two_per_sm = two;
            const int tokens = rs ? per_pass : (per_pass + 1) / 2;
            for (int tw : {256, 192, 128, 96, 64, 48, 32, 16})
              if (tw >= tokens) q.tokens_per_wg = tw;
            if ((q.tokens_per_wg / 2) % sk || (two && (q.tokens_per_wg > 128 || sk > 2))) continue;
            if (rs == chosen.rows_split && q.tokens_per_wg == chosen.tokens_per_wg && sk == chosen.split_k &&
                two == chosen.two_per_sm)
              continue;
            plans.push_back(q);
          }
      for (size_t pi = 0; pi < plans.size(); ++pi) {
        const Fp8WgmmaPlan q = plans[pi];
        CK(cudaMemsetAsync(out, 0xFF, size_t(M) * N * 2, dev.stream));
        CK(launch_fp8_gemm_wgmma(a, &q, dev.stream));
        CK(cudaMemcpyAsync(hout.data(), out, hout.size() * 2, cudaMemcpyDeviceToHost, dev.stream));
        CK(cudaStreamSynchronize(dev.stream));
        double sum = 0, worst = 0;
        for (size_t i = 0; i < hout.size(); ++i) {
          const double d = std::fabs(double(__bfloat162float(hout[i])) - __bfloat162float(href[i]));
          sum += d;
          const double r = std::fabs(double(__bfloat162float(href[i])));
          worst = std::max(worst, d / (r + 1e-3 * mean_ref));
        }
        const double mean_rel = sum / hout.size() / mean_ref;
        const bool ok = mean_rel < 2e-3 && worst < 2e-2;  // a last-bit difference of bf16 is 2^-8 relative
        all_ok &= ok;
        const double us = harness::time_us([&] { return launch_fp8_gemm_wgmma(a, &q, dev.stream); }, flush.read,
                                           reps, dev.stream);
        std::printf("| %dx%d | %d | %s%s | %.1f | %.2f | %.0f | %.1e | %.1e | %s |\n", K, N, M, plan_name(q).c_str(),
                    pi == 0 ? " (plan)" : "", us, double(N) * K / us / 1e6, 2.0 * M * N * K / us / 1e6, mean_rel,
                    worst, ok ? "ok" : "FAIL");
      }
    }
    CK(cudaFree(x)); CK(cudaFree(w)); CK(cudaFree(xs)); CK(cudaFree(ws)); CK(cudaFree(out)); CK(cudaFree(ref));
  }
  return all_ok ? 0 : 1;
}
