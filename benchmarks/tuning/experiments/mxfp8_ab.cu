// A/B of the MXFP8 op's automatic choice (launch_mxfp8_gemm) between two source trees, as int4_ab.cu does for int4:
// -I picks which mxfp8_gemm.cu this includes. The thirteenth session compared HEAD before stream-K (b585e28) with the
// tree after it, alternating the two binaries on one H200:
//
//   mkdir -p /tmp/old && git worktree add /tmp/old b585e28
//   N="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I benchmarks/tuning"
//   F=benchmarks/tuning/experiments/mxfp8_ab.cu
//   $N -I /tmp/old/plugin/csrc $F -o /tmp/mab_old && $N -I plugin/csrc $F -o /tmp/mab_new
//   /tmp/mab_old 60 && /tmp/mab_new 60
//
// Weights: random e4m3 codes (no NaN), E8M0 block exponents 120-127; x: every element 0x3C3C. Median us after a 256 MB
// memset.
#include "mxfp8_gemm.cu"
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
    const size_t block = 8448, bytes = size_t((N + 63) / 64) * ((K + 511) / 512) * 4 * block;
    std::vector<unsigned char> hb(bytes);
    std::mt19937 rng(7);
    for (size_t i = 0; i < bytes; ++i)
      hb[i] = i % block < 8192 ? static_cast<unsigned char>(rng() & 0x77) : static_cast<unsigned char>(120 + rng() % 8);
    void *blob, *x, *out, *ws;
    CK(cudaMalloc(&blob, bytes));
    CK(cudaMemcpy(blob, hb.data(), bytes, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&x, size_t(256) * K * 2));
    CK(cudaMemset(x, 0x3C, size_t(256) * K * 2));
    CK(cudaMalloc(&out, size_t(256) * N * 2));
    CK(cudaMalloc(&ws, size_t(K + 512) * 2 * 128 + (16 << 20)));  // x prepped, and stream-K flags and slots
    for (const int M : {1, 16, 17, 32, 48, 64, 96, 128, 256}) {
      auto f = [&] {
        cublade::Mxfp8GemmArgs a;
        a.x = x; a.M = M; a.K = K; a.x_stride = K; a.packed = blob;
        a.out = out; a.out_stride = N; a.N = N; a.workspace = ws; a.sms = device.sms;
        return cublade::launch_mxfp8_gemm(a, st);
      };
      std::printf("%5dx%-5d M=%3d %8.2f us\n", K, N, M, harness::time_us(f, flush.memset, reps, st));
    }
    CK(cudaFree(blob)); CK(cudaFree(x)); CK(cudaFree(out)); CK(cudaFree(ws));
  }
  return 0;
}
