// Sweep of the FP4 expert GEMM at MoE prefill sizes: the streaming kernel (w4a16_gemm.cuh) against
// the wide (wgmma) kernel (wide_gemm.cuh) for every tokens-per-pass x warpgroups configuration, on Mixtral's expert
// shapes (w13: K 4096 x N 28672, w2: 14336 x 4096; E = 8, top-2) at 32-4096 tokens, routed at random (each token to
// 2 distinct experts, a fixed seed). Stand-alone (CUDA runtime only), on the H200:
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I plugin/csrc \
//        benchmarks/tuning/fp4_wide_sweep.cu -o /tmp/fp4_wide_sweep && /tmp/fp4_wide_sweep [reps [T,T,...]]
//
// Rows: "production" (launch_fp4_gemm's own choice), "streaming" (the streaming kernel as production ran it before
// the wide kernel: tokens per pass from max_m = min(T, ceil(2 T k / E)), automatic splits), then each wide
// configuration (NTOK tokens per pass, WG consumer warpgroups, KS K per stage). Each row is timed after a 256 MB
// memset (do_bench's flush), x prep included, and checked against the production output (rel = mean|C - ref| /
// mean|ref|; the kernels sum fp32 in different orders). Weights: random FP4 codes, every MXFP4 block scale 2^-7.
#include "fp4_gemm.cu"
#include "harness.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <vector>

namespace {

using bf16 = __nv_bfloat16;
namespace lb = cublade::lowbit;
namespace wd = cublade::wide;
using Batch = cublade::Fp4Batch<cublade::kMXFP4>;

struct Config { int ntok, wg, ks; };
constexpr Config kConfigs[] = {{32, 2, 512}, {32, 3, 512}, {32, 4, 512}, {48, 2, 512}, {48, 3, 512},
                               {48, 4, 256}, {64, 2, 512}, {64, 3, 256}, {64, 4, 256}, {96, 2, 256},
                               {96, 3, 256}, {128, 2, 256}, {128, 3, 256}};

cudaError_t launch_config(Config c, const wd::Params& prm, const void* x, int K, void* ws, int sms,
                          cudaStream_t st) {
#define CUBLADE_CONFIG(NT, W, KS_) \
  if (c.ntok == NT && c.wg == W && c.ks == KS_) \
    return wd::launch_kernel<Batch, NT, W, KS_, true>(prm, x, K, K, 0, 0, true, ws, sms, st);
  CUBLADE_CONFIG(32, 2, 512) CUBLADE_CONFIG(32, 3, 512) CUBLADE_CONFIG(32, 4, 512) CUBLADE_CONFIG(48, 2, 512)
  CUBLADE_CONFIG(48, 3, 512) CUBLADE_CONFIG(48, 4, 256) CUBLADE_CONFIG(64, 2, 512) CUBLADE_CONFIG(64, 3, 256)
  CUBLADE_CONFIG(64, 4, 256) CUBLADE_CONFIG(96, 2, 256) CUBLADE_CONFIG(96, 3, 256) CUBLADE_CONFIG(128, 2, 256)
  CUBLADE_CONFIG(128, 3, 256)
#undef CUBLADE_CONFIG
  return cudaErrorInvalidValue;
}

// Rows per expert when T tokens each pick k = 2 distinct experts of E at random.
std::vector<int> route(int T, int E, std::mt19937& rng) {
  std::vector<int> counts(E, 0);
  std::uniform_int_distribution<int> pick(0, E - 1);
  for (int t = 0; t < T; ++t) {
    const int a = pick(rng);
    int b = pick(rng);
    while (b == a) b = pick(rng);
    ++counts[a];
    ++counts[b];
  }
  return counts;
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = harness::reps_arg(argc, argv);
  const harness::Device device;
  const harness::Flushes flush(device);
  const int sms = device.sms;
  cudaStream_t st = device.stream;
  constexpr int E = 8, topk = 2;
  const std::vector<int> tokens = harness::sizes_arg(argc, argv, 2, {32, 64, 128, 256, 512, 1024, 4096});
  std::printf("device: %s, %d SMs; median of %d launches after a 256 MB memset; MXFP4, E = %d, top-%d\n",
              device.prop.name, sms, reps, E, topk);
  std::printf("%-4s %5s %5s %-12s %4s %3s %4s %9s %s\n", "w", "T", "rows", "kernel", "ntok", "wg", "ks", "us",
              "check");
  struct Shape { const char* name; int K, N; };
  for (const Shape sh : {Shape{"w13", 4096, 28672}, Shape{"w2", 14336, 4096}}) {
    const int groups = (sh.N + 63) / 64, chunks = (sh.K + 511) / 512, words = 1024 + cublade::kFp4RecordBytes / 4;
    std::mt19937 rng(1234);
    std::vector<uint32_t> hblob(size_t(E) * groups * chunks * 4 * words);
    for (size_t i = 0; i < hblob.size(); ++i) hblob[i] = (i % words) < 1024 ? rng() : 0x7B007B00u;
    void* blob;
    CK(cudaMalloc(&blob, hblob.size() * 4));
    CK(cudaMemcpy(blob, hblob.data(), hblob.size() * 4, cudaMemcpyHostToDevice));
    for (const int T : tokens) {
      const std::vector<int> counts = route(T, E, rng);
      std::vector<int> offs(E + 1, 0);
      for (int e = 0; e < E; ++e) offs[e + 1] = offs[e] + counts[e];
      const int M = offs[E];
      std::vector<bf16> hx(size_t(M) * sh.K);
      std::uniform_real_distribution<float> U(-1.0f, 1.0f);
      for (auto& v : hx) v = __float2bfloat16(U(rng));
      bf16 *x, *out, *ref;
      int* doffs;
      void* ws;
      const size_t ws_bytes = size_t(wd::workspace_bytes(M, sh.K, 128, true, 0)) + (1 << 20);  // any ntok
      CK(cudaMalloc(&x, hx.size() * sizeof(bf16)));
      CK(cudaMemcpy(x, hx.data(), hx.size() * sizeof(bf16), cudaMemcpyHostToDevice));
      CK(cudaMalloc(&out, size_t(M) * sh.N * sizeof(bf16)));
      CK(cudaMalloc(&ref, size_t(M) * sh.N * sizeof(bf16)));
      CK(cudaMalloc(&ws, ws_bytes));
      CK(cudaMalloc(&doffs, offs.size() * sizeof(int)));
      CK(cudaMemcpy(doffs, offs.data(), offs.size() * sizeof(int), cudaMemcpyHostToDevice));
      const int max_m = std::min(T, (2 * T * topk + E - 1) / E);  // what the MoE method passes

      auto op = [&](int split_k, void* workspace) {  // the production launcher
        cublade::Fp4GemmArgs a;
        a.x = x; a.M = M; a.K = sh.K; a.x_stride = sh.K; a.offsets = doffs; a.E = E; a.max_m = max_m;
        a.packed = blob; a.fmt = cublade::kMXFP4; a.out = out; a.out_stride = sh.N; a.N = sh.N;
        a.split_k = split_k; a.workspace = workspace; a.sms = sms;
        return cublade::launch_fp4_gemm(a, st);
      };
      auto production = [&] { return op(0, ws); };
      CK(production());
      CK(cudaMemcpyAsync(ref, out, size_t(M) * sh.N * sizeof(bf16), cudaMemcpyDeviceToDevice, st));
      CK(cudaStreamSynchronize(st));
      std::vector<bf16> hr(size_t(M) * sh.N), ho(hr.size());
      CK(cudaMemcpy(hr.data(), ref, hr.size() * sizeof(bf16), cudaMemcpyDeviceToHost));

      auto row = [&](const char* kernel, int ntok, int wg, int ks, const std::function<cudaError_t()>& f) {
        CK(cudaMemsetAsync(out, 0, size_t(M) * sh.N * sizeof(bf16), st));
        if (f() != cudaSuccess) {  // does not fit the shared memory
          CK(cudaGetLastError());
          return;
        }
        CK(cudaStreamSynchronize(st));
        CK(cudaMemcpy(ho.data(), out, ho.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
        const double rel = harness::rel_diff(ho, hr);
        const double us = harness::time_us(f, flush.memset, reps, st);
        auto num_or = [](int v) { return v ? std::to_string(v) : std::string("-"); };
        std::printf("%-4s %5d %5d %-12s %4s %3s %4s %9.2f %s rel %.1e\n", sh.name, T, M, kernel, num_or(ntok).c_str(),
                    num_or(wg).c_str(), num_or(ks).c_str(), us, rel <= 2e-3 ? "ok" : "FAIL", rel);
      };
      row("production", cublade::wide_tokens(M, E, true, 0), 0, 0, production);
      row("streaming", 0, 0, 0,
          [&] { return op(lb::pick_split(int64_t(groups) * std::min(E, M), chunks, sms), nullptr); });
      wd::Params prm = {};
      prm.w = static_cast<const unsigned char*>(blob);
      prm.offsets = doffs;
      prm.experts = E;
      prm.M = M; prm.N = sh.N;
      prm.out = out; prm.out_stride = sh.N;
      for (const Config c : kConfigs)
        row("wide", c.ntok, c.wg, c.ks, [&, c] { return launch_config(c, prm, x, sh.K, ws, sms, st); });
      CK(cudaFree(x)); CK(cudaFree(out)); CK(cudaFree(ref)); CK(cudaFree(ws)); CK(cudaFree(doffs));
    }
    CK(cudaFree(blob));
  }
  std::printf("done\n");
  return 0;
}
