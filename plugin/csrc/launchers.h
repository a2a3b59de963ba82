// Framework-free declarations shared by the kernels (*.cu, compiled by nvcc) and the torch wrappers
// (*_torch.cpp, compiled by the host C++ compiler): input dtypes and the launchers of the quant, KV-cache and MoE
// glue ops (the GEMM ops' launchers: w4a16_gemm.h).
// Every launcher takes its op's argument struct (`<Op>Args`, filled by the torch wrapper) and the stream: raw
// pointers, sizes and strides in elements, each member named, every member defaulting to null / 0. A launcher
// launches on `stream`, never allocates, never synchronizes, and returns the launch's cudaError_t.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace cublade {

// Input element types the kernels take (activations, K/V).
enum class InDtype : int { kBF16 = 0, kF16 = 1, kF32 = 2 };

// What fp8_quant_per_token writes: the E4M3 bytes, or the same E4M3 values as bf16 or fp16 (exact in both: fp8_gemm's
// activations, bf16 x only).
enum class Fp8Values : int { kCodes = 0, kBF16 = 1, kF16 = 2 };

// fp8_quant_per_token.cu. x: [M, K] with strides (row_stride, col_stride); q: contiguous [M, K] E4M3 bytes, or
// [M, K] bf16 / fp16 values (`values`); scale: [M] fp32.
struct Fp8QuantPerTokenArgs {
  const void* x = nullptr;
  InDtype dtype = InDtype::kBF16;
  int64_t M = 0, K = 0;
  int64_t row_stride = 0, col_stride = 0;
  uint8_t* q = nullptr;
  float* scale = nullptr;
  Fp8Values values = Fp8Values::kCodes;
};
cudaError_t launch_fp8_quant_per_token(const Fp8QuantPerTokenArgs& a, cudaStream_t stream);

// fp8_quant_per_group.cu. x: [M, K] bf16/fp16 with row stride row_stride (elements, a multiple of 8) and unit
// column stride, K % 128 == 0; q: contiguous [M, K] E4M3 bytes; scale: contiguous [K/128, M] fp32 (one row of
// scales per 128-element group: the column-major [M, K/128] of a 1x128 blockwise-scaled GEMM).
struct Fp8QuantPerGroupArgs {
  const void* x = nullptr;
  InDtype dtype = InDtype::kBF16;
  int64_t M = 0, K = 0;
  int64_t row_stride = 0;
  uint8_t* q = nullptr;
  float* scale = nullptr;
};
cudaError_t launch_fp8_quant_per_group(const Fp8QuantPerGroupArgs& a, cudaStream_t stream);

// fp8_quant_per_tensor.cu. x: [M, K] view with strides (row_stride, col_stride); q: contiguous [M, K];
// static_scale: nullptr for the dynamic path (then workspace holds fp8_quant_per_tensor_workspace_floats(num_sms)
// floats); scale_out: one float, receives the scale used.
int64_t fp8_quant_per_tensor_workspace_floats(int num_sms);
struct Fp8QuantPerTensorArgs {
  const void* x = nullptr;
  InDtype dtype = InDtype::kBF16;
  int64_t M = 0, K = 0;
  int64_t row_stride = 0, col_stride = 0;
  uint8_t* q = nullptr;
  const float* static_scale = nullptr;
  float* scale_out = nullptr;
  float* workspace = nullptr;
  int num_sms = 0;
};
cudaError_t launch_fp8_quant_per_tensor(const Fp8QuantPerTensorArgs& a, cudaStream_t stream);

// mxfp8_quant.cu. quant: x [M, K] (K % 32 == 0) with strides (row_stride, col_stride); q contiguous [M, K]; codes
// contiguous [M, K/32]; rceil picks the scale rule.
struct Mxfp8QuantArgs {
  const void* x = nullptr;
  InDtype dtype = InDtype::kBF16;
  int64_t M = 0, K = 0;
  int64_t row_stride = 0, col_stride = 0;
  bool rceil = false;
  uint8_t* q = nullptr;
  uint8_t* codes = nullptr;
};
cudaError_t launch_mxfp8_quant(const Mxfp8QuantArgs& a, cudaStream_t stream);
// dequant: q [M, K] with strides (q_row_stride, q_col_stride), codes [M, K/32] with strides (codes_row_stride,
// codes_col_stride), out contiguous [M, K] of out_dtype (0 bf16, 1 fp16, 2 fp32).
struct Mxfp8DequantArgs {
  const uint8_t* q = nullptr;
  int64_t q_row_stride = 0, q_col_stride = 0;
  const uint8_t* codes = nullptr;
  int64_t codes_row_stride = 0, codes_col_stride = 0;
  int64_t M = 0, K = 0;
  int out_dtype = 0;
  void* out = nullptr;
};
cudaError_t launch_mxfp8_dequant(const Mxfp8DequantArgs& a, cudaStream_t stream);

// fp8_kv_cache_write.cu. key/value: [T, H, D] with strides (token, head, dim) in elements; caches: [num_blocks,
// block_size, H, D] bytes with strides (block, page, head, dim); slots: [T] int64; k_scale, v_scale: one float each
// on the device. With a query (not null), K is rounded query-aware (plugin/ops/fp8_kv_cache_write.py,
// fp8_kv_quant_query_aware_ref): query [>= T, H * R, D] with strides (q_ts, q_hs, q_ds) in elements, of key's dtype
// or E4M3 bytes (q_fp8); query heads g*R .. g*R+R-1 read KV head g. V is rounded to nearest either way. Bounds of
// the query-aware write: 1 <= R <= kKvQueryAwareMaxR, D <= kKvQueryAwareMaxD (one warp holds a head).
constexpr int64_t kKvQueryAwareMaxR = 16;
constexpr int64_t kKvQueryAwareMaxD = 256;
struct Fp8KvCacheWriteArgs {
  const void* key = nullptr;
  const void* value = nullptr;
  InDtype dtype = InDtype::kBF16;
  int64_t T = 0, H = 0, D = 0;
  int64_t k_ts = 0, k_hs = 0, k_ds = 0;  // key strides: token, head, dim
  int64_t v_ts = 0, v_hs = 0, v_ds = 0;  // value strides
  uint8_t* key_cache = nullptr;
  uint8_t* value_cache = nullptr;
  int64_t num_blocks = 0, block_size = 0;
  int64_t c_bs = 0, c_ps = 0, c_hs = 0, c_ds = 0;  // cache strides: block, page (slot in block), head, dim
  const int64_t* slots = nullptr;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  const void* query = nullptr;  // null: K rounded to nearest
  bool q_fp8 = false;
  int64_t R = 0;                         // query heads per KV head
  int64_t q_ts = 0, q_hs = 0, q_ds = 0;  // query strides: token, head, dim
};
cudaError_t launch_fp8_kv_cache_write(const Fp8KvCacheWriteArgs& a, cudaStream_t stream);

// moe_glue.cu (the MoE routing around fp4_gemm). route: ids [n = T*k] (int32, or int64 with ids64), entries
// outside [0, E) dropped; x [T, row_bytes] rows x_stride_bytes apart (both multiples of 16); writes xs [n,
// row_bytes] (the routed rows sorted by expert), offsets [E+1], pos [n], and src [n] (scratch: the row of each
// place).
constexpr int kMoeMaxExperts = 1024;
struct MoeRouteArgs {
  const void* ids = nullptr;
  bool ids64 = false;
  int64_t n = 0;
  int E = 0, k = 0;
  const void* x = nullptr;
  int64_t row_bytes = 0, x_stride_bytes = 0;
  void* xs = nullptr;
  int* offsets = nullptr;
  int* pos = nullptr;
  int* src = nullptr;
};
cudaError_t launch_moe_route(const MoeRouteArgs& a, cudaStream_t stream);
// finalize: y [T*k, H] (y_stride elements apart, H and y_stride multiples of 8), pos [T*k], w [T, k] contiguous ->
// out contiguous [T, H] of y's dtype.
struct MoeFinalizeArgs {
  const void* y = nullptr;
  InDtype y_dtype = InDtype::kBF16;
  int64_t y_stride = 0;
  const int* pos = nullptr;
  const void* w = nullptr;
  InDtype w_dtype = InDtype::kF32;
  int64_t T = 0;
  int k = 0;
  int64_t H = 0;
  void* out = nullptr;
};
cudaError_t launch_moe_finalize(const MoeFinalizeArgs& a, cudaStream_t stream);
// silu_mul: h [M, 2I] (rows h_stride elements apart; I and h_stride multiples of 8) -> out contiguous [M, I] of h's
// dtype (bf16 or fp16), out = silu(h[:, :I]) * h[:, I:] rounded as the two torch ops round.
struct SiluMulArgs {
  const void* h = nullptr;
  InDtype dtype = InDtype::kBF16;
  int64_t h_stride = 0;
  int64_t M = 0, I = 0;
  void* out = nullptr;
};
cudaError_t launch_silu_mul(const SiluMulArgs& a, cudaStream_t stream);

// rms_norm_fp8_quant.cu. x: [M, K] bf16 / fp16, rows x_row_stride elements apart (a multiple of 8, 16-byte aligned),
// unit column stride; K % 8 == 0, K <= kRmsNormFp8QuantMaxK; weight [K] and, where given, residual / residual_out
// contiguous [M, K] of x's dtype (residual == nullptr: no add). q: contiguous [M, K] E4M3 bytes; static_scale:
// one fp32 (nullptr: dynamic per token); scale: [M] fp32 (dynamic) or [1] (static: receives static_scale's value).
constexpr int64_t kRmsNormFp8QuantMaxK = 16384;
struct RmsNormFp8QuantArgs {
  const void* x = nullptr;
  const void* residual = nullptr;
  void* residual_out = nullptr;
  const void* weight = nullptr;
  InDtype dtype = InDtype::kBF16;
  int64_t M = 0, K = 0;
  int64_t x_row_stride = 0;
  float eps = 0.f;
  const float* static_scale = nullptr;
  uint8_t* q = nullptr;
  float* scale = nullptr;
};
cudaError_t launch_rms_norm_fp8_quant(const RmsNormFp8QuantArgs& a, cudaStream_t stream);

// silu_mul_fp8_quant.cu. x: [M, 2K] bf16 / fp16 (gate | up), rows x_row_stride elements apart (a multiple of 8,
// 16-byte aligned), unit column stride; K % 8 == 0, 8 <= K <= kSiluMulFp8QuantMaxK. q: contiguous [M, K] E4M3 bytes;
// static_scale: one fp32 (nullptr: dynamic per token); scale: [M] fp32 (dynamic) or [1] (static: receives
// static_scale's value). num_sms: the device's SM count (the CTAs-per-row rule); ctas_per_row: 0 for that rule, else
// 1..kSiluMulFp8QuantMaxCtas CTAs per row, each holding at most 2048 of the row's 16-byte vectors (benchmarks/tuning).
constexpr int kSiluMulFp8QuantMaxCtas = 8;
constexpr int64_t kSiluMulFp8QuantMaxK = 131072;  // 8 CTAs x 256 threads x 8 vectors x 8 elements
struct SiluMulFp8QuantArgs {
  const void* x = nullptr;
  InDtype dtype = InDtype::kBF16;
  int64_t M = 0, K = 0;
  int64_t x_row_stride = 0;
  const float* static_scale = nullptr;
  uint8_t* q = nullptr;
  float* scale = nullptr;
  int num_sms = 0;
  int ctas_per_row = 0;
};
cudaError_t launch_silu_mul_fp8_quant(const SiluMulFp8QuantArgs& a, cudaStream_t stream);

}  // namespace cublade
