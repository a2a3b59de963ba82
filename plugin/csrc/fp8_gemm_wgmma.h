// Framework-free declarations of fp8_gemm_wgmma.cu's launcher, shared by the kernel (nvcc), its torch wrapper
// (fp8_gemm_wgmma_torch.cpp) and benchmarks/tuning/fp8_wgmma.cu.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace cublade {

struct Fp8WgmmaArgs {
  const void* x = nullptr;  // E4M3 [M, K], rows x_stride bytes apart (a multiple of 16)
  int64_t M = 0, K = 0, x_stride = 0;
  const float* x_scale = nullptr;  // [M] per token (x_scale_stride 1) or one (0)
  int x_scale_stride = 0;
  const void* w = nullptr;          // E4M3 [N, K], contiguous
  const float* w_scale = nullptr;   // [N]
  void* out = nullptr;              // bf16 [M, N], rows out_stride elements apart
  int64_t out_stride = 0, N = 0;
  int sms = 0;
  bool pdl = false;  // a programmatic dependent launch of the stream's previous kernel (which writes x, x_scale)
};

// A launch's tile and K split (fp8_gemm_wgmma.cu says what each means).
struct Fp8WgmmaPlan {
  int tokens_per_wg = 0;  // 16, 32, 48, 64, 96, 128, 192 or 256
  bool rows_split = true;  // two warpgroups of 64 weight rows (else one set of 64 rows, the tokens split)
  int split_k = 1;        // CTAs of a cluster along K: 1, 2, 4 or 8 (dividing tokens_per_wg / 2)
  bool two_per_sm = false;  // a ring half as deep, two CTAs an SM (tokens_per_wg <= 128)
};

// batch_invariant: the same bits at every M (no K split).
Fp8WgmmaPlan plan_fp8_wgmma(int64_t M, int64_t N, int64_t K, int sms, bool batch_invariant);
// forced: a plan to run instead of plan_fp8_wgmma's (the tuning sweep), else nullptr.
cudaError_t launch_fp8_gemm_wgmma(const Fp8WgmmaArgs& a, const Fp8WgmmaPlan* forced, cudaStream_t stream);

}  // namespace cublade
