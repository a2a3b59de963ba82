// Torch wrapper of the W4A16 GEMM: validates the inputs (errors name the op and the bad value, as strings:
// README.md, "Error messages"), allocates the output, runs launch_w4a16_gemm (w4a16_gemm.cu) on the current
// stream. Compiled by the host C++ compiler.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "torch_utils.h"
#include "w4a16_gemm.h"

namespace cublade {
namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

at::Tensor w4a16_gemm(const at::Tensor& x_in, const at::Tensor& packed, int64_t group_size, bool symmetric,
                      int64_t size_n, int64_t split_k) {
  constexpr const char* op = "w4a16_gemm";
  CUBLADE_CHECK_NOT_IMPLEMENTED(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kHalf, op,
                                "x must be bfloat16 or float16, got ", dt(x_in.scalar_type()));
  CUBLADE_CHECK_VALUE(x_in.dim() >= 1, op, "x must have at least 1 dim, got a 0-dim tensor");
  CUBLADE_CHECK_VALUE(x_in.is_cuda() && packed.device() == x_in.device(), op,
                      "x and packed must be on one CUDA device, got ", dev(x_in.device()), " and ",
                      dev(packed.device()));
  check_arch(op, x_in);
  const int64_t K = x_in.size(-1);
  CUBLADE_CHECK_VALUE(K > 0 && K % 8 == 0, op, "in_features K=", num(K), " must be a positive multiple of 8");
  CUBLADE_CHECK_VALUE(group_size == 32 || group_size == 64 || group_size == 128 || group_size == -1, op,
                      "group_size must be 32, 64, 128 or -1 (per channel), got ", num(group_size));
  CUBLADE_CHECK_VALUE(group_size == -1 || K % group_size == 0, op, "in_features K=", num(K),
                      " is not a multiple of group_size=", num(group_size));
  CUBLADE_CHECK_VALUE(size_n > 0 && size_n <= INT32_MAX, op, "size_n must be in [1, 2^31), got ", num(size_n));
  CUBLADE_CHECK_VALUE(split_k >= 0 && split_k <= kLowbitMaxSplit, op, "split_k must be in [0, ",
                      num(kLowbitMaxSplit), "] (0 = automatic), got ", num(split_k));
  const int64_t groups = cdiv(size_n, kLowbitGroupRows), chunks = cdiv(K, kLowbitChunkK);
  const int64_t words = kLowbitTileWords + w4a16_gemm_sbytes(static_cast<int>(group_size), !symmetric) / 4;
  const std::vector<int64_t> want = {groups, chunks, 4, words};
  CUBLADE_CHECK_VALUE(packed.scalar_type() == at::kInt && packed.sizes() == at::IntArrayRef(want) &&
                          packed.is_contiguous(),
                      op, "packed must be a contiguous int32 ", shape(want), " tensor (w4a16_repack of N=",
                      num(size_n), ", K=", num(K), ", group_size=", num(group_size),
                      symmetric ? ", symmetric" : ", asymmetric", "), got ", dt(packed.scalar_type()), " ",
                      shape(packed.sizes()));

  const c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor x = x_in.reshape({-1, K});
  // The bulk copies read 16-byte aligned rows along K: unit column stride, 16-byte aligned rows.
  if (x.stride(1) != 1 || x.stride(0) % 8 != 0 || !aligned16(x.data_ptr())) x = x.contiguous();
  if (!aligned16(x.data_ptr())) x = x.clone();
  const int64_t M = x.size(0);
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = size_n;
  at::Tensor out = at::empty(out_shape, x_in.options());
  if (M == 0) return out;
  CUBLADE_CHECK_VALUE(M <= INT32_MAX, op, "x has ", num(M), " rows; at most 2^31 - 1");
  check_launch(op, launch_w4a16_gemm(x.data_ptr(), in_dtype_of(op, "x", x), M, K, x.stride(0), packed.data_ptr(),
                                     static_cast<int>(group_size), !symmetric, out.data_ptr(), size_n, size_n,
                                     static_cast<int>(split_k), sm_count(x_in), current_stream()));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(cublade, CUDA, m) { m.impl("w4a16_gemm", &w4a16_gemm); }

}  // namespace cublade
