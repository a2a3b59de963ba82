// Torch wrapper of the dynamic per-group (1 x 128) FP8 quant: validates the inputs (errors name the op and the bad
// value), allocates the outputs, runs launch_fp8_quant_per_group (fp8_quant_per_group.cu) on the current stream.
// Compiled by the host C++ compiler (docs/kernels.md, "File convention").
#include <ATen/ATen.h>
#include <torch/library.h>

#include "torch_utils.h"

namespace cublade {
namespace {

// x [M, K] -> (q e4m3 [M, K], scale fp32 [M, K/128] with strides (1, M): column-major, as a 1x128 blockwise-scaled
// FP8 GEMM reads it). Rows that are not 16-byte aligned, or a non-unit column stride, are copied first.
std::tuple<at::Tensor, at::Tensor> fp8_quant_per_group(const at::Tensor& x_in) {
  constexpr const char* op = "fp8_quant_per_group";
  CUBLADE_CHECK_VALUE(x_in.dim() == 2, op, "x must be 2-D [M, K], got shape ", shape(x_in.sizes()));
  const InDtype in_dt = in_dtype_of(op, "x", x_in);
  CUBLADE_CHECK_NOT_IMPLEMENTED(in_dt != InDtype::kF32, op, "x must be bfloat16 or float16, got float32");
  check_arch(op, x_in);
  const int64_t M = x_in.size(0), K = x_in.size(1);
  CUBLADE_CHECK_VALUE(K > 0 && K % 128 == 0, op, "K must be a positive multiple of 128, got ", num(K));
  const c10::cuda::CUDAGuard guard(x_in.device());
  const bool fast = x_in.stride(1) == 1 && x_in.stride(0) % 8 == 0 && aligned16(x_in.data_ptr());
  const at::Tensor x = fast ? x_in : x_in.contiguous();
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scale_t = at::empty({K / 128, M}, x.options().dtype(at::kFloat));
  if (M > 0) {
    Fp8QuantPerGroupArgs a;
    a.x = x.data_ptr(); a.dtype = in_dt;
    a.M = M; a.K = K; a.row_stride = x.stride(0);
    a.q = static_cast<uint8_t*>(q.data_ptr()); a.scale = scale_t.data_ptr<float>();
    check_launch(op, launch_fp8_quant_per_group(a, current_stream()));
  }
  return {q, scale_t.t()};
}

}  // namespace

TORCH_LIBRARY_IMPL(cublade, CUDA, m) { m.impl("fp8_quant_per_group", &fp8_quant_per_group); }

}  // namespace cublade
