// Framework-free declarations of mxfp8_gemm_sm80.cu's launchers, shared with its torch wrapper
// (mxfp8_gemm_sm80_torch.cpp). The blob: mxfp8_repack's (plugin/ops/mxfp8_gemm.py).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

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
};
cudaError_t launch_mxfp8_gemm_sm80(const Mxfp8GemmSm80Args& a, cudaStream_t stream);

// The dense bf16 weight [N, K] (contiguous) from the blob, bit for bit the weights the GEMM multiplies.
cudaError_t launch_mxfp8_dequant_packed_sm80(const void* packed, int64_t N, int64_t K, void* out, cudaStream_t stream);

// Rows from which the torch op dequantizes the weight once and runs one cuBLAS GEMM instead of the kernel's passes
// (each re-reads the weights). Not yet measured on an sm_80-89 GPU: 64 keeps decode batches on the kernel.
constexpr int64_t kMxfp8Sm80PrefillRows = 64;

}  // namespace sm80
}  // namespace cublade
