// Sweep of the production FP4 expert GEMM (plugin/csrc/fp4_gemm.cu on the streaming kernel of w4a16_gemm.cuh) at
// MoE decode: tiles per warp x K slices (consumer warps per CTA) x K splits x ring depth, on Mixtral's expert
// shapes (w13: K 4096 x N 28672, w2: 14336 x 4096; E = 8, top-2) for 1 / 4 / 16 / 64 tokens (T = 2 / 8 / 32 / 128
// rows), one dense expert at M = 1, and a dense 8192 x 28672 (the int4 sweep's shape, same bytes as two w13
// experts) to compare FP4's dequant with int4's. Stand-alone (CUDA runtime only), on the H200:
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I plugin/csrc \
//        benchmarks/tuning/fp4_moe_sweep.cu -o /tmp/fp4_moe_sweep && /tmp/fp4_moe_sweep [reps]
//
// Why: the grouped decode calls of a Mixtral layer read their bytes well below the int4 kernel's rate on the same
// bytes. The sweep asks whether more consumer warps per CTA (K slices) help the small grids of MoE decode (a little,
// on the smallest only), and its timing-only no-dequant policy measures what the dequant costs (docs/decisions.md,
// "FP4 dequant by shifts", with the raw output).
//
// Weights: random FP4 codes, every MXFP4 block scale 2^-7 (bf16 records 2^-7 * 2^126 = 0x7B00; times matched those
// with real scales within 1 us, so the weights' values do not matter). Each row is timed after a 256 MB
// memset (do_bench's flush) and checked against the production launch (rel = mean|C - ref| / mean|ref|; a
// different split count only reorders fp32 sums).
#include "fp4_gemm.cu"
#include "harness.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace {

using bf16 = __nv_bfloat16;
namespace lb = cublade::lowbit;
template <int NT>
using Pol = cublade::Fp4Policy<NT, cublade::kMXFP4>;

// A timing-only policy (its outputs are not checked): the packet's words go to the mma's as they are (the scale
// records still loaded): what the dequant costs (docs/decisions.md, "FP4 dequant by shifts").
template <int NT_>
struct Fp4NoDequant : cublade::Fp4Policy<NT_, cublade::kMXFP4> {
  using Base = cublade::Fp4Policy<NT_, cublade::kMXFP4>;
  using typename Base::State;
  using T = __nv_bfloat16;
  static constexpr int NT = NT_;
  template <int j, int kSliceK>
  __device__ static void packet(State&, const uint4 (&qv)[1], const unsigned char* srec, const uint4 (&xc)[2][NT],
                                float (&acc)[NT][4], int lane) {
    const uint4 q = qv[0];
    using Rec = cublade::Fp4Rec<cublade::kMXFP4>;
    const Rec::type r = Rec::load(srec, j, lane);
    uint32_t a[4][4];
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int i = 0; i < 4; ++i) a[s][i] = w[s] ^ (i == 0 ? r.x : i == 1 ? r.y : 0u);
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      cublade::lowbit::mma_16816<T>(acc[n], a[0], xc[0][n].x, xc[0][n].y);
      cublade::lowbit::mma_16816<T>(acc[n], a[1], xc[0][n].z, xc[0][n].w);
      cublade::lowbit::mma_16816<T>(acc[n], a[2], xc[1][n].x, xc[1][n].y);
      cublade::lowbit::mma_16816<T>(acc[n], a[3], xc[1][n].z, xc[1][n].w);
    }
  }
};

struct Variant { int tpw, ksl; };
constexpr Variant kVariants[] = {{1, 1}, {1, 2}, {1, 4}, {2, 2}, {2, 4}};

template <int NT>
cudaError_t launch_variant(lb::GemmParams p, int E, int S, Variant v, cudaStream_t st) {
  if (v.tpw == 1 && v.ksl == 1) return lb::launch_stream<Pol<NT>, 1, 1>(p, E, S, st);
  if (v.tpw == 1 && v.ksl == 2) return lb::launch_stream<Pol<NT>, 1, 2>(p, E, S, st);
  if (v.tpw == 1 && v.ksl == 4) return lb::launch_stream<Pol<NT>, 1, 4>(p, E, S, st);
  if (v.tpw == 2 && v.ksl == 2) return lb::launch_stream<Pol<NT>, 2, 2>(p, E, S, st);
  if (v.tpw == 2 && v.ksl == 4) return lb::launch_stream<Pol<NT>, 2, 4>(p, E, S, st);
  return cudaErrorInvalidValue;
}
template <int NT>
int occupancy(const lb::GemmParams& p, Variant v, int stages) {
  const lb::Layout L{cublade::kFp4RecordBytes, p.xrows, stages};
  const int smem = L.total(NT, v.ksl);
  if (v.tpw == 1 && v.ksl == 1) return lb::ctas_per_sm<Pol<NT>, 1, 1>(smem);
  if (v.tpw == 1 && v.ksl == 2) return lb::ctas_per_sm<Pol<NT>, 1, 2>(smem);
  if (v.tpw == 1 && v.ksl == 4) return lb::ctas_per_sm<Pol<NT>, 1, 4>(smem);
  if (v.tpw == 2 && v.ksl == 2) return lb::ctas_per_sm<Pol<NT>, 2, 2>(smem);
  return lb::ctas_per_sm<Pol<NT>, 2, 4>(smem);
}

struct Case {
  const char* name;
  int E, K, N;
  std::vector<int> counts;  // rows per expert (E = 1: M)
};

}  // namespace

int main(int argc, char** argv) {
  const int reps = harness::reps_arg(argc, argv);
  const harness::Device device;
  const harness::Flushes flush(device);
  const int sms = device.sms;
  cudaStream_t st = device.stream;
  std::printf("device: %s, %d SMs; median of %d launches after a 256 MB memset; MXFP4\n", device.prop.name, sms,
              reps);
  std::printf("%-22s %5s %3s %3s %2s %6s %7s %8s %6s %s\n", "case", "rows", "tpw", "ksl", "S", "stages", "ctas/SM",
              "us", "TB/s", "check");
  const std::vector<int> t2 = {0, 0, 0, 1, 0, 0, 1, 0}, t8 = {1, 0, 2, 1, 0, 3, 1, 0},
                         t32 = {5, 3, 4, 6, 2, 4, 5, 3}, t128 = {14, 17, 12, 19, 16, 15, 18, 17};
  const std::vector<Case> cases = {
      {"dense 8192x28672", 1, 8192, 28672, {1}},
      {"w13 dense", 1, 4096, 28672, {1}}, {"w2 dense", 1, 14336, 4096, {1}},
      {"w13 T=2", 8, 4096, 28672, t2},    {"w2 T=2", 8, 14336, 4096, t2},
      {"w13 T=8", 8, 4096, 28672, t8},    {"w2 T=8", 8, 14336, 4096, t8},
      {"w13 T=32", 8, 4096, 28672, t32},  {"w2 T=32", 8, 14336, 4096, t32},
      {"w13 T=128", 8, 4096, 28672, t128}, {"w2 T=128", 8, 14336, 4096, t128},
  };
  for (const Case& c : cases) {
    const int groups = (c.N + 63) / 64, chunks = (c.K + 511) / 512, words = 1024 + cublade::kFp4RecordBytes / 4;
    std::vector<int> offs(c.E + 1, 0);
    for (int e = 0; e < c.E; ++e) offs[e + 1] = offs[e] + c.counts[e];
    const int M = offs[c.E], max_m = *std::max_element(c.counts.begin(), c.counts.end());
    int active = 0;
    for (int n : c.counts) active += n > 0;
    std::mt19937 rng(1234);
    std::vector<uint32_t> hblob(size_t(c.E) * groups * chunks * 4 * words);
    for (size_t i = 0; i < hblob.size(); ++i) hblob[i] = (i % words) < 1024 ? rng() : 0x7B007B00u;
    std::vector<bf16> hx(size_t(M) * c.K);
    std::uniform_real_distribution<float> U(-1.0f, 1.0f);
    for (auto& v : hx) v = __float2bfloat16(U(rng));
    void* blob;
    bf16 *x, *out, *ref;
    int* doffs;
    CK(cudaMalloc(&blob, hblob.size() * 4));
    CK(cudaMemcpy(blob, hblob.data(), hblob.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&x, hx.size() * sizeof(bf16)));
    CK(cudaMemcpy(x, hx.data(), hx.size() * sizeof(bf16), cudaMemcpyHostToDevice));
    CK(cudaMalloc(&out, size_t(M) * c.N * sizeof(bf16)));
    CK(cudaMalloc(&ref, size_t(M) * c.N * sizeof(bf16)));
    CK(cudaMalloc(&doffs, offs.size() * sizeof(int)));
    CK(cudaMemcpy(doffs, offs.data(), offs.size() * sizeof(int), cudaMemcpyHostToDevice));
    const int* o = c.E > 1 ? doffs : nullptr;
    const double bytes = double(active) * c.N * c.K * (0.5 + 1.0 / 32);

    auto production = [&] {
      cublade::Fp4GemmArgs a;  // decode sizes: the streaming kernel, no workspace
      a.x = x; a.M = M; a.K = c.K; a.x_stride = c.K; a.offsets = o; a.E = c.E; a.max_m = max_m;
      a.packed = blob; a.fmt = cublade::kMXFP4; a.out = out; a.out_stride = c.N; a.N = c.N; a.sms = sms;
      return cublade::launch_fp4_gemm(a, st);
    };
    CK(production());
    CK(cudaMemcpyAsync(ref, out, size_t(M) * c.N * sizeof(bf16), cudaMemcpyDeviceToDevice, st));
    CK(cudaStreamSynchronize(st));
    std::vector<bf16> hr(size_t(M) * c.N), ho(hr.size());
    CK(cudaMemcpy(hr.data(), ref, hr.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
    const int nt = lb::token_tiles(max_m);
    lb::GemmParams prm = {};
    prm.x = x; prm.x_stride = c.K; prm.M = M; prm.K = c.K; prm.offsets = o;
    prm.w = static_cast<const unsigned char*>(blob);
    prm.tiles = (c.N + 15) / 16; prm.groups = groups; prm.chunks = chunks;
    prm.out = out; prm.out_stride = c.N; prm.N = c.N; prm.sms = sms;
    prm.xrows = std::min(8 * nt, max_m); prm.sbytes = cublade::kFp4RecordBytes;

    auto row = [&](const char* tag, int tpw, int ksl, int S, int stages, int occ,
                   const std::function<cudaError_t()>& f) {
      CK(cudaMemsetAsync(out, 0, size_t(M) * c.N * sizeof(bf16), st));
      CK(f());
      CK(cudaStreamSynchronize(st));
      CK(cudaMemcpy(ho.data(), out, ho.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
      double num = 0, den = 0;
      for (int e = 0; e < c.E; ++e)  // rows outside every expert's range are never written: none here
        for (size_t i = size_t(offs[e]) * c.N; i < size_t(offs[e + 1]) * c.N; ++i) {
          num += std::fabs(double(__bfloat162float(ho[i])) - __bfloat162float(hr[i]));
          den += std::fabs(double(__bfloat162float(hr[i])));
        }
      const double rel = den > 0 ? num / den : num;
      const double us = harness::time_us(f, flush.memset, reps, st);
      auto num_or = [](int v) { return v ? std::to_string(v) : std::string("-"); };
      std::printf("%-22s %5d %3s %3s %2s %6s %7s %8.2f %6.2f %s rel %.1e %s\n", c.name, M, num_or(tpw).c_str(),
                  num_or(ksl).c_str(), num_or(S).c_str(), num_or(stages).c_str(), num_or(occ).c_str(), us,
                  bytes / us * 1e-6, rel <= 2e-3 ? "ok" : "FAIL", rel, tag);
    };
    row("production", 0, 0, 0, 0, 0, production);
    {  // the production choice of splits and ring depth with the timing-only policy
      const int S = lb::pick_split(int64_t(groups) * (o ? std::min(c.E, M) : 1), chunks, sms);
      row("no-dequant (timing only)", 0, 0, S, 0, 0, [&, S] {
        return nt == 1 ? lb::launch_tpw<Fp4NoDequant<1>>(prm, c.E, S, st)
                       : nt == 2 ? lb::launch_tpw<Fp4NoDequant<2>>(prm, c.E, S, st)
                                 : lb::launch_tpw<Fp4NoDequant<4>>(prm, c.E, S, st);
      });
    }
    for (const Variant v : kVariants) {
      if (nt > 1 && v.tpw == 1 && v.ksl == 1) continue;  // NT > 1 runs 2 tiles per warp (default_tpw)
      for (const int S : {1, 2, 4, 8}) {
        if (chunks < S) continue;
        for (const int stages : {2, 3, 4, 6}) {
          const int occ = nt == 1 ? occupancy<1>(prm, v, stages) : nt == 2 ? occupancy<2>(prm, v, stages)
                                                                            : occupancy<4>(prm, v, stages);
          if (occ == 0) continue;
          auto f = [&, v, S, stages] {
            lb::GemmParams p = prm;
            p.stages = stages;
            return nt == 1 ? launch_variant<1>(p, c.E, S, v, st) : nt == 2 ? launch_variant<2>(p, c.E, S, v, st)
                                                                           : launch_variant<4>(p, c.E, S, v, st);
          };
          row("", v.tpw, v.ksl, S, stages, occ, f);
        }
      }
    }
    CK(cudaFree(blob)); CK(cudaFree(x)); CK(cudaFree(out)); CK(cudaFree(ref)); CK(cudaFree(doffs));
  }
  std::printf("done\n");
  return 0;
}
