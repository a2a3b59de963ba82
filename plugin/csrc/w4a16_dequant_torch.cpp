// Torch wrapper of the W4A16 dequant (the prefill path's weight): validates the inputs (errors name the op and the
// bad value, as strings: docs/kernels.md, "Error messages"), allocates the output, runs launch_w4a16_dequant
// (w4a16_dequant.cu) on the current stream. Compiled by the host C++ compiler.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "lowbit_torch.h"
#include "torch_utils.h"
#include "w4a16_gemm.h"

namespace cublade {

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
  check_w4a16_packed(op, packed_in, size_n, size_k, group_size, symmetric);

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

// The blob as E4M3 codes [size_n, size_k] (u - z, exact) and fp32 scales [size_n, size_k / 128] with strides
// (1, size_n), column-major, as a 1x128 blockwise-scaled FP8 GEMM reads them. Group size 128 or -1.
std::tuple<at::Tensor, at::Tensor> w4a16_dequant_fp8(const at::Tensor& packed_in, int64_t group_size, bool symmetric,
                                                     int64_t size_n, int64_t size_k) {
  constexpr const char* op = "w4a16_dequant_fp8";
  check_arch(op, packed_in);
  CUBLADE_CHECK_NOT_IMPLEMENTED(group_size == 128 || group_size == -1, op,
                                "group_size must be 128 or -1 (per channel), got ", num(group_size));
  CUBLADE_CHECK_VALUE(size_n > 0 && size_n <= INT32_MAX, op, "size_n must be in [1, 2^31), got ", num(size_n));
  CUBLADE_CHECK_VALUE(size_k > 0 && size_k % 128 == 0 && size_k <= INT32_MAX - kLowbitChunkK, op, "size_k=",
                      num(size_k), " must be a positive multiple of 128 below 2^31 - 512");
  check_w4a16_packed(op, packed_in, size_n, size_k, group_size, symmetric);

  const c10::cuda::CUDAGuard guard(packed_in.device());
  const at::Tensor packed = aligned16(packed_in.data_ptr()) ? packed_in : packed_in.clone();
  at::Tensor codes = at::empty({size_n, size_k}, packed.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scale_t = at::empty({size_k / 128, size_n}, packed.options().dtype(at::kFloat));
  W4a16DequantFp8Args a;
  a.packed = packed.data_ptr(); a.group_size = static_cast<int>(group_size); a.asym = !symmetric;
  a.N = size_n; a.K = size_k; a.codes = codes.data_ptr(); a.scale_t = scale_t.data_ptr<float>();
  check_launch(op, launch_w4a16_dequant_fp8(a, current_stream()));
  return {codes, scale_t.t()};
}

TORCH_LIBRARY_IMPL(cublade, CUDA, m) {
  m.impl("w4a16_dequant", &w4a16_dequant);
  m.impl("w4a16_dequant_fp8", &w4a16_dequant_fp8);
}

}  // namespace cublade
