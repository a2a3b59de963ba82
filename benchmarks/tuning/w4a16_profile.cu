// A profiler target: the production W4A16 kernel (K x N, default 8192x28672; int4 g128 sym, bf16) at the M given,
// launched a few times with the L2 flushed between launches, for Nsight Compute on the H200:
//
//   nvcc -std=c++17 -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a -I plugin/csrc \
//        benchmarks/tuning/w4a16_profile.cu -o /tmp/w4a16_profile
//   ncu -k regex:stream_gemm --launch-skip 2 --launch-count 1 --set full /tmp/w4a16_profile 32 [K N]
//
// Why: the occupancy and pipeline sweeps say what the time is, not where it goes (docs/kernels.md).
#define CUBLADE_W4A16_ONE_TU  // the wide kernel's instantiations in this program too (w4a16_gemm_wide.cuh)
#include "w4a16_gemm.cu"
#include "harness.cuh"

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  const int M = argc > 1 ? std::atoi(argv[1]) : 1;
  const int K = argc > 2 ? std::atoi(argv[2]) : 8192, N = argc > 3 ? std::atoi(argv[3]) : 28672, kGS = 128;
  const harness::Device device;
  const harness::Flushes flush(device);
  const size_t blob_bytes = size_t((N + 63) / 64) * (K / 512) * 4 * (4096 + cublade::int4_sbytes<kGS, false>());
  void *blob, *x, *out;
  CK(cudaMalloc(&blob, blob_bytes));
  CK(cudaMemset(blob, 0x11, blob_bytes));
  CK(cudaMalloc(&x, size_t(M) * K * 2));
  CK(cudaMemset(x, 0, size_t(M) * K * 2));
  CK(cudaMalloc(&out, size_t(M) * N * 2));
  void* ws = nullptr;  // the wide kernel's (from 17 rows)
  if (const size_t b = cublade::w4a16_gemm_workspace_bytes(M, K, N, kGS, 0, device.sms)) CK(cudaMalloc(&ws, b));
  cublade::W4a16GemmArgs a;
  a.x = x; a.M = M; a.K = K; a.x_stride = K; a.packed = blob; a.group_size = kGS;
  a.out = out; a.out_stride = N; a.N = N; a.workspace = ws; a.sms = device.sms;
  for (int i = 0; i < 5; ++i) {
    flush.memset();
    CK(cublade::launch_w4a16_gemm(a, device.stream));
  }
  CK(cudaStreamSynchronize(device.stream));
  std::printf("M=%d: 5 launches done\n", M);
  return 0;
}
