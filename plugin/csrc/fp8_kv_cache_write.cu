// FP8 KV-cache write, vLLM's reshape_and_cache_flash for an fp8 (E4M3) cache:
//   key/value [T, H, D] -> key_cache/value_cache [num_blocks, block_size, H, D] at slot_mapping[t]
//   (slot = block * block_size + offset; slot < 0 is padding and skipped), q = e4m3(x / scale) with an
//   IEEE division and the satfinite conversion, the bytes vLLM's scaled_vec_conversion writes.
// Layout and the reasons: README.md, "fp8_kv_cache_write".
#define CUBLADE_KERNELS_ONLY  // the torch wrapper is in fp8_kv_cache_write_torch.cpp
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

// Vectors per thread (all loads issued before the first store): 4 for large launches, 1 for small ones, where
// spreading the items over more SMs matters more (T = 64 tokens of 8 x 128: 64 blocks instead of 16).
constexpr int64_t kUnrollFromItems = int64_t(1) << 20;

// Work item i = token * (2 * H * D/N) + j: vector j of the token, the first H*D/N of them K's, the rest V's; a
// vector is 16 bytes of input (8 bf16/fp16 or 4 fp32 elements) within one head. One-shot grid: block b owns
// items [b * kUnroll * 256, (b + 1) * kUnroll * 256), so a block covers several tokens when a token has fewer
// than 1024 vectors, and every data and slot load of a thread is in flight before its first store (the data
// addresses do not depend on the slot). kFast: both scales passed div_fast_ok.
template <InDtype T, bool kFast, int kUnroll>
__device__ __forceinline__ void kv_items(const KvArgs& a, int64_t base, float ks, float vs, float ky, float vy) {
  using E = typename Elem<T>::type;
  constexpr int N = Elem<T>::kPerVec;
  const int64_t nv_head = a.D / N, nv = a.H * nv_head, per_token = 2 * nv, total = a.T * per_token;
  uint4 v[kUnroll];
  int64_t slot[kUnroll], h[kUnroll], c[kUnroll];
  bool is_v[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t i = base + u * kMaxThreads;
    slot[u] = -1;
    if (i < total) {
      const int64_t t = i / per_token, j = i - t * per_token;
      is_v[u] = j >= nv;
      const int64_t jj = is_v[u] ? j - nv : j;
      h[u] = jj / nv_head;
      c[u] = (jj - h[u] * nv_head) * N;
      const E* src = is_v[u] ? static_cast<const E*>(a.value) + t * a.v_ts + h[u] * a.v_hs + c[u]
                             : static_cast<const E*>(a.key) + t * a.k_ts + h[u] * a.k_hs + c[u];
      v[u] = ld_nc_v4(src);
      slot[u] = __ldg(a.slots + t);
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (slot[u] < 0 || slot[u] >= a.num_slots) continue;  // padding (vLLM's -1), out of range, or no item
    const int64_t blk = slot[u] / a.block_size, off = slot[u] - blk * a.block_size;
    uint8_t* dst = (is_v[u] ? a.value_cache : a.key_cache) + blk * a.c_bs + off * a.c_ps + h[u] * a.c_hs + c[u];
    const float s = is_v[u] ? vs : ks, y = is_v[u] ? vy : ky;
    float f[N];
    vec_to_float<T>(v[u], f);
#pragma unroll
    for (int k = 0; k < N; ++k) f[k] = kv_div<kFast>(f[k], s, y);
    if constexpr (N == 8) {
      st_cs_v2(dst, make_uint2(f32x4_to_e4m3x4(f[0], f[1], f[2], f[3]), f32x4_to_e4m3x4(f[4], f[5], f[6], f[7])));
    } else {
      st_cs_u32(dst, f32x4_to_e4m3x4(f[0], f[1], f[2], f[3]));
    }
  }
}

template <InDtype T, int kUnroll>
__global__ void __launch_bounds__(kMaxThreads) kv_write_vec_kernel(const KvArgs a) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * (kMaxThreads * kUnroll) + threadIdx.x;
  const float ks = __ldg(a.k_scale), vs = __ldg(a.v_scale);
  if (div_fast_ok(ks) && div_fast_ok(vs)) {  // uniform over the launch
    kv_items<T, true, kUnroll>(a, base, ks, vs, __frcp_rn(ks), __frcp_rn(vs));
  } else {
    kv_items<T, false, kUnroll>(a, base, ks, vs, 0.0f, 0.0f);
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
    const int64_t items = a.T * 2 * a.H * (a.D / N);
    if (items >= kUnrollFromItems)
      kv_write_vec_kernel<T, 4><<<static_cast<unsigned>(ceil_div(items, kMaxThreads * 4)), kMaxThreads, 0, stream>>>(a);
    else
      kv_write_vec_kernel<T, 1><<<static_cast<unsigned>(ceil_div(items, kMaxThreads)), kMaxThreads, 0, stream>>>(a);
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
