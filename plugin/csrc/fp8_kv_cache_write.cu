// FP8 KV-cache write, vLLM's reshape_and_cache_flash for an fp8 (E4M3) cache:
//   key/value [T, H, D] -> key_cache/value_cache [num_blocks, block_size, H, D] at slot_mapping[t]
//   (slot = block * block_size + offset; slot < 0 is padding and skipped), q = e4m3(x / scale) with an
//   IEEE division and the satfinite conversion, the bytes vLLM's scaled_vec_conversion writes.
// Layout and the reasons: README.md, "fp8_kv_cache_write".
#include "common.cuh"

namespace cublade {
namespace {

constexpr int kMaxThreads = 256;

struct KvArgs {
  const void* key;
  const void* value;
  int64_t T, H, D;
  int64_t k_ts, k_hs, k_ds;  // key strides: token, head, dim (elements)
  int64_t v_ts, v_hs, v_ds;
  uint8_t* key_cache;
  uint8_t* value_cache;
  int64_t num_slots, block_size;
  int64_t c_bs, c_ps, c_hs, c_ds;  // cache strides: block, page (slot in block), head, dim (bytes)
  const int64_t* slots;
  const float* k_scale;
  const float* v_scale;
};

// x / s for one element, exactly __fdiv_rn(x, s). kFast: s passed div_fast_ok; an x that is not finite,
// or whose x * (1/s) overflows, keeps x * (1/s) (+-inf or NaN: the same E4M3 byte as the true quotient
// after saturation: +-448 or NaN).
template <bool kFast>
__device__ __forceinline__ float kv_div(float x, float s, float y) {
  if constexpr (kFast) {
    const float q0 = __fmul_rn(x, y);
    return isfinite(q0) ? div_rn_fast(x, s, y) : q0;
  } else {
    return __fdiv_rn(x, s);
  }
}

// One block per token; the first half of the vectors are K's, the second V's. A vector is 16 bytes of
// input (8 bf16/fp16 or 4 fp32 elements) within one head.
template <InDtype T, bool kFast>
__device__ __forceinline__ void kv_token_vec(const KvArgs& a, int64_t token, int64_t blk, int64_t off, float ks,
                                             float vs, float ky, float vy) {
  using E = typename Elem<T>::type;
  constexpr int N = Elem<T>::kPerVec;
  const int64_t nv_head = a.D / N, nv = a.H * nv_head;
  for (int64_t j = threadIdx.x; j < 2 * nv; j += blockDim.x) {
    const bool is_v = j >= nv;
    const int64_t jj = is_v ? j - nv : j;
    const int64_t h = jj / nv_head, c = (jj % nv_head) * N;
    const E* src = is_v ? static_cast<const E*>(a.value) + token * a.v_ts + h * a.v_hs + c
                        : static_cast<const E*>(a.key) + token * a.k_ts + h * a.k_hs + c;
    uint8_t* dst = (is_v ? a.value_cache : a.key_cache) + blk * a.c_bs + off * a.c_ps + h * a.c_hs + c;
    const float s = is_v ? vs : ks, y = is_v ? vy : ky;
    float f[N];
    vec_to_float<T>(ld_nc_na_v4(src), f);
#pragma unroll
    for (int i = 0; i < N; ++i) f[i] = kv_div<kFast>(f[i], s, y);
    if constexpr (N == 8) {
      st_cs_v2(dst, make_uint2(f32x4_to_e4m3x4(f[0], f[1], f[2], f[3]), f32x4_to_e4m3x4(f[4], f[5], f[6], f[7])));
    } else {
      st_cs_u32(dst, f32x4_to_e4m3x4(f[0], f[1], f[2], f[3]));
    }
  }
}

template <InDtype T>
__global__ void __launch_bounds__(kMaxThreads) kv_write_vec_kernel(const KvArgs a) {
  const int64_t token = blockIdx.x;
  const int64_t slot = a.slots[token];
  if (slot < 0 || slot >= a.num_slots) return;  // padding (vLLM's -1); out of range: never write outside
  const int64_t blk = slot / a.block_size, off = slot % a.block_size;
  const float ks = __ldg(a.k_scale), vs = __ldg(a.v_scale);
  if (div_fast_ok(ks) && div_fast_ok(vs)) {  // uniform over the launch
    kv_token_vec<T, true>(a, token, blk, off, ks, vs, __frcp_rn(ks), __frcp_rn(vs));
  } else {
    kv_token_vec<T, false>(a, token, blk, off, ks, vs, 0.0f, 0.0f);
  }
}

// Fallback (D not a multiple of the vector width, unaligned or dim-strided views): one element per thread.
template <InDtype T>
__global__ void __launch_bounds__(kMaxThreads) kv_write_scalar_kernel(const KvArgs a) {
  using E = typename Elem<T>::type;
  const int64_t token = blockIdx.x;
  const int64_t slot = a.slots[token];
  if (slot < 0 || slot >= a.num_slots) return;
  const int64_t blk = slot / a.block_size, off = slot % a.block_size;
  const float ks = __ldg(a.k_scale), vs = __ldg(a.v_scale);
  const int64_t n = a.H * a.D;
  for (int64_t j = threadIdx.x; j < 2 * n; j += blockDim.x) {
    const bool is_v = j >= n;
    const int64_t jj = is_v ? j - n : j;
    const int64_t h = jj / a.D, d = jj % a.D;
    const float x = is_v ? Elem<T>::to_float(static_cast<const E*>(a.value)[token * a.v_ts + h * a.v_hs + d * a.v_ds])
                         : Elem<T>::to_float(static_cast<const E*>(a.key)[token * a.k_ts + h * a.k_hs + d * a.k_ds]);
    uint8_t* dst = (is_v ? a.value_cache : a.key_cache) + blk * a.c_bs + off * a.c_ps + h * a.c_hs + d * a.c_ds;
    *dst = f32_to_e4m3(__fdiv_rn(x, is_v ? vs : ks));
  }
}

template <InDtype T>
cudaError_t launch_typed(const KvArgs& a, cudaStream_t stream) {
  constexpr int N = Elem<T>::kPerVec;
  const int es = sizeof(typename Elem<T>::type);
  const bool fast = a.k_ds == 1 && a.v_ds == 1 && a.c_ds == 1 && a.D % N == 0 && a.k_ts % N == 0 &&
                    a.k_hs % N == 0 && a.v_ts % N == 0 && a.v_hs % N == 0 && is_aligned(a.key, 16) &&
                    is_aligned(a.value, 16) &&
                    // fp8 stores of N bytes: cache offsets must be N-aligned
                    a.c_bs % N == 0 && a.c_ps % N == 0 && a.c_hs % N == 0 && is_aligned(a.key_cache, N) &&
                    is_aligned(a.value_cache, N) && es * N == 16;
  if (fast) {
    const int64_t vecs = 2 * a.H * (a.D / N);
    const int threads = static_cast<int>(std::min<int64_t>(kMaxThreads, ceil_div(vecs, 32) * 32));
    kv_write_vec_kernel<T><<<static_cast<unsigned>(a.T), threads, 0, stream>>>(a);
  } else {
    const int threads = static_cast<int>(std::min<int64_t>(kMaxThreads, ceil_div(2 * a.H * a.D, 32) * 32));
    kv_write_scalar_kernel<T><<<static_cast<unsigned>(a.T), threads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace

// key/value: [T, H, D] with strides (token, head, dim) in elements; caches: [num_blocks, block_size, H, D] bytes
// with strides (block, page, head, dim); slots: [T] int64; k_scale, v_scale: one float each on the device.
cudaError_t launch_fp8_kv_cache_write(const void* key, const void* value, InDtype dtype, int64_t T, int64_t H,
                                      int64_t D, int64_t k_ts, int64_t k_hs, int64_t k_ds, int64_t v_ts,
                                      int64_t v_hs, int64_t v_ds, uint8_t* key_cache, uint8_t* value_cache,
                                      int64_t num_blocks, int64_t block_size, int64_t c_bs, int64_t c_ps,
                                      int64_t c_hs, int64_t c_ds, const int64_t* slots, const float* k_scale,
                                      const float* v_scale, cudaStream_t stream) {
  if (T == 0 || H == 0 || D == 0) return cudaSuccess;
  const KvArgs a{key, value, T, H, D, k_ts, k_hs, k_ds, v_ts, v_hs, v_ds, key_cache, value_cache,
                 num_blocks * block_size, block_size, c_bs, c_ps, c_hs, c_ds, slots, k_scale, v_scale};
  switch (dtype) {
    case InDtype::kBF16: return launch_typed<InDtype::kBF16>(a, stream);
    case InDtype::kF16: return launch_typed<InDtype::kF16>(a, stream);
    case InDtype::kF32: return launch_typed<InDtype::kF32>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cublade

#ifndef CUBLADE_LAUNCHER_ONLY
#include <ATen/ATen.h>
#include <torch/library.h>

namespace cublade {
namespace {

void fp8_kv_cache_write(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                        at::Tensor& value_cache, const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                        const at::Tensor& v_scale) {
  constexpr const char* op = "fp8_kv_cache_write";
  const InDtype dt = in_dtype_of(op, "key", key);
  CUBLADE_CHECK_VALUE(value.scalar_type() == key.scalar_type(), op, "value dtype ", value.scalar_type(),
                      " differs from key dtype ", key.scalar_type());
  CUBLADE_CHECK_VALUE(key.dim() == 3, op, "key must be [num_tokens, num_heads, head_size], got shape ", key.sizes());
  CUBLADE_CHECK_VALUE(value.sizes() == key.sizes(), op, "value shape ", value.sizes(), " differs from key shape ",
                      key.sizes());
  for (const at::Tensor* c : {&key_cache, &value_cache}) {
    CUBLADE_CHECK_NOT_IMPLEMENTED(c->scalar_type() == at::kFloat8_e4m3fn || c->scalar_type() == at::kByte, op,
                                  "caches must be float8_e4m3fn or uint8 (E4M3 bytes), got ", c->scalar_type());
    CUBLADE_CHECK_VALUE(c->dim() == 4 && c->size(2) == key.size(1) && c->size(3) == key.size(2), op,
                        "caches must be [num_blocks, block_size, ", key.size(1), ", ", key.size(2),
                        "] for key of shape ", key.sizes(), ", got ", c->sizes());
    CUBLADE_CHECK_VALUE(c->device() == key.device(), op, "caches must be on ", key.device(), ", got ", c->device());
  }
  CUBLADE_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), op, "value_cache shape ", value_cache.sizes(),
                      " differs from key_cache shape ", key_cache.sizes());
  CUBLADE_CHECK_VALUE(value_cache.strides() == key_cache.strides(), op, "value_cache strides ",
                      value_cache.strides(), " differ from key_cache strides ", key_cache.strides());
  CUBLADE_CHECK_VALUE(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1, op,
                      "slot_mapping must be 1-D int64, got ", slot_mapping.scalar_type(), " of shape ",
                      slot_mapping.sizes());
  // vLLM pads key/value but not slot_mapping: the slots count the tokens.
  CUBLADE_CHECK_VALUE(slot_mapping.size(0) <= key.size(0), op, "slot_mapping has ", slot_mapping.size(0),
                      " entries but key has only ", key.size(0), " tokens");
  CUBLADE_CHECK_VALUE(slot_mapping.device() == key.device(), op, "slot_mapping must be on ", key.device(),
                      ", got ", slot_mapping.device());
  check_scale_tensor(op, "k_scale", k_scale, key);
  check_scale_tensor(op, "v_scale", v_scale, key);
  check_arch(op, key);
  const c10::cuda::CUDAGuard guard(key.device());
  const at::Tensor slots = slot_mapping.contiguous();
  check_launch(op, launch_fp8_kv_cache_write(
                       key.data_ptr(), value.data_ptr(), dt, slots.size(0), key.size(1), key.size(2), key.stride(0),
                       key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
                       static_cast<uint8_t*>(key_cache.data_ptr()), static_cast<uint8_t*>(value_cache.data_ptr()),
                       key_cache.size(0), key_cache.size(1), key_cache.stride(0), key_cache.stride(1),
                       key_cache.stride(2), key_cache.stride(3), slots.data_ptr<int64_t>(),
                       k_scale.data_ptr<float>(), v_scale.data_ptr<float>(), current_stream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(cublade, CUDA, m) { m.impl("fp8_kv_cache_write", &fp8_kv_cache_write); }

}  // namespace cublade
#endif  // CUBLADE_LAUNCHER_ONLY
