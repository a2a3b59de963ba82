// Torch wrapper of the L2 prefetch: validates the tensor (errors name the op and the bad value) and runs the
// framework-free launcher from l2_prefetch.cu on the current stream. Compiled by the host C++ compiler
// (docs/kernels.md, "File convention").
#include <ATen/ATen.h>
#include <torch/library.h>

#include "torch_utils.h"

namespace cublade {
namespace {

void l2_prefetch(const at::Tensor& t, int64_t max_bytes) {
  constexpr const char* op = "l2_prefetch";
  CUBLADE_CHECK_VALUE(t.is_cuda(), op, "t must be a CUDA tensor, got one on ", dev(t.device()));
  CUBLADE_CHECK_VALUE(t.is_contiguous(), op, "t must be contiguous (the prefetch covers its first bytes), got shape ",
                      shape(t.sizes()), " with strides ", shape(t.strides()));
  CUBLADE_CHECK_VALUE(max_bytes >= 0, op, "max_bytes must be >= 0, got ", num(max_bytes));
  check_arch(op, t);
  const int64_t bytes = std::min<int64_t>(max_bytes, t.numel() * static_cast<int64_t>(t.element_size()));
  if (bytes == 0) return;
  const c10::cuda::CUDAGuard guard(t.device());
  L2PrefetchArgs a;
  a.p = t.data_ptr();
  a.bytes = bytes;
  check_launch(op, launch_l2_prefetch(a, current_stream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(cublade, CUDA, m) { m.impl("l2_prefetch", &l2_prefetch); }

}  // namespace cublade
