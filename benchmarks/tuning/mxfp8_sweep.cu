// Configuration sweep of cublade's MXFP8 GEMM (plugin/csrc/mxfp8_gemm.cu), which reuses the int4 kernels' schedules
// (w4a16_gemm.cuh, wide_gemm.cuh) with 1024-byte packets: twice the shared memory per stage, so their rules (ring
// depth, splits, tiles per warp, the wide kernel's stage K and warpgroups) may not carry over. On three Llama-70B-like
// shapes (K x N: 8192x28672, 4096x14336, 28672x8192):
//   * the streaming kernel at M = 1 / 8 / 16: tiles per warp x K slices x splits x ring depth, and the plain read of
//     the same bytes (the floor of any kernel that reads them, after the same flush);
//   * the wide kernel at M = 32 / 64 / 128: warpgroups x stage K x splits.
// Every row is checked against the production choice (mean|C - ref| / mean|ref| <= 2e-3). Times: median us of
// launches after a 256 MB memset (triton do_bench's flush). Stand-alone (CUDA runtime only), on the H200:
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I plugin/csrc -I benchmarks/tuning \
//        benchmarks/tuning/mxfp8_sweep.cu -o /tmp/mxfp8_sweep && /tmp/mxfp8_sweep
#define CUBLADE_LOWBIT_ALL_TPW  // every tiles-per-warp / K-slice choice, not only the production one
#include "mxfp8_gemm.cu"
#include "harness.cuh"

#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace {

using bf16 = __nv_bfloat16;
namespace lb = cublade::lowbit;
namespace wd = cublade::wide;

template <int NT>
int ctas_per_sm(int M, int stages, int tpw, int ksl) {
  using P = cublade::Mxfp8Policy<NT>;
  const lb::LayoutOf<1024> L{cublade::kMxfp8RecordBytes, std::min(8 * NT, M), stages};
  const int smem = L.total(NT, ksl);
  if (tpw == 1 && ksl == 1) return lb::ctas_per_sm<P, 1, 1>(smem);
  if (tpw == 2 && ksl == 2) return lb::ctas_per_sm<P, 2, 2>(smem);
  if (tpw == 4 && ksl == 4) return lb::ctas_per_sm<P, 4, 4>(smem);
  if (tpw == 1 && ksl == 2) return lb::ctas_per_sm<P, 1, 2>(smem);
  if (tpw == 1 && ksl == 4) return lb::ctas_per_sm<P, 1, 4>(smem);
  return lb::ctas_per_sm<P, 2, 4>(smem);
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = harness::reps_arg(argc, argv);
  const harness::Device device;
  const harness::Flushes flush(device);
  const int sms = device.sms;
  cudaStream_t st = device.stream;
  std::printf("device: %s, %d SMs; median us of %d launches after a 256 MB memset\n", device.prop.name, sms, reps);
  std::printf("%-11s %4s %-34s %9s %6s %s\n", "KxN", "M", "config", "us", "TB/s", "check");
  for (const auto& sh : std::vector<std::pair<int, int>>{{8192, 28672}, {4096, 14336}, {28672, 8192}}) {
    const int K = sh.first, N = sh.second, max_m = 128;
    const int groups = (N + 63) / 64, chunks = (K + 511) / 512;
    const size_t block = 8448, bytes_blob = size_t(groups) * chunks * 4 * block;
    std::vector<unsigned char> hb(bytes_blob);
    std::mt19937 rng(7);
    for (size_t i = 0; i < bytes_blob; ++i) {
      const size_t in = i % block;
      hb[i] = in < 8192 ? static_cast<unsigned char>(rng() & 0x77) : static_cast<unsigned char>(120 + rng() % 8);
    }
    void *blob, *x, *out, *ref, *ws;
    CK(cudaMalloc(&blob, bytes_blob));
    CK(cudaMemcpy(blob, hb.data(), bytes_blob, cudaMemcpyHostToDevice));
    std::vector<bf16> hx(size_t(max_m) * K);
    for (auto& v : hx) v = __float2bfloat16(float(int(rng() % 200) - 100) / 64.0f);
    CK(cudaMalloc(&x, hx.size() * 2));
    CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&out, size_t(max_m) * N * 2));
    CK(cudaMalloc(&ref, size_t(max_m) * N * 2));
    CK(cudaMalloc(&ws, cublade::mxfp8_gemm_workspace_bytes(max_m, K, 0, sms) + 16));
    const double bytes = double(N) * K * (1.0 + 1.0 / 32);
    unsigned* sink;
    CK(cudaMalloc(&sink, 4));
    auto plain = [&] {
      harness::plain_read<<<4 * sms, 512, 0, st>>>(static_cast<const uint4*>(blob), bytes_blob / 16, sink);
      return cudaGetLastError();
    };
    const double pr = harness::time_us(plain, flush.memset, reps, st);
    std::printf("%5dx%-5d %4s %-34s %9.2f %6.2f\n", K, N, "-", "plain read of the blob", pr, bytes / pr * 1e-6);

    for (const int M : {1, 8, 16, 32, 64, 128}) {
      std::vector<bf16> hr(size_t(M) * N), ho(size_t(M) * N);
      auto production = [&] {
        cublade::Mxfp8GemmArgs a;
        a.x = x; a.M = M; a.K = K; a.x_stride = K; a.packed = blob;
        a.out = out; a.out_stride = N; a.N = N; a.workspace = ws; a.sms = sms;
        return cublade::launch_mxfp8_gemm(a, st);
      };
      CK(production());
      CK(cudaStreamSynchronize(st));
      CK(cudaMemcpy(hr.data(), out, hr.size() * 2, cudaMemcpyDeviceToHost));
      auto row = [&](const std::string& name, const std::function<cudaError_t()>& f) {
        CK(cudaMemsetAsync(out, 0, size_t(M) * N * 2, st));
        const cudaError_t e = f();
        if (e != cudaSuccess) {
          std::printf("%5dx%-5d %4d %-34s   (launch: %s)\n", K, N, M, name.c_str(), cudaGetErrorString(e));
          cudaGetLastError();
          return;
        }
        CK(cudaStreamSynchronize(st));
        CK(cudaMemcpy(ho.data(), out, ho.size() * 2, cudaMemcpyDeviceToHost));
        const double rel = harness::rel_diff(ho, hr);
        const double us = harness::time_us(f, flush.memset, reps, st);
        std::printf("%5dx%-5d %4d %-34s %9.2f %6.2f %s rel %.1e\n", K, N, M, name.c_str(), us, bytes / us * 1e-6,
                    rel <= 2e-3 ? "ok" : "FAIL", rel);
      };
      row("production", production);
      if (M <= 16) {
        lb::GemmParams prm = {};
        prm.x = x; prm.x_stride = K; prm.M = M; prm.K = K; prm.w = static_cast<const unsigned char*>(blob);
        prm.tiles = (N + 15) / 16; prm.groups = groups; prm.chunks = chunks;
        prm.out = out; prm.out_stride = N; prm.N = N; prm.sms = sms; prm.sbytes = cublade::kMxfp8RecordBytes;
        const int nt = lb::token_tiles(M);
        prm.xrows = std::min(8 * nt, M);
        const std::pair<int, int> tk[] = {{1, 1}, {2, 2}, {1, 2}, {1, 4}, {2, 4}, {4, 4}};
        for (const auto& c : tk)
          for (const int S : {1, 2, 4})
            for (int stages = 2; stages <= 4; ++stages) {
              const int occ = nt == 1 ? ctas_per_sm<1>(M, stages, c.first, c.second)
                                      : ctas_per_sm<2>(M, stages, c.first, c.second);
              if (occ == 0 || chunks < 2 * S) continue;
              lb::GemmParams p = prm;
              p.tpw = c.first; p.ksl = c.second; p.stages = stages;
              char name[64];
              std::snprintf(name, sizeof name, "stream tpw %d ksl %d S %d st %d (%d/SM)", c.first, c.second, S, stages,
                            occ);
              row(name, [&, p, S, nt] {
                return nt == 1 ? lb::launch_tpw<cublade::Mxfp8Policy<1>>(p, 1, S, st)
                               : lb::launch_tpw<cublade::Mxfp8Policy<2>>(p, 1, S, st);
              });
            }
      } else {
        wd::Params prm = {};
        prm.w = static_cast<const unsigned char*>(blob);
        prm.M = M; prm.N = N; prm.out = out; prm.out_stride = N;
        auto wide = [&](auto cfg, int S) {
          using C = decltype(cfg);
          char name[64];
          std::snprintf(name, sizeof name, "wide %d tok WG %d KS %d S %d", C::kTokens, C::kWarpgroups, C::kStageK, S);
          row(name, [&, S] {
            return wd::launch_kernel<cublade::Mxfp8Batch, C::kTokens, C::kWarpgroups, C::kStageK, false>(
                prm, x, K, K, S, 0, true, ws, sms, st);
          });
        };
        for (const int S : {0, 1, 2, wd::kStreamKSplit}) {  // 0: the rule's pick; -1: stream-K
          if (M == 32) {
            wide(wd::PassConfig<32, 2, 256>{}, S); wide(wd::PassConfig<32, 4, 256>{}, S);
            wide(wd::PassConfig<32, 2, 512>{}, S);
          } else if (M == 64) {
            wide(wd::PassConfig<64, 2, 256>{}, S); wide(wd::PassConfig<64, 4, 256>{}, S);
          } else {
            wide(wd::PassConfig<128, 2, 256>{}, S);
          }
        }
      }
    }
    CK(cudaFree(blob)); CK(cudaFree(x)); CK(cudaFree(out)); CK(cudaFree(ref)); CK(cudaFree(ws)); CK(cudaFree(sink));
  }
  std::printf("done\n");
  return 0;
}
