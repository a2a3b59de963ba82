// Torch wrapper of the W4A16 GEMM: validates the inputs (errors name the op and the bad value, as strings:
// docs/kernels.md, "Error messages"), allocates the output, runs launch_w4a16_gemm (w4a16_gemm.cu) on the current
// stream, or from prefill rows w4a16_dequant (w4a16_dequant_torch.cpp) and cuBLAS. Compiled by the host C++ compiler.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "lowbit_torch.h"
#include "torch_utils.h"
#include "w4a16_gemm.h"

namespace cublade {
namespace {

// From w4a16_gemm_prefill_rows(group_size, N, K, rounded) rows (w4a16_gemm.h: 128; at group size 128 or per channel
// 448, 640 on large weights; with the rounded passes 257, 640 or 1024 by the weight's size) the GEMM dequantizes the
// weight once and runs a dense cuBLAS GEMM (the prefill path, as vLLM's AWQ method does from 256 tokens): the kernels
// re-read the weights every 32 rows (streaming kernel), 128 rows (wide kernel, group size 128 or per channel) or 256
// (its rounded passes). The prefill path's weights are rounded to x's dtype once, as are the wide kernel's rounded
// passes (bf16 x at group size 128, from 160 rows: w4a16_gemm.h), where the other kernels keep them exact: `prefill` =
// false keeps every batch on the exact kernels (batch-invariant numerics).

at::Tensor w4a16_gemm(const at::Tensor& x_in, const at::Tensor& packed, int64_t group_size, bool symmetric,
                      int64_t size_n, int64_t split_k, bool prefill) {
  constexpr const char* op = "w4a16_gemm";
  const int64_t K = check_w4a16_gemm_args(op, x_in, packed, group_size, symmetric, size_n, check_arch);
  CUBLADE_CHECK_VALUE(split_k >= 0 && split_k <= kLowbitMaxSplit, op, "split_k must be in [0, ",
                      num(kLowbitMaxSplit), "] (0 = automatic; >= 1 forces the streaming kernel), got ",
                      num(split_k));

  const int gs = static_cast<int>(group_size), sk = static_cast<int>(split_k);
  const bool rounded = prefill && x_in.scalar_type() == at::kBFloat16;
  return lowbit_gemm(
      op, x_in, size_n, split_k == 0 && prefill, w4a16_gemm_prefill_rows(group_size, size_n, K, rounded),
      [&] { return w4a16_dequant(packed, group_size, symmetric, size_n, K, x_in.scalar_type()); },
      [&](int64_t M) { return w4a16_gemm_workspace_bytes(M, K, size_n, gs, sk, sm_count(x_in), rounded); },
      [&](const at::Tensor& x, int64_t M, at::Tensor& out, void* workspace) {
        W4a16GemmArgs a;
        a.x = x.data_ptr(); a.dtype = in_dtype_of(op, "x", x); a.M = M; a.K = K; a.x_stride = x.stride(0);
        a.packed = packed.data_ptr(); a.group_size = gs; a.asym = !symmetric;
        a.out = out.data_ptr(); a.out_stride = size_n; a.N = size_n;
        a.split_k = sk; a.workspace = workspace; a.sms = sm_count(x_in); a.rounded = rounded;
        return launch_w4a16_gemm(a, current_stream());
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(cublade, CUDA, m) { m.impl("w4a16_gemm", &w4a16_gemm); }

}  // namespace cublade
