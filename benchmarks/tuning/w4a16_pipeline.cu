// Where the W4A16 kernel's time goes at M = 1: the production kernel against (a) the same copy pipeline with no
// math (a policy that ignores its packets: bulk copies, mbarriers, ring, as production) and (b) a plain read of
// the same bytes (grid-stride 16-byte loads, the DRAM read ceiling in this run). Stand-alone, on the H200:
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I plugin/csrc \
//        benchmarks/tuning/w4a16_pipeline.cu -o /tmp/w4a16_pipeline && /tmp/w4a16_pipeline
//
// Add -DCUBLADE_WEIGHT_POLICY=policy_evict_normal to time the weights' copies without the evict-first hint.
// Why: the occupancy sweep (w4a16_occupancy.cu) showed that neither more consumer warps per SM nor more tiles per
// warp (fewer shared-memory reads, independent mma chains) moves M = 1 below ~44 us on 8192x28672; if the
// pipeline alone takes as long, the copies, not the math, are what to change.
#define CUBLADE_LOWBIT_ALL_TPW
#define CUBLADE_W4A16_ONE_TU  // the wide kernel's instantiations in this program too (w4a16_gemm_wide.cuh)
#include "w4a16_gemm.cu"
#include "harness.cuh"
#include "null_policy.cuh"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

namespace {

using bf16 = __nv_bfloat16;
constexpr int kGS = 128;

}  // namespace

int main(int argc, char** argv) {
  const int reps = harness::reps_arg(argc, argv);
  const harness::Device device;
  const harness::Flushes flush(device);
  const int sms = device.sms;
  cudaStream_t st = device.stream;
#define STR2(x) #x
#define STR(x) STR2(x)
  std::printf("weight policy: %s; median of %d launches; us_memset / us_read: after a 256 MB memset / read\n",
              STR(CUBLADE_WEIGHT_POLICY), reps);
  std::printf("%-11s %-28s %9s %7s %9s %7s\n", "KxN", "variant", "us_memset", "TB/s", "us_read", "TB/s");
  struct Shape { int K, N; };
  for (const Shape sh : {Shape{8192, 28672}, Shape{4096, 14336}}) {
    const int K = sh.K, N = sh.N, groups = (N + 63) / 64, chunks = (K + 511) / 512;
    const int sbytes = cublade::int4_sbytes<kGS, false>();
    const size_t blob_bytes = size_t(groups) * chunks * 4 * (4096 + sbytes);
    void* blob;
    bf16 *x, *out;
    CK(cudaMalloc(&blob, blob_bytes));
    CK(cudaMemset(blob, 0x11, blob_bytes));
    CK(cudaMalloc(&x, size_t(K) * sizeof(bf16)));
    CK(cudaMemset(x, 0, size_t(K) * sizeof(bf16)));
    CK(cudaMalloc(&out, size_t(N) * sizeof(bf16)));
    const double bytes = double(blob_bytes);
    auto row = [&](const char* name, const std::function<cudaError_t()>& f) {
      const double a = harness::time_us(f, flush.memset, reps, st), b = harness::time_us(f, flush.read, reps, st);
      std::printf("%5dx%-5d %-28s %9.2f %7.2f %9.2f %7.2f\n", K, N, name, a, bytes / a * 1e-6, b, bytes / b * 1e-6);
    };
    cublade::lowbit::GemmParams prm = {};
    prm.x = x; prm.x_stride = K; prm.M = 1; prm.K = K; prm.w = static_cast<const unsigned char*>(blob);
    prm.tiles = (N + 15) / 16; prm.groups = groups; prm.chunks = chunks;
    prm.out = out; prm.out_stride = N; prm.N = N; prm.sms = sms;
    row("production M=1", [&] {
      cublade::W4a16GemmArgs a;
      a.x = x; a.M = 1; a.K = K; a.x_stride = K; a.packed = blob; a.group_size = kGS;
      a.out = out; a.out_stride = N; a.N = N; a.sms = sms;
      return cublade::launch_w4a16_gemm(a, st);
    });
    for (int stages = 2; stages <= 8; ++stages) {
      char name[64];
      std::snprintf(name, sizeof name, "pipeline only, %d stages", stages);
      row(name, [&, stages] {
        cublade::lowbit::GemmParams p = prm;
        p.xrows = 1; p.sbytes = sbytes; p.stages = stages;
        return cublade::lowbit::launch_stream<NullPolicy, 1>(p, 1, 1, st);
      });
    }
    for (const int blocks : {2, 4, 8}) {
      char name[64];
      std::snprintf(name, sizeof name, "plain read, %d CTAs/SM x 512", blocks);
      row(name, [&, blocks] {
        harness::plain_read<<<blocks * sms, 512, 0, st>>>(static_cast<const uint4*>(blob), blob_bytes / 16,
                                                          flush.sink);
        return cudaGetLastError();
      });
    }
    CK(cudaFree(blob)); CK(cudaFree(x)); CK(cudaFree(out));
  }
  std::printf("done\n");
  return 0;
}
