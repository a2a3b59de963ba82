// Torch wrappers of the W4A16 GEMM and dequant: validate the inputs (errors name the op and the bad value, as
// strings: README.md, "Error messages"), allocate the output, run launch_w4a16_gemm (w4a16_gemm.cu) /
// launch_w4a16_dequant (w4a16_dequant.cu) on the current stream. Compiled by the host C++ compiler.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "lowbit_torch.h"
#include "torch_utils.h"
#include "w4a16_gemm.h"

namespace cublade {
namespace {

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The blob w4a16_repack makes for (N, K, group_size, symmetric): int32 [ceil(N/64), ceil(K/512), 4, 1024 + records].
void check_packed(const char* op, const at::Tensor& packed, int64_t size_n, int64_t K, int64_t group_size,
                  bool symmetric) {
  const int64_t groups = cdiv(size_n, kLowbitGroupRows), chunks = cdiv(K, kLowbitChunkK);
  const int64_t words = kLowbitTileWords + w4a16_gemm_sbytes(static_cast<int>(group_size), !symmetric) / 4;
  const std::vector<int64_t> want = {groups, chunks, 4, words};
  CUBLADE_CHECK_VALUE(packed.scalar_type() == at::kInt && packed.sizes() == at::IntArrayRef(want) &&
                          packed.is_contiguous(),
                      op, "packed must be a contiguous int32 ", shape(want), " tensor (w4a16_repack of N=",
                      num(size_n), ", K=", num(K), ", group_size=", num(group_size),
                      symmetric ? ", symmetric" : ", asymmetric", "), got ", dt(packed.scalar_type()), " ",
                      shape(packed.sizes()));
}

at::Tensor w4a16_dequant(const at::Tensor& packed_in, int64_t group_size, bool symmetric, int64_t size_n,
                         int64_t size_k, at::ScalarType dtype);

// From w4a16_gemm_prefill_rows(group_size, N, K) rows (w4a16_gemm.h: 128, or at group size 128 / per channel 448 and
// 640 on large weights) the GEMM dequantizes the weight once and runs a dense cuBLAS GEMM (the prefill path, as
// vLLM's AWQ method does from 256 tokens): the kernels re-read the weights every 32 rows (streaming kernel) or 128
// rows (wide kernel, group size 128 or per channel).

at::Tensor w4a16_gemm(const at::Tensor& x_in, const at::Tensor& packed, int64_t group_size, bool symmetric,
                      int64_t size_n, int64_t split_k) {
  constexpr const char* op = "w4a16_gemm";
  CUBLADE_CHECK_NOT_IMPLEMENTED(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kHalf, op,
                                "x must be bfloat16 or float16, got ", dt(x_in.scalar_type()));
  CUBLADE_CHECK_VALUE(x_in.dim() >= 1, op, "x must have at least 1 dim, got a 0-dim tensor");
  CUBLADE_CHECK_VALUE(x_in.is_cuda() && packed.device() == x_in.device(), op,
                      "x and packed must be on one CUDA device, got ", dev(x_in.device()), " and ",
                      dev(packed.device()));
  check_arch(op, x_in);
  const int64_t K = x_in.size(-1);
  CUBLADE_CHECK_VALUE(K > 0 && K % 8 == 0, op, "in_features K=", num(K), " must be a positive multiple of 8");
  CUBLADE_CHECK_VALUE(group_size == 32 || group_size == 64 || group_size == 128 || group_size == -1, op,
                      "group_size must be 32, 64, 128 or -1 (per channel), got ", num(group_size));
  CUBLADE_CHECK_VALUE(group_size == -1 || K % group_size == 0, op, "in_features K=", num(K),
                      " is not a multiple of group_size=", num(group_size));
  CUBLADE_CHECK_VALUE(size_n > 0 && size_n <= INT32_MAX, op, "size_n must be in [1, 2^31), got ", num(size_n));
  CUBLADE_CHECK_VALUE(split_k >= 0 && split_k <= kLowbitMaxSplit, op, "split_k must be in [0, ",
                      num(kLowbitMaxSplit), "] (0 = automatic; >= 1 forces the streaming kernel), got ",
                      num(split_k));
  check_packed(op, packed, size_n, K, group_size, symmetric);

  const int gs = static_cast<int>(group_size), sk = static_cast<int>(split_k);
  return lowbit_gemm(
      op, x_in, size_n, split_k == 0, w4a16_gemm_prefill_rows(group_size, size_n, K),
      [&] { return w4a16_dequant(packed, group_size, symmetric, size_n, K, x_in.scalar_type()); },
      [&](int64_t M) { return w4a16_gemm_workspace_bytes(M, K, size_n, gs, sk, sm_count(x_in)); },
      [&](const at::Tensor& x, int64_t M, at::Tensor& out, void* workspace) {
        W4a16GemmArgs a;
        a.x = x.data_ptr(); a.dtype = in_dtype_of(op, "x", x); a.M = M; a.K = K; a.x_stride = x.stride(0);
        a.packed = packed.data_ptr(); a.group_size = gs; a.asym = !symmetric;
        a.out = out.data_ptr(); a.out_stride = size_n; a.N = size_n;
        a.split_k = sk; a.workspace = workspace; a.sms = sm_count(x_in);
        return launch_w4a16_gemm(a, current_stream());
      });
}

// The dense weight [size_n, size_k] in dtype (bf16 / fp16) from the blob: the prefill path (dequantize once, then
// a dense GEMM). The output is always contiguous; a misaligned blob view is copied (the kernel reads 16 bytes).
at::Tensor w4a16_dequant(const at::Tensor& packed_in, int64_t group_size, bool symmetric, int64_t size_n,
                         int64_t size_k, at::ScalarType dtype) {
  constexpr const char* op = "w4a16_dequant";
  CUBLADE_CHECK_NOT_IMPLEMENTED(dtype == at::kBFloat16 || dtype == at::kHalf, op,
                                "dtype must be bfloat16 or float16, got ", dt(dtype));
  check_arch(op, packed_in);  // the op dispatches on packed: it is a CUDA tensor here
  CUBLADE_CHECK_VALUE(group_size == 32 || group_size == 64 || group_size == 128 || group_size == -1, op,
                      "group_size must be 32, 64, 128 or -1 (per channel), got ", num(group_size));
  CUBLADE_CHECK_VALUE(size_n > 0 && size_n <= INT32_MAX, op, "size_n must be in [1, 2^31), got ", num(size_n));
  CUBLADE_CHECK_VALUE(size_k > 0 && size_k % 8 == 0 && size_k <= INT32_MAX - kLowbitChunkK, op, "size_k=",
                      num(size_k), " must be a positive multiple of 8 below 2^31 - 512");
  CUBLADE_CHECK_VALUE(group_size == -1 || size_k % group_size == 0, op, "size_k=", num(size_k),
                      " is not a multiple of group_size=", num(group_size));
  check_packed(op, packed_in, size_n, size_k, group_size, symmetric);

  const c10::cuda::CUDAGuard guard(packed_in.device());
  const at::Tensor packed = aligned16(packed_in.data_ptr()) ? packed_in : packed_in.clone();
  at::Tensor out = at::empty({size_n, size_k}, packed.options().dtype(dtype));
  W4a16DequantArgs a;
  a.packed = packed.data_ptr(); a.group_size = static_cast<int>(group_size); a.asym = !symmetric;
  a.N = size_n; a.K = size_k;
  a.out_dtype = dtype == at::kBFloat16 ? InDtype::kBF16 : InDtype::kF16; a.out = out.data_ptr();
  check_launch(op, launch_w4a16_dequant(a, current_stream()));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(cublade, CUDA, m) {
  m.impl("w4a16_gemm", &w4a16_gemm);
  m.impl("w4a16_dequant", &w4a16_dequant);
}

}  // namespace cublade
