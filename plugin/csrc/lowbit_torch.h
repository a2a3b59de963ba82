// The torch side shared by the weight-streaming GEMM ops (w4a16_gemm_torch.cpp, mxfp8_gemm_torch.cpp): after an op has
// checked its inputs, the same flow turns x [..., K] into y [..., size_n] in x's dtype. Host compiler only.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "torch_utils.h"

namespace cublade {

// y = x @ W^T. With `prefill` (the op is not forced onto its kernels) and at least `prefill_rows` rows: W = dequant()
// (the dense weight [size_n, K] in x's dtype) and one cuBLAS GEMM. Else launch(x2d, M, out, workspace) on the op's
// kernels, x2d [M, K] with 16-byte rows, workspace: workspace_bytes(M) bytes (null when 0; the caching allocator makes
// the allocation cheap).
template <class Dequant, class WorkspaceBytes, class Launch>
at::Tensor lowbit_gemm(const char* op, const at::Tensor& x_in, int64_t size_n, bool prefill, int64_t prefill_rows,
                       Dequant&& dequant, WorkspaceBytes&& workspace_bytes, Launch&& launch) {
  const int64_t K = x_in.size(-1);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = with_16byte_rows(x_in.reshape({-1, K}));  // the bulk copies read 16-byte rows along K
  const int64_t M = x.size(0);
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = size_n;
  at::Tensor out = at::empty(out_shape, x_in.options());
  if (M == 0) return out;
  if (prefill && M >= prefill_rows) {
    at::Tensor out2d = out.view({M, size_n});
    at::mm_out(out2d, x, dequant().t());
    return out;
  }
  CUBLADE_CHECK_VALUE(M <= INT32_MAX, op, "x has ", num(M), " rows; at most 2^31 - 1");
  const size_t bytes = workspace_bytes(M);
  at::Tensor workspace;
  if (bytes > 0) workspace = at::empty({static_cast<int64_t>(bytes)}, x.options().dtype(at::kByte));
  check_launch(op, launch(x, M, out, bytes > 0 ? workspace.data_ptr() : nullptr));
  return out;
}

}  // namespace cublade
