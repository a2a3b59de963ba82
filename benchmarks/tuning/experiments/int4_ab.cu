// A/B of the int4 op's automatic choice (launch_w4a16_gemm) between two source trees: -I picks which w4a16_gemm.cu
// this includes. The tenth session compared the tree before the wide kernel moved into wide_gemm.cuh (8a6a062) with
// the tree after it, alternating the two binaries on one H200 (raw benchmarks/runs/2026-11-23-0335-*):
//
//   mkdir -p /tmp/old && for f in w4a16_gemm.cu w4a16_gemm.cuh w4a16_gemm.h wgmma.cuh common.cuh launchers.h; do
//     git show 8a6a062:plugin/csrc/$f > /tmp/old/$f; done
//   N="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I benchmarks/tuning"
//   F=benchmarks/tuning/experiments/int4_ab.cu
//   $N -I /tmp/old $F -o /tmp/ab_old && $N -I plugin/csrc $F -o /tmp/ab_new && /tmp/ab_old 60 && /tmp/ab_new 60
//
// Weights: random codes, every g128 scale 1.0 (bf16 0x3C00); x: every element 0x3C3C. Median us after a 256 MB memset.
#include "w4a16_gemm.cu"
#include "harness.cuh"

#include <cstdio>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  const int reps = harness::reps_arg(argc, argv);
  const harness::Device device;
  const harness::Flushes flush(device);
  cudaStream_t st = device.stream;
  const std::vector<std::pair<int, int>> shapes = {{8192, 28672}, {4096, 14336}, {28672, 8192}, {8192, 10240}};
  for (const auto& sh : shapes) {
    const int K = sh.first, N = sh.second;
    const int sb = cublade::w4a16_gemm_sbytes(128, false);
    const size_t words = size_t((N + 63) / 64) * ((K + 511) / 512) * 4 * (1024 + sb / 4);
    std::vector<uint32_t> hb(words);
    std::mt19937 rng(7);
    for (auto& w : hb) w = rng();
    for (size_t i = 0; i < words; ++i) if (i % (1024 + sb / 4) >= 1024) hb[i] = 0x3C003C00u;
    void *blob, *x, *out, *ws;
    CK(cudaMalloc(&blob, words * 4));
    CK(cudaMemcpy(blob, hb.data(), words * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&x, size_t(256) * K * 2));
    CK(cudaMemset(x, 0x3C, size_t(256) * K * 2));
    CK(cudaMalloc(&out, size_t(256) * N * 2));
    CK(cudaMalloc(&ws, size_t(K + 512) * 2 * 128 + (16 << 20)));  // x prepped, and stream-K flags and slots
    for (const int M : {1, 16, 17, 32, 40, 48, 64, 80, 96, 128, 160, 200, 256}) {
      auto f = [&] {
        cublade::W4a16GemmArgs a;
        a.x = x; a.M = M; a.K = K; a.x_stride = K; a.packed = blob; a.group_size = 128;
        a.out = out; a.out_stride = N; a.N = N; a.workspace = ws; a.sms = device.sms;
        return cublade::launch_w4a16_gemm(a, st);
      };
      std::printf("%5dx%-5d M=%3d %8.2f us\n", K, N, M, harness::time_us(f, flush.memset, reps, st));
    }
    CK(cudaFree(blob)); CK(cudaFree(x)); CK(cudaFree(out)); CK(cudaFree(ws));
  }
  return 0;
}
