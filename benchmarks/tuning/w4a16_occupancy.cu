// Occupancy sweep of the production W4A16 kernel (plugin/csrc/w4a16_gemm.cu): tiles per consumer warp x K splits x
// ring depth, on four Llama-70B-like shapes (K x N: 8192x28672, 4096x14336, 28672x8192, 8192x10240), M = 1..64, and
// how the L2 flush before each launch changes the time. Stand-alone (CUDA runtime only), on the H200:
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I plugin/csrc -I benchmarks/tuning \
//        benchmarks/tuning/w4a16_occupancy.cu -o /tmp/w4a16_occupancy && /tmp/w4a16_occupancy [REPS [SHAPES [ROWS]]]
//   (SHAPES: K x N pairs, e.g. 4096x6144,4096x4096; ROWS: e.g. 1,4,16)
//
// Why: the streaming kernel's speed depends on how many CTAs share an SM (its shared memory per CTA grows with the
// ring depth and the token rows), and a fixed ring depth or split count left SMs short of consumer warps on some
// shapes. This sweep times every (tiles per warp, splits, stages) triple with the CTAs per SM it gives, to pick the
// rules from data (pick_split, pick_stages, default_tpw; docs/decisions.md, "W4A16 streaming kernel").
//
// Flush: triton's do_bench (the benches' method) zeroes a 256 MB buffer before each call, which leaves L2 full of
// dirty lines that the timed kernel must write back while it reads its weights. Each configuration is timed
// twice: after a 256 MB memset (do_bench's way) and after a 256 MB read (L2 holds clean lines, as after the
// previous layer's GEMM in a decode step). Weights: random codes, every scale 2^-7 (timing only; the outputs of
// every configuration are compared with the automatic one: same stages -> identical, other splits -> close).
#define CUBLADE_LOWBIT_ALL_TPW  // every tiles-per-warp choice, not only the production one
#define CUBLADE_W4A16_ONE_TU  // the wide kernel's instantiations in this program too (w4a16_gemm_wide.cuh)
#include "w4a16_gemm.cu"
#include "harness.cuh"
#include "int4_problem.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>


namespace {

using bf16 = __nv_bfloat16;
constexpr int kGS = 128;

// CTAs per SM the launch gets (0: does not fit), as the production launcher computes it.
template <int NT, int TPW>
int ctas_per_sm(const cublade::lowbit::GemmParams& prm, int stages) {
  using P = cublade::Int4Policy<bf16, NT, kGS, false>;
  const cublade::lowbit::Layout L{cublade::int4_sbytes<kGS, false>(), std::min(8 * NT, prm.M), stages};
  return cublade::lowbit::ctas_per_sm<P, TPW>(L.total(NT, TPW));
}
template <int NT>
int ctas_per_sm(const cublade::lowbit::GemmParams& prm, int stages, int tpw) {
  return tpw == 1 ? ctas_per_sm<NT, 1>(prm, stages) : tpw == 2 ? ctas_per_sm<NT, 2>(prm, stages)
                                                                : ctas_per_sm<NT, 4>(prm, stages);
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = harness::reps_arg(argc, argv);
  const harness::Device device;
  const harness::Flushes flush(device);
  const int sms = device.sms;
  cudaStream_t st = device.stream;
  std::printf("device: %s, %d SMs, L2 %d MB; median of %d launches; us_memset: after a 256 MB memset (do_bench's "
              "flush), us_read: after a 256 MB read\n", device.prop.name, sms, device.prop.l2CacheSize >> 20, reps);
  std::printf("%-11s %3s %3s %2s %6s %7s %9s %7s %9s %7s %s\n", "KxN", "M", "tpw", "S", "stages", "ctas/SM",
              "us_memset", "TB/s", "us_read", "TB/s", "check");

  // argv[2]: shapes as K x N pairs (e.g. 4096x6144,4096x4096), argv[3]: rows (e.g. 1,16); else the defaults
  const std::vector<int> kn = harness::sizes_arg(argc, argv, 2, {8192, 28672, 4096, 14336, 28672, 8192, 8192, 10240});
  const std::vector<int> ms = harness::sizes_arg(argc, argv, 3, {1, 2, 4, 8, 16, 32, 64});
  for (size_t s = 0; s + 1 < kn.size(); s += 2) {
    const int K = kn[s], N = kn[s + 1], max_m = *std::max_element(ms.begin(), ms.end());
    std::mt19937 rng(1234);
    const Int4Problem pb(K, N, max_m, rng, [](std::mt19937&) { return 0x3C003C00u; });  // scales: bf16 2^-7 pairs
    const int groups = pb.groups, chunks = pb.chunks;
    const double bytes = pb.bytes;
    void *blob = pb.blob, *ws = pb.ws;  // ws: the production choice runs the wide kernel from 17 rows
    bf16 *x = pb.x, *out = pb.out, *ref;
    CK(cudaMalloc(&ref, size_t(max_m) * N * sizeof(bf16)));
    for (const int M : ms) {
      cublade::lowbit::GemmParams prm = {};
      prm.x = x; prm.x_stride = K; prm.M = M; prm.K = K; prm.w = static_cast<const unsigned char*>(blob);
      prm.tiles = (N + 15) / 16; prm.groups = groups; prm.chunks = chunks;
      prm.out = out; prm.out_stride = N; prm.N = N;
      const int nt = cublade::lowbit::token_tiles(M);
      auto launch = [&](int tpw, int S, int stages) {  // the production launch with tiles/warp and ring depth given
        cublade::lowbit::GemmParams p = prm;
        p.stages = stages;
        p.tpw = tpw;
        return cublade::launch_nt<bf16, kGS, false>(p, S, st);
      };
      auto occ = [&](int tpw, int stages) {
        return nt == 1 ? ctas_per_sm<1>(prm, stages, tpw) : nt == 2 ? ctas_per_sm<2>(prm, stages, tpw)
                                                                    : ctas_per_sm<4>(prm, stages, tpw);
      };
      // the production choice, as the op makes it
      auto production = [&] {
        cublade::W4a16GemmArgs a;
        a.x = x; a.M = M; a.K = K; a.x_stride = K; a.packed = blob; a.group_size = kGS;
        a.out = out; a.out_stride = N; a.N = N; a.workspace = ws; a.sms = sms;
        return cublade::launch_w4a16_gemm(a, st);
      };
      CK(production());
      CK(cudaMemcpyAsync(ref, out, size_t(M) * N * sizeof(bf16), cudaMemcpyDeviceToDevice, st));
      CK(cudaStreamSynchronize(st));
      std::vector<bf16> hr(size_t(M) * N), ho(size_t(M) * N);
      CK(cudaMemcpy(hr.data(), ref, hr.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
      auto row = [&](int tpw, int S, int stages, const std::function<cudaError_t()>& f) {
        CK(cudaMemsetAsync(out, 0, size_t(M) * N * sizeof(bf16), st));
        CK(f());
        CK(cudaStreamSynchronize(st));
        CK(cudaMemcpy(ho.data(), out, ho.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
        const double rel = harness::rel_diff(ho, hr);
        const double a = harness::time_us(f, flush.memset, reps, st), b = harness::time_us(f, flush.read, reps, st);
        std::printf("%5dx%-5d %3d %3s %2s %6s %7s %9.2f %7.2f %9.2f %7.2f %s rel %.1e\n", K, N, M,
                    tpw ? std::to_string(tpw).c_str() : "-", S ? std::to_string(S).c_str() : "-",
                    stages ? std::to_string(stages).c_str() : "-",
                    stages ? std::to_string(occ(tpw, stages)).c_str() : "-", a, bytes / a * 1e-6, b,
                    bytes / b * 1e-6, rel <= 2e-3 ? "ok" : "FAIL", rel);
      };
      row(0, 0, 0, production);
      for (const int tpw : {1, 2, 4})
        for (const int S : {1, 2, 4})
          for (int stages = 2; stages <= 6; ++stages) {
            if (occ(tpw, stages) == 0) continue;
            if (chunks < 2 * S) continue;
            row(tpw, S, stages, [&, tpw, S, stages] { return launch(tpw, S, stages); });
          }
    }
    CK(cudaFree(ref));
  }
  std::printf("done\n");
  return 0;
}
