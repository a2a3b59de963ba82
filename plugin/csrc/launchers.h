// Framework-free declarations shared by the kernels (*.cu, compiled by nvcc) and the torch wrappers
// (*.cpp, compiled by the host C++ compiler): input dtypes and the launchers of part A's ops.
// Every launcher takes raw pointers, sizes and strides in elements, launches on `stream`, never allocates,
// never synchronizes, and returns the launch's cudaError_t.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace cublade {

// Input element types the kernels take (activations, K/V).
enum class InDtype : int { kBF16 = 0, kF16 = 1, kF32 = 2 };

// fp8_quant_per_token.cu. x: [M, K] with strides (row_stride, col_stride); q: contiguous [M, K] E4M3 bytes;
// scale: [M] fp32.
cudaError_t launch_fp8_quant_per_token(const void* x, InDtype dtype, int64_t M, int64_t K, int64_t row_stride,
                                       int64_t col_stride, uint8_t* q, float* scale, cudaStream_t stream);

// fp8_quant_per_tensor.cu. x: [M, K] view with strides (rs, cs); q: contiguous [M, K]; static_scale: nullptr for
// the dynamic path (then workspace holds fp8_quant_per_tensor_workspace_floats(num_sms) floats); scale_out: one
// float, receives the scale used.
int64_t fp8_quant_per_tensor_workspace_floats(int num_sms);
cudaError_t launch_fp8_quant_per_tensor(const void* x, InDtype dtype, int64_t M, int64_t K, int64_t rs, int64_t cs,
                                        uint8_t* q, const float* static_scale, float* scale_out, float* workspace,
                                        int num_sms, cudaStream_t stream);

// mxfp8_quant.cu. quant: x [M, K] (K % 32 == 0) with strides (rs, cs); q contiguous [M, K]; codes contiguous
// [M, K/32]. dequant: q [M, K] with strides (q_rs, q_cs), codes [M, K/32] with strides (c_rs, c_cs), out
// contiguous [M, K] of out_dtype (0 bf16, 1 fp16, 2 fp32).
cudaError_t launch_mxfp8_quant(const void* x, InDtype dtype, int64_t M, int64_t K, int64_t rs, int64_t cs, bool rceil,
                               uint8_t* q, uint8_t* codes, cudaStream_t stream);
cudaError_t launch_mxfp8_dequant(const uint8_t* q, int64_t q_rs, int64_t q_cs, const uint8_t* codes, int64_t c_rs,
                                 int64_t c_cs, int64_t M, int64_t K, int out_dtype, void* out, cudaStream_t stream);

// fp8_kv_cache_write.cu. key/value: [T, H, D] with strides (token, head, dim); caches: [num_blocks, block_size,
// H, D] bytes with strides (block, page, head, dim); slots: [T] int64; k_scale, v_scale: one float each on the
// device.
cudaError_t launch_fp8_kv_cache_write(const void* key, const void* value, InDtype dtype, int64_t T, int64_t H,
                                      int64_t D, int64_t k_ts, int64_t k_hs, int64_t k_ds, int64_t v_ts,
                                      int64_t v_hs, int64_t v_ds, uint8_t* key_cache, uint8_t* value_cache,
                                      int64_t num_blocks, int64_t block_size, int64_t c_bs, int64_t c_ps,
                                      int64_t c_hs, int64_t c_ds, const int64_t* slots, const float* k_scale,
                                      const float* v_scale, cudaStream_t stream);
// The same write with K rounded query-aware (plugin/ops/fp8_kv_cache_write.py, fp8_kv_quant_query_aware_ref) when
// query is not null: query [>= T, H * R, D] with strides (q_ts, q_hs, q_ds) in elements, of key's dtype or E4M3
// bytes (q_fp8); query heads g*R .. g*R+R-1 read KV head g. V is rounded to nearest either way; a null query is
// launch_fp8_kv_cache_write. Bounds: 1 <= R <= kKvQueryAwareMaxR, D <= kKvQueryAwareMaxD (one warp holds a head).
constexpr int64_t kKvQueryAwareMaxR = 16;
constexpr int64_t kKvQueryAwareMaxD = 256;
cudaError_t launch_fp8_kv_cache_write_query_aware(const void* key, const void* value, InDtype dtype, int64_t T,
                                                  int64_t H, int64_t D, int64_t k_ts, int64_t k_hs, int64_t k_ds,
                                                  int64_t v_ts, int64_t v_hs, int64_t v_ds, const void* query,
                                                  bool q_fp8, int64_t R, int64_t q_ts, int64_t q_hs, int64_t q_ds,
                                                  uint8_t* key_cache, uint8_t* value_cache, int64_t num_blocks,
                                                  int64_t block_size, int64_t c_bs, int64_t c_ps, int64_t c_hs,
                                                  int64_t c_ds, const int64_t* slots, const float* k_scale,
                                                  const float* v_scale, cudaStream_t stream);

// moe_glue.cu (the MoE routing around fp4_gemm). route: ids [n = T*k] (int32, or int64 with ids64), entries
// outside [0, E) dropped; x [T, row_bytes] rows x_stride_bytes apart (both multiples of 16); writes xs [n,
// row_bytes] (the routed rows sorted by expert), offsets [E+1], pos [n], and src [n] (scratch: the row of each
// place). finalize: y [n, H] (y_stride elements apart, H and y_stride multiples of 8), pos [n], w [T, k]
// contiguous -> out contiguous [T, H] of y's dtype.
constexpr int kMoeMaxExperts = 1024;
cudaError_t launch_moe_route(const void* ids, bool ids64, int64_t n, int E, int k, const void* x, int64_t row_bytes,
                             int64_t x_stride_bytes, void* xs, int* offsets, int* pos, int* src, cudaStream_t stream);
cudaError_t launch_moe_finalize(const void* y, InDtype y_dtype, int64_t y_stride, const int* pos, const void* w,
                                InDtype w_dtype, int64_t T, int k, int64_t H, void* out, cudaStream_t stream);
// silu_mul: h [M, 2I] (rows h_stride elements apart; I and h_stride multiples of 8) -> out contiguous [M, I] of h's
// dtype (bf16 or fp16), out = silu(h[:, :I]) * h[:, I:] rounded as the two torch ops round.
cudaError_t launch_silu_mul(const void* h, InDtype dtype, int64_t h_stride, int64_t M, int64_t I, void* out,
                            cudaStream_t stream);

}  // namespace cublade
