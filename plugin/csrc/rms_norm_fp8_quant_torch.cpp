// Torch wrapper of the fused RMSNorm + FP8 quantization: validates the inputs (errors name the op and the bad value),
// allocates the outputs, runs the framework-free launcher from rms_norm_fp8_quant.cu on the current stream.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "torch_utils.h"

namespace cublade {
namespace {

// (q, scale, residual_out); residual_out is undefined without a residual.
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_quant(const char* op, const at::Tensor& x_in,
                                                          const c10::optional<at::Tensor>& residual,
                                                          const at::Tensor& weight, double eps,
                                                          const c10::optional<at::Tensor>& scale) {
  CUBLADE_CHECK_VALUE(x_in.dim() >= 1, op, "x must have at least 1 dim, got a 0-dim tensor");
  const InDtype in_dt = in_dtype_of(op, "x", x_in);
  CUBLADE_CHECK_NOT_IMPLEMENTED(in_dt != InDtype::kF32, op, "x must be bfloat16 or float16, got ",
                                dt(x_in.scalar_type()));
  check_arch(op, x_in);
  const int64_t K = x_in.size(-1);
  CUBLADE_CHECK_VALUE(K % 8 == 0 && K >= 8 && K <= kRmsNormFp8QuantMaxK, op,
                      "x's last dim must be a multiple of 8 from 8 to ", num(kRmsNormFp8QuantMaxK), ", got shape ",
                      shape(x_in.sizes()));
  CUBLADE_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == K, op, "weight must have shape [", num(K), "], got ",
                      shape(weight.sizes()));
  CUBLADE_CHECK_VALUE(weight.scalar_type() == x_in.scalar_type(), op, "weight must be ", dt(x_in.scalar_type()),
                      " as x is, got ", dt(weight.scalar_type()));
  CUBLADE_CHECK_VALUE(weight.device() == x_in.device(), op, "weight must be on ", dev(x_in.device()), ", got ",
                      dev(weight.device()));
  if (residual.has_value()) {
    CUBLADE_CHECK_VALUE(residual->sizes() == x_in.sizes(), op, "residual must have x's shape ", shape(x_in.sizes()),
                        ", got ", shape(residual->sizes()));
    CUBLADE_CHECK_VALUE(residual->scalar_type() == x_in.scalar_type(), op, "residual must be ",
                        dt(x_in.scalar_type()), " as x is, got ", dt(residual->scalar_type()));
    CUBLADE_CHECK_VALUE(residual->device() == x_in.device(), op, "residual must be on ", dev(x_in.device()),
                        ", got ", dev(residual->device()));
  }
  if (scale.has_value()) check_scale_tensor(op, "scale", *scale, x_in);
  const c10::cuda::CUDAGuard guard(x_in.device());

  const at::Tensor x = with_16byte_rows(x_in.dim() == 2 ? x_in : x_in.reshape({-1, K}));
  const at::Tensor w = weight.contiguous();
  at::Tensor q = at::empty(x_in.sizes(), x_in.options().dtype(at::kFloat8_e4m3fn));
  std::vector<int64_t> scale_shape(x_in.sizes().begin(), x_in.sizes().end());
  scale_shape.back() = 1;
  at::Tensor scale_out = scale.has_value() ? at::empty({1}, x_in.options().dtype(at::kFloat))
                                           : at::empty(scale_shape, x_in.options().dtype(at::kFloat));
  at::Tensor res, res_out;
  if (residual.has_value()) {
    res = residual->contiguous();
    res_out = at::empty(x_in.sizes(), x_in.options());
  }
  if (x.size(0) == 0) {
    if (scale.has_value()) scale_out.copy_(scale->reshape({1}));
    return {q, scale_out, res_out};
  }
  RmsNormFp8QuantArgs a;
  a.x = x.data_ptr(); a.dtype = in_dt;
  a.M = x.size(0); a.K = K; a.x_row_stride = x.stride(0);
  a.weight = w.data_ptr(); a.eps = static_cast<float>(eps);
  if (residual.has_value()) a.residual = res.data_ptr(), a.residual_out = res_out.data_ptr();
  if (scale.has_value()) a.static_scale = scale->data_ptr<float>();
  a.q = static_cast<uint8_t*>(q.data_ptr()); a.scale = scale_out.data_ptr<float>();
  check_launch(op, launch_rms_norm_fp8_quant(a, current_stream()));
  return {q, scale_out, res_out};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fp8_quant(const at::Tensor& x, const at::Tensor& weight, double eps,
                                                      const c10::optional<at::Tensor>& scale) {
  auto [q, s, r] = norm_quant("rms_norm_fp8_quant", x, c10::nullopt, weight, eps, scale);
  return {q, s};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_fp8_quant(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
    const c10::optional<at::Tensor>& scale) {
  return norm_quant("fused_add_rms_norm_fp8_quant", x, residual, weight, eps, scale);
}

}  // namespace

TORCH_LIBRARY_IMPL(cublade, CUDA, m) {
  m.impl("rms_norm_fp8_quant", &rms_norm_fp8_quant);
  m.impl("fused_add_rms_norm_fp8_quant", &fused_add_rms_norm_fp8_quant);
}

}  // namespace cublade
