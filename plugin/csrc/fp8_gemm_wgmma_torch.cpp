// Torch wrapper of the FP8 W8A8 wgmma GEMM: validates the inputs (errors name the op and the bad value, as strings:
// docs/kernels.md, "Error messages"), allocates the output, runs launch_fp8_gemm_wgmma (fp8_gemm_wgmma.cu) on the
// current stream. Compiled by the host C++ compiler.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "fp8_gemm_wgmma.h"
#include "torch_utils.h"

namespace cublade {
namespace {

at::Tensor fp8_gemm_wgmma(const at::Tensor& x_in, const at::Tensor& x_scale_in, const at::Tensor& weight,
                          const at::Tensor& weight_scale_in, int64_t split_k) {
  constexpr const char* op = "fp8_gemm_wgmma";
  CUBLADE_CHECK_NOT_IMPLEMENTED(x_in.scalar_type() == at::kFloat8_e4m3fn, op,
                                "x must be float8_e4m3fn (fp8_quant_per_token / fp8_quant_per_tensor's output), got ",
                                dt(x_in.scalar_type()));
  CUBLADE_CHECK_VALUE(x_in.dim() >= 1, op, "x must have at least 1 dim, got a 0-dim tensor");
  CUBLADE_CHECK_VALUE(x_in.is_cuda() && weight.device() == x_in.device(), op,
                      "x and weight must be on one CUDA device, got ", dev(x_in.device()), " and ",
                      dev(weight.device()));
  check_arch(op, x_in);
  const int64_t K = x_in.size(-1);
  CUBLADE_CHECK_VALUE(K > 0 && K % 16 == 0 && K <= INT32_MAX, op, "in_features K=", num(K),
                      " must be a positive multiple of 16");
  const int64_t N = check_fp8_weight(op, weight, weight_scale_in, K, x_in);
  CUBLADE_CHECK_VALUE(split_k == 0 || split_k == 1 || split_k == 2 || split_k == 4 || split_k == 8, op,
                      "split_k must be 1, 2, 4 or 8 (0 = the launcher's plan), got ", num(split_k));

  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = with_16byte_rows(x_in.reshape({-1, K}));  // TMA reads rows 16-byte aligned
  const int64_t M = x.size(0);
  CUBLADE_CHECK_VALUE(M <= INT32_MAX, op, "x has ", num(M), " rows; at most 2^31 - 1");
  check_row_scale(op, x_scale_in, M, x_in);
  const at::Tensor x_scale = x_scale_in.contiguous(), weight_scale = weight_scale_in.contiguous();
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = N;
  at::Tensor out = at::empty(out_shape, x_in.options().dtype(at::kBFloat16));
  if (M == 0) return out;
  Fp8WgmmaArgs a;
  a.x = x.data_ptr(); a.M = M; a.K = K; a.x_stride = x.stride(0);
  a.x_scale = x_scale.data_ptr<float>(); a.x_scale_stride = x_scale.numel() == M && M > 1 ? 1 : 0;
  a.w = weight.data_ptr(); a.w_scale = weight_scale.data_ptr<float>();
  a.out = out.data_ptr(); a.out_stride = N; a.N = N;
  a.sms = sm_count(x_in);
  // A programmatic dependent launch of the quantization before it (CUBLADE_FP8_WGMMA_PDL=0: a plain launch, for A/B).
  static const bool pdl = [] {
    const char* v = std::getenv("CUBLADE_FP8_WGMMA_PDL");
    return v == nullptr || std::string(v) != "0";
  }();
  a.pdl = pdl;
  Fp8WgmmaPlan plan = plan_fp8_wgmma(M, N, K, a.sms, false);
  if (split_k > 0) plan.split_k = static_cast<int>(split_k);
  CUBLADE_CHECK_VALUE((plan.tokens_per_wg / 2) % plan.split_k == 0, op, "split_k=", num(split_k), " does not divide ",
                      "the ", num(plan.tokens_per_wg / 2), " partial sums a thread holds at M=", num(M));
  check_launch(op, launch_fp8_gemm_wgmma(a, &plan, current_stream()));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(cublade, CUDA, m) { m.impl("fp8_gemm_wgmma", &fp8_gemm_wgmma); }

}  // namespace cublade
