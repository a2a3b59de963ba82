// Host helpers for the torch wrappers (plugin/csrc/<op>_torch.cpp, compiled by the host C++ compiler, not
// nvcc: see docs/kernels.md, "File convention"). Input checks raise ValueError / NotImplementedError in Python with the
// op's name first. Messages pass numbers, shapes, devices and dtypes as strings made by num/shape/dev/dt below,
// never as integers or c10::ArrayRef: streaming an integer into the message's std::ostringstream from this
// extension crashed (SIGSEGV) on the H200 image (docs/kernels.md, "Error messages").
#pragma once

#ifdef CUBLADE_KERNELS_ONLY
#error "torch_utils.h is for the torch wrappers (<op>_torch.cpp); a CUBLADE_KERNELS_ONLY file stays framework-free"
#endif

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <string>

#include "launchers.h"

#define CUBLADE_CHECK_VALUE(cond, op, ...) TORCH_CHECK_VALUE(cond, "cublade.", op, ": ", __VA_ARGS__)
#define CUBLADE_CHECK_NOT_IMPLEMENTED(cond, op, ...) \
  TORCH_CHECK_NOT_IMPLEMENTED(cond, "cublade.", op, ": ", __VA_ARGS__)

namespace cublade {

inline std::string num(int64_t v) { return std::to_string(v); }
inline std::string shape(c10::IntArrayRef s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}
inline std::string dev(const c10::Device& d) { return d.str(); }
inline const char* dt(c10::ScalarType t) { return c10::toString(t); }

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A 2-D tensor whose rows the kernels can read in 16-byte vectors or bulk copies: unit column stride, rows 16 bytes
// apart and 16-byte aligned. `x` itself when it already is; else a contiguous copy (cloned again if the copy's
// storage is misaligned).
inline at::Tensor with_16byte_rows(const at::Tensor& x) {
  at::Tensor r = x;
  if (r.stride(1) != 1 || r.stride(0) * r.element_size() % 16 != 0 || !aligned16(r.data_ptr())) r = r.contiguous();
  if (!aligned16(r.data_ptr())) r = r.clone();
  return r;
}

inline int device_attr(cudaDeviceAttr attr, int device) {
  int v = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, attr, device));
  return v;
}

// The extension holds sm_90a code only (Hopper fp8 conversions, arch-specific features): refuse other GPUs
// by name instead of failing later with "no kernel image is available".
inline void check_arch(const char* op, const at::Tensor& t) {
  const int dev = t.device().index();
  const int major = device_attr(cudaDevAttrComputeCapabilityMajor, dev);
  const int minor = device_attr(cudaDevAttrComputeCapabilityMinor, dev);
  if (major == 9 && minor == 0) return;
  cudaDeviceProp p;
  C10_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  CUBLADE_CHECK_NOT_IMPLEMENTED(false, op, "this build has sm_90a (Hopper) kernels only; device ", num(dev), " is ",
                                p.name, " (sm_", num(major), num(minor), ")");
}

inline void check_launch(const char* op, cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "cublade.", op, ": kernel launch failed: ", cudaGetErrorString(err));
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

inline int sm_count(const at::Tensor& t) {
  return device_attr(cudaDevAttrMultiProcessorCount, t.device().index());
}

// An FP8 W8A8 GEMM's weight operand for activations of K columns on x's device: a contiguous, 16-byte aligned
// float8_e4m3fn [N, K] with 1 to 2^31 - 1 rows and one fp32 scale per row (weight_scale, numel N). Returns N.
inline int64_t check_fp8_weight(const char* op, const at::Tensor& weight, const at::Tensor& weight_scale, int64_t K,
                                const at::Tensor& x) {
  CUBLADE_CHECK_VALUE(weight.scalar_type() == at::kFloat8_e4m3fn && weight.dim() == 2 && weight.is_contiguous(), op,
                      "weight must be a contiguous float8_e4m3fn [N, K] tensor, got ", dt(weight.scalar_type()), " ",
                      shape(weight.sizes()), weight.is_contiguous() ? "" : " (not contiguous)");
  const int64_t N = weight.size(0);
  CUBLADE_CHECK_VALUE(weight.size(1) == K, op, "weight has K=", num(weight.size(1)), ", x has K=", num(K));
  CUBLADE_CHECK_VALUE(N > 0 && N <= INT32_MAX, op, "weight must have 1 to 2^31 - 1 rows, got ", num(N));
  CUBLADE_CHECK_VALUE(aligned16(weight.data_ptr()), op, "weight must be 16-byte aligned");
  CUBLADE_CHECK_VALUE(weight_scale.scalar_type() == at::kFloat && weight_scale.numel() == N &&
                          weight_scale.device() == x.device(),
                      op, "weight_scale must be float32 with one element per output channel (", num(N), ") on ",
                      dev(x.device()), ", got ", dt(weight_scale.scalar_type()), " ", shape(weight_scale.sizes()));
  return N;
}

// An FP8 W8A8 GEMM's activation scale for x's M rows: float32 with one element per row, or one, on x's device.
inline void check_row_scale(const char* op, const at::Tensor& x_scale, int64_t M, const at::Tensor& x) {
  CUBLADE_CHECK_VALUE(x_scale.scalar_type() == at::kFloat && (x_scale.numel() == M || x_scale.numel() == 1) &&
                          x_scale.device() == x.device(),
                      op, "x_scale must be float32 with one element per row of x (", num(M), ") or one, on ",
                      dev(x.device()), ", got ", dt(x_scale.scalar_type()), " ", shape(x_scale.sizes()));
}

inline InDtype in_dtype_of(const char* op, const char* name, const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return InDtype::kBF16;
    case at::kHalf: return InDtype::kF16;
    case at::kFloat: return InDtype::kF32;
    default:
      CUBLADE_CHECK_NOT_IMPLEMENTED(false, op, name, " must be bfloat16, float16 or float32, got ",
                                    dt(t.scalar_type()));
  }
  return InDtype::kF32;  // unreachable
}

// A one-element fp32 scale tensor on x's device (the layer's static scale, k_scale, ...).
inline void check_scale_tensor(const char* op, const char* name, const at::Tensor& s, const at::Tensor& x) {
  CUBLADE_CHECK_VALUE(s.numel() == 1, op, name, " must have one element, got shape ", shape(s.sizes()));
  CUBLADE_CHECK_VALUE(s.scalar_type() == at::kFloat, op, name, " must be float32, got ", dt(s.scalar_type()));
  CUBLADE_CHECK_VALUE(s.device() == x.device(), op, name, " must be on ", dev(x.device()), ", got ", dev(s.device()));
}

}  // namespace cublade
