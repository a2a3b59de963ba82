// Framework-free declarations of lowbit_gemm_sm80.cu's launchers, shared with its torch wrapper
// (lowbit_gemm_sm80_torch.cpp). The blobs: w4a16_repack's and mxfp8_repack's (plugin/ops/w4a16_gemm.py,
// mxfp8_gemm.py).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "launchers.h"  // InDtype

namespace cublade {
namespace sm80 {

// x: bf16 [M, K] (row stride x_stride, a multiple of 8; 16-byte aligned; K % 32 == 0); packed: the MXFP8 blob
// [ceil(N/64), ceil(K/512), 4, 2048 + 64] (16-byte aligned); row_scale: fp32 [N] or null; out: bf16 [M, N] (row
// stride out_stride). Any M (passes of 8 or 16 rows, each streaming the weights).
struct Mxfp8GemmSm80Args {
  const void* x = nullptr;
  int64_t M = 0, K = 0, x_stride = 0;
  const void* packed = nullptr;
  const float* row_scale = nullptr;
  void* out = nullptr;
  int64_t out_stride = 0, N = 0;
  int tiles = 0;  // 16-row weight tiles per CTA: 1, 2, 4 (where they fit), 0 = the launcher's rule
  int sms = 0;    // the device's multiprocessor count (the rule's input)
};
cudaError_t launch_mxfp8_gemm_sm80(const Mxfp8GemmSm80Args& a, cudaStream_t stream);
// The most tiles per CTA the MXFP8 kernel takes at M rows (two stages of them must fit: 4, or 2 from 9 rows).
int mxfp8_gemm_sm80_max_tiles(int64_t M);

// x: bf16 / fp16 [M, K] (row stride x_stride, a multiple of 8; 16-byte aligned; K % 8 == 0); packed: the int4 blob
// [ceil(N/64), ceil(K/512), 4, 1024 + w4a16_gemm_sbytes / 4] (16-byte aligned); out: x's dtype [M, N].
struct W4a16GemmSm80Args {
  const void* x = nullptr;
  InDtype dtype = InDtype::kBF16;
  int64_t M = 0, K = 0, x_stride = 0;
  const void* packed = nullptr;
  int group_size = 128;  // 32, 64, 128, or -1 (per channel)
  bool asym = false;
  void* out = nullptr;
  int64_t out_stride = 0, N = 0;
  int tiles = 0;  // as Mxfp8GemmSm80Args::tiles
  int sms = 0;    // as Mxfp8GemmSm80Args::sms
};
cudaError_t launch_w4a16_gemm_sm80(const W4a16GemmSm80Args& a, cudaStream_t stream);

// The dense bf16 weight [N, K] (contiguous) from the MXFP8 blob, bit for bit the weights the GEMM multiplies.
cudaError_t launch_mxfp8_dequant_packed_sm80(const void* packed, int64_t N, int64_t K, void* out, cudaStream_t stream,
                                             const float* row_scale = nullptr);

// Weight tiles of 16 rows per CTA when the caller leaves it to the launcher (tiles = 0): the most of 4, 2, 1 (up to
// max_tiles, what two stages fit) that still leave 1.5 CTAs per SM, whatever the rows. The measurements behind it:
// lowbit_gemm_sm80.cu's launch and docs/decisions.md ("Tiles per CTA of the sm_80 kernel").
constexpr int sm80_tiles_per_cta(int64_t N, int max_tiles, int sms) {
  const int64_t n_tiles = (N + 15) / 16;
  for (int t = 4; t > 1; t /= 2)
    if (t <= max_tiles && 2 * ((n_tiles + t - 1) / t) >= 3LL * sms) return t;
  return 1;
}

// Rows from which the torch ops dequantize the weight once and run one cuBLAS GEMM instead of the kernel's passes
// (each re-reads the weights). Not yet measured on an sm_80-89 GPU: 64 keeps decode batches on the kernel.
constexpr int64_t kSm80PrefillRows = 64;

}  // namespace sm80
}  // namespace cublade
