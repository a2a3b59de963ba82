// The torch side shared by the weight-streaming GEMM ops (w4a16_gemm_torch.cpp, mxfp8_gemm_torch.cpp,
// sm80/lowbit_gemm_sm80_torch.cpp): after an op has
// checked its inputs, the same flow turns x [..., K] into y [..., size_n] in x's dtype; and the int4 blob's check
// and dequant, shared by w4a16_gemm_torch.cpp and w4a16_dequant_torch.cpp. Host compiler only.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "torch_utils.h"
#include "w4a16_gemm.h"

namespace cublade {

// The blob w4a16_repack makes for (N, K, group_size, symmetric): int32 [ceil(N/64), ceil(K/512), 4, 1024 + records].
inline void check_w4a16_packed(const char* op, const at::Tensor& packed, int64_t size_n, int64_t K, int64_t group_size,
                               bool symmetric) {
  const int64_t groups = cdiv(size_n, kLowbitGroupRows), chunks = cdiv(K, kLowbitChunkK);
  const int64_t words = kLowbitTileWords + w4a16_gemm_sbytes(static_cast<int>(group_size), !symmetric) / 4;
  const std::vector<int64_t> want = {groups, chunks, 4, words};
  CUBLADE_CHECK_VALUE(packed.scalar_type() == at::kInt && packed.sizes() == at::IntArrayRef(want) &&
                          packed.is_contiguous(),
                      op, "packed must be a contiguous int32 ", shape(want), " tensor (w4a16_repack of N=",
                      num(size_n), ", K=", num(K), ", group_size=", num(group_size),
                      symmetric ? ", symmetric" : ", asymmetric", "), got ", dt(packed.scalar_type()), " ",
                      shape(packed.sizes()));
}

// The blob mxfp8_repack makes for (N, K): int32 [ceil(N/64), ceil(K/512), 4, 2048 + 64] (mxfp8_gemm_torch.cpp and
// sm80/lowbit_gemm_sm80_torch.cpp).
inline void check_mxfp8_packed(const char* op, const at::Tensor& packed, int64_t size_n, int64_t K) {
  const std::vector<int64_t> want = {cdiv(size_n, kLowbitGroupRows), cdiv(K, kLowbitChunkK), 4,
                                     2 * kLowbitTileWords + kMxfp8RecordBytes / 4};
  CUBLADE_CHECK_VALUE(packed.scalar_type() == at::kInt && packed.sizes() == at::IntArrayRef(want) &&
                          packed.is_contiguous(),
                      op, "packed must be a contiguous int32 ", shape(want), " tensor (mxfp8_repack of N=",
                      num(size_n), ", K=", num(K), "), got ", dt(packed.scalar_type()), " ", shape(packed.sizes()));
}

// The argument checks the GEMM ops of one blob share (Hopper's and the sm_80 library's), in the order of their messages;
// check_gpu(op, x): the op's check of the GPU it runs on. Return K.
template <class CheckGpu>
int64_t check_w4a16_gemm_args(const char* op, const at::Tensor& x, const at::Tensor& packed, int64_t group_size,
                              bool symmetric, int64_t size_n, CheckGpu&& check_gpu) {
  CUBLADE_CHECK_NOT_IMPLEMENTED(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, op,
                                "x must be bfloat16 or float16, got ", dt(x.scalar_type()));
  CUBLADE_CHECK_VALUE(x.dim() >= 1, op, "x must have at least 1 dim, got a 0-dim tensor");
  CUBLADE_CHECK_VALUE(x.is_cuda() && packed.device() == x.device(), op, "x and packed must be on one CUDA device, got ",
                      dev(x.device()), " and ", dev(packed.device()));
  check_gpu(op, x);
  const int64_t K = x.size(-1);
  CUBLADE_CHECK_VALUE(K > 0 && K % 8 == 0, op, "in_features K=", num(K), " must be a positive multiple of 8");
  CUBLADE_CHECK_VALUE(group_size == 32 || group_size == 64 || group_size == 128 || group_size == -1, op,
                      "group_size must be 32, 64, 128 or -1 (per channel), got ", num(group_size));
  CUBLADE_CHECK_VALUE(group_size == -1 || K % group_size == 0, op, "in_features K=", num(K),
                      " is not a multiple of group_size=", num(group_size));
  CUBLADE_CHECK_VALUE(size_n > 0 && size_n <= INT32_MAX, op, "size_n must be in [1, 2^31), got ", num(size_n));
  check_w4a16_packed(op, packed, size_n, K, group_size, symmetric);
  return K;
}
template <class CheckGpu>
int64_t check_mxfp8_gemm_args(const char* op, const at::Tensor& x, const at::Tensor& packed, int64_t size_n,
                              CheckGpu&& check_gpu) {
  CUBLADE_CHECK_NOT_IMPLEMENTED(x.scalar_type() == at::kBFloat16, op,
                                "x must be bfloat16 (the kernel builds bf16 weights), got ", dt(x.scalar_type()));
  CUBLADE_CHECK_VALUE(x.dim() >= 1, op, "x must have at least 1 dim, got a 0-dim tensor");
  CUBLADE_CHECK_VALUE(x.is_cuda() && packed.device() == x.device(), op, "x and packed must be on one CUDA device, got ",
                      dev(x.device()), " and ", dev(packed.device()));
  check_gpu(op, x);
  const int64_t K = x.size(-1);
  CUBLADE_CHECK_VALUE(K > 0 && K % 32 == 0, op, "in_features K=", num(K), " must be a positive multiple of 32");
  CUBLADE_CHECK_VALUE(size_n > 0 && size_n <= INT32_MAX, op, "size_n must be in [1, 2^31), got ", num(size_n));
  check_mxfp8_packed(op, packed, size_n, K);
  return K;
}

// The op w4a16_dequant (w4a16_dequant_torch.cpp): the dense weight [size_n, size_k] in dtype (bf16 / fp16) from
// the int4 blob. w4a16_gemm's prefill path calls it.
at::Tensor w4a16_dequant(const at::Tensor& packed, int64_t group_size, bool symmetric, int64_t size_n, int64_t size_k,
                         at::ScalarType dtype);

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
