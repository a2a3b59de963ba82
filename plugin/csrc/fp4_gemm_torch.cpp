// Torch wrapper of the FP4 expert GEMM: validates the inputs (errors name the op and the bad value, as strings:
// docs/kernels.md, "Error messages"), allocates the output, runs launch_fp4_gemm (fp4_gemm.cu) on the current stream.
// Compiled by the host C++ compiler.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "torch_utils.h"
#include "w4a16_gemm.h"

namespace cublade {
namespace {

at::Tensor fp4_gemm(const at::Tensor& x_in, const at::Tensor& packed, const std::optional<at::Tensor>& row_scale,
                    c10::string_view format, int64_t size_n, const std::optional<at::Tensor>& expert_offsets,
                    int64_t max_m, int64_t split_k, int64_t routed_experts) {
  constexpr const char* op = "fp4_gemm";
  const std::string fmt_name(format);
  const int fmt = fmt_name == "mxfp4" ? 0 : fmt_name == "nvfp4" ? 1 : -1;
  CUBLADE_CHECK_VALUE(fmt >= 0, op, "format must be 'mxfp4' or 'nvfp4', got '", fmt_name, "'");
  CUBLADE_CHECK_NOT_IMPLEMENTED(x_in.scalar_type() == at::kBFloat16, op,
                                "x must be bfloat16 (FP4 experts run bf16 math), got ", dt(x_in.scalar_type()));
  CUBLADE_CHECK_VALUE(x_in.dim() == 2, op, "x must be 2-D [tokens, K], got shape ", shape(x_in.sizes()));
  CUBLADE_CHECK_VALUE(x_in.is_cuda() && packed.device() == x_in.device(), op,
                      "x and packed must be on one CUDA device, got ", dev(x_in.device()), " and ",
                      dev(packed.device()));
  check_arch(op, x_in);
  const int64_t K = x_in.size(1);
  CUBLADE_CHECK_VALUE(K > 0 && K % 32 == 0, op, "in_features K=", num(K), " must be a positive multiple of 32");
  CUBLADE_CHECK_VALUE(size_n > 0 && size_n <= INT32_MAX, op, "size_n must be in [1, 2^31), got ", num(size_n));
  CUBLADE_CHECK_VALUE(split_k >= 0 && split_k <= kLowbitMaxSplit, op, "split_k must be in [0, ",
                      num(kLowbitMaxSplit), "] (0 = automatic), got ", num(split_k));
  CUBLADE_CHECK_VALUE(max_m >= 0, op, "max_m must be >= 0 (0 = the number of rows of x), got ", num(max_m));
  CUBLADE_CHECK_VALUE(routed_experts >= 0, op, "routed_experts must be >= 0 (0 = the experts packed holds), got ",
                      num(routed_experts));
  const int64_t groups = cdiv(size_n, kLowbitGroupRows), chunks = cdiv(K, kLowbitChunkK);
  const int64_t words = kLowbitTileWords + kFp4RecordBytes / 4;
  CUBLADE_CHECK_VALUE(packed.scalar_type() == at::kInt && packed.dim() == 5 && packed.size(1) == groups &&
                          packed.size(2) == chunks && packed.size(3) == 4 && packed.size(4) == words &&
                          packed.is_contiguous(),
                      op, "packed must be a contiguous int32 [E, ", num(groups), ", ", num(chunks), ", 4, ",
                      num(words), "] tensor (fp4_repack of N=", num(size_n), ", K=", num(K), "), got ",
                      dt(packed.scalar_type()), " ", shape(packed.sizes()));
  const int64_t E = packed.size(0);
  const float* rs = nullptr;
  if (row_scale.has_value()) {
    const at::Tensor& r = *row_scale;
    const std::vector<int64_t> want = {E, groups * kLowbitGroupRows};
    CUBLADE_CHECK_VALUE(r.scalar_type() == at::kFloat && r.sizes() == at::IntArrayRef(want) && r.is_contiguous() &&
                            r.device() == x_in.device(),
                        op, "row_scale must be a contiguous float32 ", shape(want), " tensor on ", dev(x_in.device()),
                        ", got ", dt(r.scalar_type()), " ", shape(r.sizes()), " on ", dev(r.device()));
    rs = r.data_ptr<float>();
  }
  const int* offs = nullptr;
  if (expert_offsets.has_value()) {
    const at::Tensor& o = *expert_offsets;
    CUBLADE_CHECK_VALUE(o.scalar_type() == at::kInt && o.dim() == 1 && o.size(0) == E + 1 && o.is_contiguous() &&
                            o.device() == x_in.device(),
                        op, "expert_offsets must be a contiguous int32 [", num(E + 1), "] tensor on ",
                        dev(x_in.device()), ", got ", dt(o.scalar_type()), " ", shape(o.sizes()), " on ",
                        dev(o.device()));
    offs = o.data_ptr<int>();
  } else {
    CUBLADE_CHECK_VALUE(E == 1, op, "packed holds ", num(E), " experts: pass expert_offsets [", num(E + 1), "]");
  }

  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = with_16byte_rows(x_in);
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, size_n}, x_in.options());
  if (M == 0) return out;
  CUBLADE_CHECK_VALUE(M <= INT32_MAX, op, "x has ", num(M), " rows; at most 2^31 - 1");
  const size_t ws_bytes = fp4_gemm_workspace_bytes(M, K, E, offs != nullptr, static_cast<int>(split_k),
                                                   routed_experts);
  at::Tensor workspace;  // the wide kernel's re-laid-out x (the caching allocator makes this cheap)
  if (ws_bytes > 0) workspace = at::empty({static_cast<int64_t>(ws_bytes)}, x.options().dtype(at::kByte));
  Fp4GemmArgs a;
  a.x = x.data_ptr(); a.M = M; a.K = K; a.x_stride = x.stride(0);
  a.offsets = offs; a.E = E; a.routed_experts = routed_experts; a.max_m = max_m > 0 ? max_m : M;
  a.packed = packed.data_ptr(); a.row_scale = rs; a.fmt = fmt;
  a.out = out.data_ptr(); a.out_stride = size_n; a.N = size_n;
  a.split_k = static_cast<int>(split_k);
  a.workspace = ws_bytes > 0 ? workspace.data_ptr() : nullptr;
  a.sms = sm_count(x_in);
  check_launch(op, launch_fp4_gemm(a, current_stream()));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(cublade, CUDA, m) { m.impl("fp4_gemm", &fp4_gemm); }

}  // namespace cublade
