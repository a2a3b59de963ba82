// Torch wrappers of the MXFP8 weight GEMM and its dequantize: validate the inputs (errors name the op and the bad
// value, as strings: docs/kernels.md, "Error messages"), allocate the output, run launch_mxfp8_gemm /
// launch_mxfp8_dequant_packed (mxfp8_gemm.cu) on the current stream. Compiled by the host C++ compiler.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "lowbit_torch.h"
#include "torch_utils.h"
#include "w4a16_gemm.h"

namespace cublade {
namespace {

at::Tensor mxfp8_dequant_packed(const at::Tensor& packed_in, int64_t size_n, int64_t size_k);

// From mxfp8_gemm_prefill_rows(N, K) rows (w4a16_gemm.h: 257, 640 or 1024 by the weight's size) the GEMM
// dequantizes the weight once and runs a dense cuBLAS GEMM (the prefill path): the wide kernel re-reads the weights
// every pass (128 rows, 256 from 192 rows left).

at::Tensor mxfp8_gemm(const at::Tensor& x_in, const at::Tensor& packed, int64_t size_n, int64_t split_k) {
  constexpr const char* op = "mxfp8_gemm";
  const int64_t K = check_mxfp8_gemm_args(op, x_in, packed, size_n, check_arch);
  CUBLADE_CHECK_VALUE(split_k >= 0 && split_k <= kLowbitMaxSplit, op, "split_k must be in [0, ",
                      num(kLowbitMaxSplit), "] (0 = automatic; >= 1 forces the streaming kernel), got ",
                      num(split_k));

  return lowbit_gemm(
      op, x_in, size_n, split_k == 0, mxfp8_gemm_prefill_rows(size_n, K),
      [&] { return mxfp8_dequant_packed(packed, size_n, K); },
      [&](int64_t M) { return mxfp8_gemm_workspace_bytes(M, K, static_cast<int>(split_k), sm_count(x_in)); },
      [&](const at::Tensor& x, int64_t M, at::Tensor& out, void* workspace) {
        Mxfp8GemmArgs a;
        a.x = x.data_ptr(); a.M = M; a.K = K; a.x_stride = x.stride(0);
        a.packed = packed.data_ptr();
        a.out = out.data_ptr(); a.out_stride = size_n; a.N = size_n;
        a.split_k = static_cast<int>(split_k); a.workspace = workspace; a.sms = sm_count(x_in);
        return launch_mxfp8_gemm(a, current_stream());
      });
}

// The dense bf16 weight [size_n, size_k] from the blob: the prefill path (dequantize once, then a dense GEMM). The
// output is always contiguous; a misaligned blob view is copied (the kernel reads 16 bytes).
at::Tensor mxfp8_dequant_packed(const at::Tensor& packed_in, int64_t size_n, int64_t size_k) {
  constexpr const char* op = "mxfp8_dequant_packed";
  check_arch(op, packed_in);  // the op dispatches on packed: it is a CUDA tensor here
  CUBLADE_CHECK_VALUE(size_n > 0 && size_n <= INT32_MAX, op, "size_n must be in [1, 2^31), got ", num(size_n));
  CUBLADE_CHECK_VALUE(size_k > 0 && size_k % 32 == 0 && size_k <= INT32_MAX - kLowbitChunkK, op, "size_k=",
                      num(size_k), " must be a positive multiple of 32 below 2^31 - 512");
  check_mxfp8_packed(op, packed_in, size_n, size_k);

  const c10::cuda::CUDAGuard guard(packed_in.device());
  const at::Tensor packed = aligned16(packed_in.data_ptr()) ? packed_in : packed_in.clone();
  at::Tensor out = at::empty({size_n, size_k}, packed.options().dtype(at::kBFloat16));
  Mxfp8DequantPackedArgs a;
  a.packed = packed.data_ptr(); a.N = size_n; a.K = size_k; a.out = out.data_ptr();
  check_launch(op, launch_mxfp8_dequant_packed(a, current_stream()));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(cublade, CUDA, m) {
  m.impl("mxfp8_gemm", &mxfp8_gemm);
  m.impl("mxfp8_dequant_packed", &mxfp8_dequant_packed);
}

}  // namespace cublade
