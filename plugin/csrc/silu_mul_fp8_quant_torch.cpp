// Torch wrapper of the fused SiLU-and-mul + FP8 quantization: validates the inputs (errors name the op and the bad
// value), allocates the outputs, runs the framework-free launcher from silu_mul_fp8_quant.cu on the current stream.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "torch_utils.h"

namespace cublade {
namespace {

// (q [..., K], scale [..., 1] per token or the static scale's value [1]) for x [..., 2K] = gate | up.
std::tuple<at::Tensor, at::Tensor> silu_mul_fp8_quant(const at::Tensor& x_in, const c10::optional<at::Tensor>& scale) {
  const char* op = "silu_mul_fp8_quant";
  CUBLADE_CHECK_VALUE(x_in.dim() >= 1, op, "x must have at least 1 dim, got a 0-dim tensor");
  const InDtype in_dt = in_dtype_of(op, "x", x_in);
  CUBLADE_CHECK_NOT_IMPLEMENTED(in_dt != InDtype::kF32, op, "x must be bfloat16 or float16, got ",
                                dt(x_in.scalar_type()));
  check_arch(op, x_in);
  const int64_t K2 = x_in.size(-1), K = K2 / 2;
  CUBLADE_CHECK_VALUE(K2 % 16 == 0 && K >= 8 && K <= kSiluMulFp8QuantMaxK, op,
                      "x's last dim (gate | up) must be a multiple of 16 from 16 to ", num(2 * kSiluMulFp8QuantMaxK),
                      ", got shape ", shape(x_in.sizes()));
  if (scale.has_value()) check_scale_tensor(op, "scale", *scale, x_in);
  const c10::cuda::CUDAGuard guard(x_in.device());

  const at::Tensor x = with_16byte_rows(x_in.dim() == 2 ? x_in : x_in.reshape({-1, K2}));
  std::vector<int64_t> q_shape(x_in.sizes().begin(), x_in.sizes().end());
  q_shape.back() = K;
  std::vector<int64_t> scale_shape = q_shape;
  scale_shape.back() = 1;
  at::Tensor q = at::empty(q_shape, x_in.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scale_out = scale.has_value() ? at::empty({1}, x_in.options().dtype(at::kFloat))
                                           : at::empty(scale_shape, x_in.options().dtype(at::kFloat));
  if (x.size(0) == 0) {
    if (scale.has_value()) scale_out.copy_(scale->reshape({1}));
    return {q, scale_out};
  }
  SiluMulFp8QuantArgs a;
  a.x = x.data_ptr(); a.dtype = in_dt;
  a.M = x.size(0); a.K = K; a.x_row_stride = x.stride(0);
  if (scale.has_value()) a.static_scale = scale->data_ptr<float>();
  a.q = static_cast<uint8_t*>(q.data_ptr()); a.scale = scale_out.data_ptr<float>();
  a.num_sms = sm_count(x_in);
  check_launch(op, launch_silu_mul_fp8_quant(a, current_stream()));
  return {q, scale_out};
}

}  // namespace

TORCH_LIBRARY_IMPL(cublade, CUDA, m) {
  m.impl("silu_mul_fp8_quant", &silu_mul_fp8_quant);
}

}  // namespace cublade
