// Torch wrapper of the FP8 W8A8 decode GEMM: validates the inputs (errors name the op and the bad value, as strings:
// docs/kernels.md, "Error messages"), allocates the output, runs launch_fp8_gemm (fp8_gemm.cu) on the current stream.
// Compiled by the host C++ compiler.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "torch_utils.h"
#include "w4a16_gemm.h"

namespace cublade {
namespace {

at::Tensor fp8_gemm(const at::Tensor& x_in, const at::Tensor& x_scale_in, const at::Tensor& weight,
                    const at::Tensor& weight_scale_in, int64_t split_k) {
  constexpr const char* op = "fp8_gemm";
  const bool x_f16 = x_in.scalar_type() == at::kHalf;
  CUBLADE_CHECK_NOT_IMPLEMENTED(x_f16 || x_in.scalar_type() == at::kBFloat16, op,
                                "x must be bfloat16 or float16 (E4M3 values from fp8_quant_per_token_bf16 / _f16), "
                                "got ",
                                dt(x_in.scalar_type()));
  CUBLADE_CHECK_VALUE(x_in.dim() >= 1, op, "x must have at least 1 dim, got a 0-dim tensor");
  CUBLADE_CHECK_VALUE(x_in.is_cuda() && weight.device() == x_in.device(), op,
                      "x and weight must be on one CUDA device, got ", dev(x_in.device()), " and ",
                      dev(weight.device()));
  check_arch(op, x_in);
  const int64_t K = x_in.size(-1);
  CUBLADE_CHECK_VALUE(K > 0 && K % 16 == 0 && K <= INT32_MAX - kLowbitChunkK, op, "in_features K=", num(K),
                      " must be a positive multiple of 16");
  const int64_t N = check_fp8_weight(op, weight, weight_scale_in, K, x_in);
  CUBLADE_CHECK_VALUE(split_k >= 0 && split_k <= kLowbitMaxSplit, op, "split_k must be in [0, ",
                      num(kLowbitMaxSplit), "] (0 = automatic), got ", num(split_k));

  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = with_16byte_rows(x_in.reshape({-1, K}));  // the bulk copies read 16-byte rows along K
  const int64_t M = x.size(0);
  CUBLADE_CHECK_VALUE(M <= INT32_MAX, op, "x has ", num(M), " rows; at most 2^31 - 1");
  check_row_scale(op, x_scale_in, M, x_in);
  const at::Tensor x_scale = x_scale_in.contiguous(), weight_scale = weight_scale_in.contiguous();
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = N;
  at::Tensor out = at::empty(out_shape, x_in.options().dtype(at::kBFloat16));
  if (M == 0) return out;
  Fp8GemmArgs a;
  a.x = x.data_ptr(); a.x_f16 = x_f16; a.M = M; a.K = K; a.x_stride = x.stride(0);
  a.x_scale = x_scale.data_ptr<float>(); a.x_scale_stride = x_scale.numel() == M && M > 1 ? 1 : 0;
  a.w = weight.data_ptr(); a.w_scale = weight_scale.data_ptr<float>();
  a.out = out.data_ptr(); a.out_stride = N; a.N = N;
  a.split_k = static_cast<int>(split_k); a.sms = sm_count(x_in);
  check_launch(op, launch_fp8_gemm(a, current_stream()));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(cublade, CUDA, m) { m.impl("fp8_gemm", &fp8_gemm); }

}  // namespace cublade
