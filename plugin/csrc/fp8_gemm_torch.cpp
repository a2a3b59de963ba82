// Torch wrappers of the FP8 W8A8 decode GEMM, its plain form (fp8_gemm: x holds quantized values) and its dynamic form
// (fp8_gemm_dynamic: x is the bf16 activations): validate the inputs (errors name the op and the bad value, as
// strings: docs/kernels.md, "Error messages"), allocate the output, run launch_fp8_gemm (fp8_gemm.cu) on the current
// stream.
// Compiled by the host C++ compiler.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <vector>

#include "torch_utils.h"
#include "w4a16_gemm.h"

namespace cublade {
namespace {

// The checks both forms make of the weight, its scales and split_k against x [..., K].
void check_weight(const char* op, const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& weight_scale,
                  int64_t split_k) {
  CUBLADE_CHECK_VALUE(x_in.dim() >= 1, op, "x must have at least 1 dim, got a 0-dim tensor");
  CUBLADE_CHECK_VALUE(x_in.is_cuda() && weight.device() == x_in.device(), op,
                      "x and weight must be on one CUDA device, got ", dev(x_in.device()), " and ",
                      dev(weight.device()));
  check_arch(op, x_in);
  const int64_t K = x_in.size(-1);
  CUBLADE_CHECK_VALUE(weight.scalar_type() == at::kFloat8_e4m3fn && weight.dim() == 2 && weight.is_contiguous(), op,
                      "weight must be a contiguous float8_e4m3fn [N, K] tensor, got ", dt(weight.scalar_type()), " ",
                      shape(weight.sizes()), weight.is_contiguous() ? "" : " (not contiguous)");
  const int64_t N = weight.size(0);
  CUBLADE_CHECK_VALUE(weight.size(1) == K, op, "weight has K=", num(weight.size(1)), ", x has K=", num(K));
  CUBLADE_CHECK_VALUE(K > 0 && K % 16 == 0 && K <= INT32_MAX - kLowbitChunkK, op, "in_features K=", num(K),
                      " must be a positive multiple of 16");
  CUBLADE_CHECK_VALUE(N > 0 && N <= INT32_MAX, op, "weight must have 1 to 2^31 - 1 rows, got ", num(N));
  CUBLADE_CHECK_VALUE(aligned16(weight.data_ptr()), op, "weight must be 16-byte aligned");
  CUBLADE_CHECK_VALUE(split_k >= 0 && split_k <= kLowbitMaxSplit, op, "split_k must be in [0, ",
                      num(kLowbitMaxSplit), "] (0 = automatic), got ", num(split_k));
  CUBLADE_CHECK_VALUE(weight_scale.scalar_type() == at::kFloat && weight_scale.numel() == N &&
                          weight_scale.device() == x_in.device(),
                      op, "weight_scale must be float32 with one element per output channel (", num(N), ") on ",
                      dev(x_in.device()), ", got ", dt(weight_scale.scalar_type()), " ", shape(weight_scale.sizes()));
}

// The launch's arguments for x [M, K] (16-byte rows) but the output's.
Fp8GemmArgs gemm_args(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                      int64_t split_k) {
  Fp8GemmArgs a;
  a.x = x.data_ptr(); a.M = x.size(0); a.K = x.size(1); a.x_stride = x.stride(0);
  a.w = weight.data_ptr(); a.w_scale = weight_scale.data_ptr<float>();
  a.N = weight.size(0);
  a.split_k = static_cast<int>(split_k); a.sms = sm_count(x);
  return a;
}

// The bf16 output [..., N] for x [..., K], its rows N apart.
at::Tensor new_output(const at::Tensor& x_in, Fp8GemmArgs& a) {
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = a.N;
  at::Tensor out = at::empty(out_shape, x_in.options().dtype(at::kBFloat16));
  a.out = out.data_ptr(); a.out_stride = a.N;
  return out;
}

at::Tensor fp8_gemm(const at::Tensor& x_in, const at::Tensor& x_scale_in, const at::Tensor& weight,
                    const at::Tensor& weight_scale_in, int64_t split_k) {
  constexpr const char* op = "fp8_gemm";
  const bool x_f16 = x_in.scalar_type() == at::kHalf;
  CUBLADE_CHECK_NOT_IMPLEMENTED(x_f16 || x_in.scalar_type() == at::kBFloat16, op,
                                "x must be bfloat16 or float16 (E4M3 values from fp8_quant_per_token_bf16 / _f16), "
                                "got ",
                                dt(x_in.scalar_type()));
  check_weight(op, x_in, weight, weight_scale_in, split_k);
  const int64_t K = x_in.size(-1);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = with_16byte_rows(x_in.reshape({-1, K}));  // the bulk copies read 16-byte rows along K
  const int64_t M = x.size(0);
  CUBLADE_CHECK_VALUE(M <= INT32_MAX, op, "x has ", num(M), " rows; at most 2^31 - 1");
  CUBLADE_CHECK_VALUE(x_scale_in.scalar_type() == at::kFloat && (x_scale_in.numel() == M || x_scale_in.numel() == 1) &&
                          x_scale_in.device() == x_in.device(),
                      op, "x_scale must be float32 with one element per row of x (", num(M), ") or one, on ",
                      dev(x_in.device()), ", got ", dt(x_scale_in.scalar_type()), " ", shape(x_scale_in.sizes()));
  const at::Tensor x_scale = x_scale_in.contiguous(), weight_scale = weight_scale_in.contiguous();
  Fp8GemmArgs a = gemm_args(x, weight, weight_scale, split_k);
  at::Tensor out = new_output(x_in, a);
  if (M == 0) return out;
  a.x_f16 = x_f16;
  a.x_scale = x_scale.data_ptr<float>(); a.x_scale_stride = x_scale.numel() == M && M > 1 ? 1 : 0;
  check_launch(op, launch_fp8_gemm(a, current_stream()));
  return out;
}

// The dynamic form: bf16 activations, quantized per token inside the GEMM where the kernel can
// (fp8_gemm_quantizes_inside), else by fp8_quant_per_token_f16 before the plain form: the same numbers either way.
at::Tensor fp8_gemm_dynamic(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& weight_scale_in,
                            int64_t split_k) {
  constexpr const char* op = "fp8_gemm_dynamic";
  CUBLADE_CHECK_NOT_IMPLEMENTED(x_in.scalar_type() == at::kBFloat16, op, "x must be bfloat16 (the activations), got ",
                                dt(x_in.scalar_type()));
  check_weight(op, x_in, weight, weight_scale_in, split_k);
  const int64_t K = x_in.size(-1);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = with_16byte_rows(x_in.reshape({-1, K}));
  const at::Tensor weight_scale = weight_scale_in.contiguous();
  Fp8GemmArgs a = gemm_args(x, weight, weight_scale, split_k);
  a.quant_x = true;
  if (x.size(0) == 0 || fp8_gemm_quantizes_inside(a)) {
    at::Tensor out = new_output(x_in, a);
    if (x.size(0) > 0) check_launch(op, launch_fp8_gemm(a, current_stream()));
    return out;
  }
  static const auto quant = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("cublade::fp8_quant_per_token_f16", "")
                                .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&)>();
  const auto [xv, xs] = quant.call(x);
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = a.N;
  return fp8_gemm(xv, xs, weight, weight_scale, split_k).reshape(out_shape);
}

}  // namespace

TORCH_LIBRARY_IMPL(cublade, CUDA, m) {
  m.impl("fp8_gemm", &fp8_gemm);
  m.impl("fp8_gemm_dynamic", &fp8_gemm_dynamic);
}

}  // namespace cublade
