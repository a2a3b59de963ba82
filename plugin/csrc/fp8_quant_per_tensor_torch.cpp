// Torch wrapper of the per-tensor FP8 quant (dynamic / static): validates the inputs (errors name the op and the
// bad value), allocates the outputs, runs the framework-free launcher from fp8_quant_per_tensor.cu on the current
// stream. Compiled by the host C++ compiler (docs/kernels.md, "File convention").
#include <ATen/ATen.h>
#include <torch/library.h>

#include "torch_utils.h"

namespace cublade {
namespace {

std::tuple<at::Tensor, at::Tensor> fp8_quant_per_tensor(const at::Tensor& x_in, const c10::optional<at::Tensor>& scale) {
  constexpr const char* op = "fp8_quant_per_tensor";
  const InDtype in_dt = in_dtype_of(op, "x", x_in);
  check_arch(op, x_in);
  if (scale.has_value()) check_scale_tensor(op, "scale", *scale, x_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor q = at::empty(x_in.sizes(), x_in.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scale_out = at::empty({1}, x_in.options().dtype(at::kFloat));
  if (x_in.numel() == 0) {
    CUBLADE_CHECK_VALUE(scale.has_value(), op, "dynamic quantization of an empty tensor (shape ", shape(x_in.sizes()),
                        ") has no abs-max to take");
    scale_out.copy_(scale->reshape({1}));
    return {q, scale_out};
  }
  // The kernels see a [M, K] view: flat when x is contiguous, else rows of the last dim.
  const at::Tensor x = x_in.dim() == 0 ? x_in.reshape({1, 1})
                       : x_in.dim() == 2 ? x_in
                       : x_in.is_contiguous() ? x_in.view({1, x_in.numel()})
                                              : x_in.reshape({-1, x_in.size(-1)});
  Fp8QuantPerTensorArgs a;
  a.x = x.data_ptr(); a.dtype = in_dt;
  a.M = x.size(0); a.K = x.size(1); a.row_stride = x.stride(0); a.col_stride = x.stride(1);
  a.q = static_cast<uint8_t*>(q.data_ptr()); a.scale_out = scale_out.data_ptr<float>();
  a.num_sms = sm_count(x_in);
  at::Tensor workspace;
  if (scale.has_value()) {
    a.static_scale = scale->data_ptr<float>();
  } else {
    workspace = at::empty({fp8_quant_per_tensor_workspace_floats(a.num_sms)}, x_in.options().dtype(at::kFloat));
    a.workspace = workspace.data_ptr<float>();
  }
  check_launch(op, launch_fp8_quant_per_tensor(a, current_stream()));
  return {q, scale_out};
}

}  // namespace

TORCH_LIBRARY_IMPL(cublade, CUDA, m) { m.impl("fp8_quant_per_tensor", &fp8_quant_per_tensor); }

}  // namespace cublade
