// Torch wrappers of the sm_80-89 weight-streaming GEMM (lowbit_gemm_sm80.cu): validate the inputs (errors name the op
// and the bad value: docs/kernels.md, "Error messages"), allocate the output, run the kernel on the current stream, or
// from kSm80PrefillRows rows the dequantized weight and cuBLAS (w4a16_dequant.cu's kernel for int4; the MXFP8
// dequant, times row_scale rounded once to bf16 when given).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "lowbit_torch.h"
#include "sm80/lowbit_gemm_sm80.h"
#include "torch_utils.h"
#include "w4a16_gemm.h"

namespace cublade {
namespace {

// GPUs the library's code runs on: sm_80 and later (sm_80 / 86 / 89 machine code, the compute_80 PTX elsewhere).
void check_sm80(const char* op, const at::Tensor& t) {
  const int dev = t.device().index();
  const int major = device_attr(cudaDevAttrComputeCapabilityMajor, dev);
  CUBLADE_CHECK_NOT_IMPLEMENTED(major >= 8, op, "needs compute capability 8.0 or later; device ", num(dev), " is sm_",
                                num(major), num(device_attr(cudaDevAttrComputeCapabilityMinor, dev)));
}

// The kernels' 16-byte copies read the blob from its start.
void check_aligned(const char* op, const at::Tensor& packed) {
  CUBLADE_CHECK_VALUE(aligned16(packed.data_ptr()), op, "packed must be 16-byte aligned (a view at an offset?)");
}

// The dense bf16 weight; each row times row_scale[row] when given (rounded once from fp32: the W8A16 prefill weight).
at::Tensor dequant_packed(const char* op, const at::Tensor& packed, int64_t size_n, int64_t size_k,
                          const float* row_scale) {
  CUBLADE_CHECK_VALUE(packed.is_cuda(), op, "packed must be a CUDA tensor, got ", dev(packed.device()));
  check_sm80(op, packed);
  CUBLADE_CHECK_VALUE(size_n > 0 && size_n <= INT32_MAX, op, "size_n must be in [1, 2^31), got ", num(size_n));
  CUBLADE_CHECK_VALUE(size_k > 0 && size_k % 32 == 0 && size_k <= INT32_MAX - kLowbitChunkK, op, "size_k=",
                      num(size_k), " must be a positive multiple of 32 below 2^31 - 512");
  check_mxfp8_packed(op, packed, size_n, size_k);
  check_aligned(op, packed);
  const c10::cuda::CUDAGuard guard(packed.device());
  at::Tensor out = at::empty({size_n, size_k}, packed.options().dtype(at::kBFloat16));
  check_launch(op, sm80::launch_mxfp8_dequant_packed_sm80(packed.data_ptr(), size_n, size_k, out.data_ptr(),
                                                          current_stream(), row_scale));
  return out;
}

at::Tensor mxfp8_dequant_packed_sm80(const at::Tensor& packed, int64_t size_n, int64_t size_k) {
  return dequant_packed("mxfp8_dequant_packed_sm80", packed, size_n, size_k, nullptr);
}

void check_tiles(const char* op, int64_t tiles) {
  CUBLADE_CHECK_VALUE(tiles == 0 || tiles == 1 || tiles == 2 || tiles == 4, op, "tiles must be 0 (the launcher's rule), "
                      "1, 2 or 4, got ", num(tiles));
}

at::Tensor mxfp8_gemm_sm80(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& row_scale,
                           int64_t size_n, bool kernel_only, int64_t tiles) {
  constexpr const char* op = "mxfp8_gemm_sm80";
  const int64_t K = check_mxfp8_gemm_args(op, x_in, packed, size_n, check_sm80);
  check_tiles(op, tiles);
  const int64_t rows = x_in.numel() / K, most = sm80::mxfp8_gemm_sm80_max_tiles(rows);
  CUBLADE_CHECK_VALUE(tiles <= most, op, "tiles=", num(tiles), " does not fit a CTA's 99 KB of shared memory",
                      rows > 8 ? " from 9 rows of x" : "", " (MXFP8 blocks); use at most ", num(most));
  check_aligned(op, packed);
  if (row_scale.has_value()) {
    const at::Tensor& s = *row_scale;
    CUBLADE_CHECK_VALUE(s.scalar_type() == at::kFloat && s.dim() == 1 && s.size(0) == size_n && s.is_contiguous() &&
                            s.device() == x_in.device(),
                        op, "row_scale must be a contiguous float32 [", num(size_n), "] tensor on x's device, got ",
                        dt(s.scalar_type()), " ", shape(s.sizes()));
  }
  const float* rs = row_scale.has_value() ? row_scale->data_ptr<float>() : nullptr;
  return lowbit_gemm(
      op, x_in, size_n, !kernel_only, sm80::kSm80PrefillRows,
      [&] { return dequant_packed(op, packed, size_n, K, rs); },
      [](int64_t) { return size_t{0}; },
      [&](const at::Tensor& x, int64_t M, at::Tensor& out, void*) {
        sm80::Mxfp8GemmSm80Args a;
        a.x = x.data_ptr(); a.M = M; a.K = K; a.x_stride = x.stride(0);
        a.packed = packed.data_ptr(); a.row_scale = rs;
        a.out = out.data_ptr(); a.out_stride = size_n; a.N = size_n; a.tiles = static_cast<int>(tiles);
        a.sms = sm_count(x);
        return sm80::launch_mxfp8_gemm_sm80(a, current_stream());
      });
}

// The dense weight [size_n, K] in dtype from the int4 blob (the prefill path), w4a16_dequant.cu's kernel.
at::Tensor w4a16_dequant_sm80(const at::Tensor& packed, int64_t group_size, bool symmetric, int64_t size_n, int64_t K,
                              at::ScalarType dtype) {
  at::Tensor out = at::empty({size_n, K}, packed.options().dtype(dtype));
  W4a16DequantArgs a;
  a.packed = packed.data_ptr(); a.group_size = static_cast<int>(group_size); a.asym = !symmetric;
  a.N = size_n; a.K = K; a.out = out.data_ptr(); a.out_dtype = in_dtype_of("w4a16_gemm_sm80", "x", out);
  check_launch("w4a16_gemm_sm80", launch_w4a16_dequant(a, current_stream()));
  return out;
}

at::Tensor w4a16_gemm_sm80(const at::Tensor& x_in, const at::Tensor& packed, int64_t group_size, bool symmetric,
                           int64_t size_n, bool kernel_only, int64_t tiles) {
  constexpr const char* op = "w4a16_gemm_sm80";
  const int64_t K = check_w4a16_gemm_args(op, x_in, packed, group_size, symmetric, size_n, check_sm80);
  check_tiles(op, tiles);
  check_aligned(op, packed);
  return lowbit_gemm(
      op, x_in, size_n, !kernel_only, sm80::kSm80PrefillRows,
      [&] { return w4a16_dequant_sm80(packed, group_size, symmetric, size_n, K, x_in.scalar_type()); },
      [](int64_t) { return size_t{0}; },
      [&](const at::Tensor& x, int64_t M, at::Tensor& out, void*) {
        sm80::W4a16GemmSm80Args a;
        a.x = x.data_ptr(); a.dtype = in_dtype_of(op, "x", x); a.M = M; a.K = K; a.x_stride = x.stride(0);
        a.packed = packed.data_ptr(); a.group_size = static_cast<int>(group_size); a.asym = !symmetric;
        a.out = out.data_ptr(); a.out_stride = size_n; a.N = size_n; a.tiles = static_cast<int>(tiles);
        a.sms = sm_count(x);
        return sm80::launch_w4a16_gemm_sm80(a, current_stream());
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(cublade, CUDA, m) {
  m.impl("w4a16_gemm_sm80", &w4a16_gemm_sm80);
  m.impl("mxfp8_gemm_sm80", &mxfp8_gemm_sm80);
  m.impl("mxfp8_dequant_packed_sm80", &mxfp8_dequant_packed_sm80);
}

}  // namespace cublade
