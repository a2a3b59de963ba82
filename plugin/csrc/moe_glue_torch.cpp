// Torch wrappers of the MoE routing glue (moe_glue.cu): validate the inputs (errors name the op and the bad
// value), allocate the outputs, run the launchers on the current stream. Compiled by the host C++ compiler.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "torch_utils.h"

namespace cublade {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_route(const at::Tensor& topk_ids, const at::Tensor& x_in,
                                                         int64_t num_experts) {
  constexpr const char* op = "moe_route";
  CUBLADE_CHECK_VALUE(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong, op,
                      "topk_ids must be int32 or int64, got ", dt(topk_ids.scalar_type()));
  CUBLADE_CHECK_VALUE(topk_ids.dim() == 2, op, "topk_ids must be 2-D [tokens, k], got shape ", shape(topk_ids.sizes()));
  CUBLADE_CHECK_VALUE(x_in.dim() == 2 && x_in.size(0) == topk_ids.size(0), op, "x must be [", num(topk_ids.size(0)),
                      ", hidden] for topk_ids of shape ", shape(topk_ids.sizes()), ", got ", shape(x_in.sizes()));
  CUBLADE_CHECK_NOT_IMPLEMENTED(x_in.element_size() == 2, op, "x must be bfloat16 or float16, got ",
                                dt(x_in.scalar_type()));
  CUBLADE_CHECK_NOT_IMPLEMENTED(x_in.size(1) % 8 == 0, op, "hidden size ", num(x_in.size(1)),
                                " must be a multiple of 8 (16-byte rows)");
  CUBLADE_CHECK_VALUE(num_experts >= 1 && num_experts <= kMoeMaxExperts, op, "num_experts must be in [1, ",
                      num(kMoeMaxExperts), "], got ", num(num_experts));
  CUBLADE_CHECK_VALUE(x_in.is_cuda() && topk_ids.device() == x_in.device(), op,
                      "x and topk_ids must be on one CUDA device, got ", dev(x_in.device()), " and ",
                      dev(topk_ids.device()));
  const int64_t n = topk_ids.numel(), k = topk_ids.size(1);
  CUBLADE_CHECK_VALUE(n < INT32_MAX, op, "topk_ids has ", num(n), " entries; at most 2^31 - 2");
  check_arch(op, x_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = with_16byte_rows(x_in);
  const at::Tensor ids = topk_ids.contiguous();
  const auto i32 = x.options().dtype(at::kInt);
  at::Tensor xs = at::empty({n, x.size(1)}, x.options());
  at::Tensor offsets = at::empty({num_experts + 1}, i32), pos = at::empty({n}, i32), src = at::empty({n}, i32);
  MoeRouteArgs a;
  a.ids = ids.data_ptr(); a.ids64 = ids.scalar_type() == at::kLong;
  a.n = n; a.E = static_cast<int>(num_experts); a.k = static_cast<int>(k);
  a.x = x.data_ptr(); a.row_bytes = x.size(1) * 2; a.x_stride_bytes = x.stride(0) * 2;
  a.xs = xs.data_ptr(); a.offsets = offsets.data_ptr<int>(); a.pos = pos.data_ptr<int>(); a.src = src.data_ptr<int>();
  check_launch(op, launch_moe_route(a, current_stream()));
  return {xs, offsets, pos};
}

at::Tensor moe_finalize(const at::Tensor& y_in, const at::Tensor& pos, const at::Tensor& topk_weights) {
  constexpr const char* op = "moe_finalize";
  CUBLADE_CHECK_NOT_IMPLEMENTED(y_in.scalar_type() == at::kBFloat16 || y_in.scalar_type() == at::kHalf, op,
                                "y must be bfloat16 or float16, got ", dt(y_in.scalar_type()));
  const InDtype w_dt = in_dtype_of(op, "topk_weights", topk_weights);
  CUBLADE_CHECK_VALUE(topk_weights.dim() == 2, op, "topk_weights must be 2-D [tokens, k], got shape ",
                      shape(topk_weights.sizes()));
  const int64_t T = topk_weights.size(0), k = topk_weights.size(1);
  CUBLADE_CHECK_VALUE(y_in.dim() == 2 && y_in.size(0) == T * k, op, "y must be [", num(T * k),
                      ", N] for topk_weights of shape ", shape(topk_weights.sizes()), ", got ", shape(y_in.sizes()));
  CUBLADE_CHECK_VALUE(pos.scalar_type() == at::kInt && pos.dim() == 1 && pos.size(0) == T * k, op,
                      "pos must be int32 [", num(T * k), "] (moe_route's), got ", dt(pos.scalar_type()), " ",
                      shape(pos.sizes()));
  CUBLADE_CHECK_NOT_IMPLEMENTED(y_in.size(1) % 8 == 0, op, "N=", num(y_in.size(1)),
                                " must be a multiple of 8 (16-byte rows)");
  CUBLADE_CHECK_VALUE(y_in.is_cuda() && pos.device() == y_in.device() && topk_weights.device() == y_in.device(), op,
                      "y, pos and topk_weights must be on one CUDA device, got ", dev(y_in.device()), ", ",
                      dev(pos.device()), " and ", dev(topk_weights.device()));
  check_arch(op, y_in);
  const c10::cuda::CUDAGuard guard(y_in.device());
  const at::Tensor y = with_16byte_rows(y_in);
  const at::Tensor p = pos.contiguous(), w = topk_weights.contiguous();
  at::Tensor out = at::empty({T, y.size(1)}, y.options());
  MoeFinalizeArgs a;
  a.y = y.data_ptr(); a.y_dtype = in_dtype_of(op, "y", y); a.y_stride = y.stride(0);
  a.pos = p.data_ptr<int>();
  a.w = w.data_ptr(); a.w_dtype = w_dt;
  a.T = T; a.k = static_cast<int>(k); a.H = y.size(1);
  a.out = out.data_ptr();
  check_launch(op, launch_moe_finalize(a, current_stream()));
  return out;
}

at::Tensor silu_mul(const at::Tensor& h_in) {
  constexpr const char* op = "silu_mul";
  CUBLADE_CHECK_NOT_IMPLEMENTED(h_in.scalar_type() == at::kBFloat16 || h_in.scalar_type() == at::kHalf, op,
                                "h must be bfloat16 or float16, got ", dt(h_in.scalar_type()));
  CUBLADE_CHECK_VALUE(h_in.dim() == 2 && h_in.size(1) % 2 == 0, op,
                      "h must be 2-D [rows, 2 * I] (gate | up), got shape ", shape(h_in.sizes()));
  const int64_t I = h_in.size(1) / 2;
  CUBLADE_CHECK_NOT_IMPLEMENTED(I % 8 == 0, op, "I=", num(I), " must be a multiple of 8 (16-byte halves)");
  CUBLADE_CHECK_VALUE(h_in.is_cuda(), op, "h must be on a CUDA device, got ", dev(h_in.device()));
  check_arch(op, h_in);
  const c10::cuda::CUDAGuard guard(h_in.device());
  const at::Tensor h = with_16byte_rows(h_in);
  at::Tensor out = at::empty({h.size(0), I}, h.options());
  SiluMulArgs a;
  a.h = h.data_ptr(); a.dtype = in_dtype_of(op, "h", h); a.h_stride = h.stride(0);
  a.M = h.size(0); a.I = I;
  a.out = out.data_ptr();
  check_launch(op, launch_silu_mul(a, current_stream()));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(cublade, CUDA, m) {
  m.impl("moe_route", &moe_route);
  m.impl("moe_finalize", &moe_finalize);
  m.impl("silu_mul", &silu_mul);
}

}  // namespace cublade
