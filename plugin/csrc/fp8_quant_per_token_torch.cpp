// Torch wrapper of the dynamic per-token FP8 quant: validates the inputs (errors name the op and the
// bad value), allocates the outputs, runs the framework-free launcher from fp8_quant_per_token.cu on the current
// stream. Compiled by the host C++ compiler (docs/kernels.md, "File convention").
#include <ATen/ATen.h>
#include <torch/library.h>

#include "torch_utils.h"

namespace cublade {
namespace {

// values: the E4M3 bytes, or their values as bf16 / fp16 (fp8_gemm's activations; bf16 x only).
std::tuple<at::Tensor, at::Tensor> quant_per_token(const char* op, const at::Tensor& x_in, Fp8Values values) {
  CUBLADE_CHECK_VALUE(x_in.dim() >= 1, op, "x must have at least 1 dim, got a 0-dim tensor");
  const InDtype in_dt = in_dtype_of(op, "x", x_in);
  CUBLADE_CHECK_NOT_IMPLEMENTED(values == Fp8Values::kCodes || in_dt == InDtype::kBF16, op, "x must be bfloat16, got ",
                                dt(x_in.scalar_type()));
  check_arch(op, x_in);
  const int64_t K = x_in.size(-1);
  CUBLADE_CHECK_VALUE(K >= 1, op, "x's last dim must be >= 1, got shape ", shape(x_in.sizes()));
  const c10::cuda::CUDAGuard guard(x_in.device());
  // [..., K] -> [M, K]; a view when the leading dims collapse (always for 2-D), else a copy.
  const at::Tensor x = x_in.dim() == 2 ? x_in : x_in.reshape({-1, K});
  const int64_t M = x.size(0);
  const auto q_dtype = values == Fp8Values::kBF16 ? at::kBFloat16
                       : values == Fp8Values::kF16 ? at::kHalf : at::kFloat8_e4m3fn;
  at::Tensor q = at::empty(x_in.sizes(), x_in.options().dtype(q_dtype));
  std::vector<int64_t> scale_shape(x_in.sizes().begin(), x_in.sizes().end());
  scale_shape.back() = 1;
  at::Tensor scale = at::empty(scale_shape, x_in.options().dtype(at::kFloat));
  if (M == 0) return {q, scale};
  Fp8QuantPerTokenArgs a;
  a.x = x.data_ptr(); a.dtype = in_dt;
  a.M = M; a.K = K; a.row_stride = x.stride(0); a.col_stride = x.stride(1);
  a.q = static_cast<uint8_t*>(q.data_ptr()); a.scale = scale.data_ptr<float>(); a.values = values;
  check_launch(op, launch_fp8_quant_per_token(a, current_stream()));
  return {q, scale};
}

std::tuple<at::Tensor, at::Tensor> fp8_quant_per_token(const at::Tensor& x) {
  return quant_per_token("fp8_quant_per_token", x, Fp8Values::kCodes);
}
std::tuple<at::Tensor, at::Tensor> fp8_quant_per_token_bf16(const at::Tensor& x) {
  return quant_per_token("fp8_quant_per_token_bf16", x, Fp8Values::kBF16);
}
std::tuple<at::Tensor, at::Tensor> fp8_quant_per_token_f16(const at::Tensor& x) {
  return quant_per_token("fp8_quant_per_token_f16", x, Fp8Values::kF16);
}

}  // namespace

TORCH_LIBRARY_IMPL(cublade, CUDA, m) {
  m.impl("fp8_quant_per_token", &fp8_quant_per_token);
  m.impl("fp8_quant_per_token_bf16", &fp8_quant_per_token_bf16);
  m.impl("fp8_quant_per_token_f16", &fp8_quant_per_token_f16);
}

}  // namespace cublade
