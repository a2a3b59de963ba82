// Torch wrapper of MXFP8 quant and dequant: validates the inputs (errors name the op and the
// bad value), allocates the outputs, runs the framework-free launcher from mxfp8_quant.cu on the current
// stream. Compiled by the host C++ compiler (docs/kernels.md, "File convention").
#include <ATen/ATen.h>
#include <torch/library.h>

#include "torch_utils.h"

namespace cublade {
namespace {

// [..., K] -> [M, K] view (or copy when the leading dims do not collapse).
at::Tensor as_2d(const at::Tensor& t) { return t.dim() == 2 ? t : t.reshape({-1, t.size(-1)}); }

std::tuple<at::Tensor, at::Tensor> mxfp8_quant(const at::Tensor& x_in, bool rceil) {
  constexpr const char* op = "mxfp8_quant";
  CUBLADE_CHECK_VALUE(x_in.dim() >= 1, op, "x must have at least 1 dim, got a 0-dim tensor");
  const InDtype in_dt = in_dtype_of(op, "x", x_in);
  check_arch(op, x_in);
  const int64_t K = x_in.size(-1);
  CUBLADE_CHECK_VALUE(K % 32 == 0, op, "last dim K=", num(K), " is not a multiple of the MX block size 32 (shape ",
                      shape(x_in.sizes()), ")");
  const c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor q = at::empty(x_in.sizes(), x_in.options().dtype(at::kFloat8_e4m3fn));
  std::vector<int64_t> cshape(x_in.sizes().begin(), x_in.sizes().end());
  cshape.back() = K / 32;
  at::Tensor codes = at::empty(cshape, x_in.options().dtype(at::kByte));
  if (x_in.numel() == 0) return {q, codes};
  const at::Tensor x = as_2d(x_in);
  Mxfp8QuantArgs a;
  a.x = x.data_ptr(); a.dtype = in_dt;
  a.M = x.size(0); a.K = K; a.row_stride = x.stride(0); a.col_stride = x.stride(1);
  a.rceil = rceil;
  a.q = static_cast<uint8_t*>(q.data_ptr()); a.codes = codes.data_ptr<uint8_t>();
  check_launch(op, launch_mxfp8_quant(a, current_stream()));
  return {q, codes};
}

at::Tensor mxfp8_dequant(const at::Tensor& q_in, const at::Tensor& codes_in, at::ScalarType dtype) {
  constexpr const char* op = "mxfp8_dequant";
  CUBLADE_CHECK_VALUE(q_in.dim() >= 1, op, "q must have at least 1 dim, got a 0-dim tensor");
  CUBLADE_CHECK_NOT_IMPLEMENTED(q_in.scalar_type() == at::kFloat8_e4m3fn || q_in.scalar_type() == at::kByte, op,
                                "q must be float8_e4m3fn (or its uint8 bytes), got ", dt(q_in.scalar_type()));
  CUBLADE_CHECK_NOT_IMPLEMENTED(codes_in.scalar_type() == at::kByte, op, "codes must be uint8 E8M0, got ",
                                dt(codes_in.scalar_type()));
  int out_dt;
  switch (dtype) {
    case at::kBFloat16: out_dt = 0; break;
    case at::kHalf: out_dt = 1; break;
    case at::kFloat: out_dt = 2; break;
    default: CUBLADE_CHECK_NOT_IMPLEMENTED(false, op, "dtype must be bfloat16, float16 or float32, got ", dt(dtype));
  }
  check_arch(op, q_in);
  const int64_t K = q_in.size(-1);
  CUBLADE_CHECK_VALUE(K % 32 == 0, op, "last dim K=", num(K), " is not a multiple of the MX block size 32");
  std::vector<int64_t> cshape(q_in.sizes().begin(), q_in.sizes().end());
  cshape.back() = K / 32;
  CUBLADE_CHECK_VALUE(codes_in.sizes().vec() == cshape, op, "codes must have shape ", shape(cshape),
                      " for q of shape ", shape(q_in.sizes()), ", got ", shape(codes_in.sizes()));
  CUBLADE_CHECK_VALUE(codes_in.device() == q_in.device(), op, "codes must be on ", dev(q_in.device()), ", got ",
                      dev(codes_in.device()));
  const c10::cuda::CUDAGuard guard(q_in.device());
  at::Tensor out = at::empty(q_in.sizes(), q_in.options().dtype(dtype));
  if (q_in.numel() == 0) return out;
  const at::Tensor q = as_2d(q_in), codes = as_2d(codes_in);
  Mxfp8DequantArgs a;
  a.q = static_cast<const uint8_t*>(q.data_ptr()); a.q_row_stride = q.stride(0); a.q_col_stride = q.stride(1);
  a.codes = codes.data_ptr<uint8_t>(); a.codes_row_stride = codes.stride(0); a.codes_col_stride = codes.stride(1);
  a.M = q.size(0); a.K = K;
  a.out_dtype = out_dt; a.out = out.data_ptr();
  check_launch(op, launch_mxfp8_dequant(a, current_stream()));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(cublade, CUDA, m) {
  m.impl("mxfp8_quant", &mxfp8_quant);
  m.impl("mxfp8_dequant", &mxfp8_dequant);
}

}  // namespace cublade
