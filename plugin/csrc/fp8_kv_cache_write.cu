// FP8 KV-cache write, vLLM's reshape_and_cache_flash for an fp8 (E4M3) cache:
//   key/value [T, H, D] -> key_cache/value_cache [num_blocks, block_size, H, D] at slot_mapping[t]
//   (slot = block * block_size + offset; slot < 0 is padding and skipped), q = e4m3(x / scale) with an
//   IEEE division and the satfinite conversion, the bytes vLLM's scaled_vec_conversion writes.
// Layout and the reasons: docs/kernels.md, "fp8_kv_cache_write".
#define CUBLADE_KERNELS_ONLY  // framework-free (no torch header); the torch wrapper is fp8_kv_cache_write_torch.cpp
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

// ---- Query-aware K rounding (a query given) ---------------------------------------------------------------
// Bit-exact to fp8_kv_quant_query_aware_ref (plugin/ops/fp8_kv_cache_write.py): one warp per (token, KV head),
// lane l holds elements d = l + 32 j (j < J), the layout the reference's order of sums is written for. Every
// product and sum is a separate __fmul_rn / __fadd_rn / __fsub_rn: the reference rounds each torch op to fp32,
// and nvcc would otherwise contract a * b + c into one FFMA (one rounding).
constexpr int kQaWarps = 4;     // warps per block (128 threads): a decode batch of T * H warps spreads over SMs
constexpr int kQaMaxFlips = 8;  // KV_QUERY_AWARE_MAX_FLIPS

struct QaArgs {
  KvArgs kv;
  const void* query;
  int64_t q_ts, q_hs, q_ds;  // query strides (elements)
  int R;                     // query heads per KV head: heads g*R .. g*R+R-1 read KV head g
};

// One element as fp32 (exact): of kind T, or an E4M3 byte when kFp8.
template <InDtype T, bool kFp8>
__device__ __forceinline__ float qa_load(const void* base, int64_t off) {
  if constexpr (kFp8) {
    return e4m3x2_to_f32x2(__ldg(static_cast<const uint8_t*>(base) + off)).x;
  } else {
    using E = typename Elem<T>::type;
    return Elem<T>::to_float(__ldg(static_cast<const E*>(base) + off));
  }
}

// True when lane + 32 j is an element: D > 32 (J - 1) (the launcher picks J so), so only the last j has lanes
// past D.
template <int J>
__device__ __forceinline__ bool qa_in(int j, int lane, int64_t D) { return j < J - 1 || lane + 32 * j < D; }

// The warp's loads: key and value [J] and its query heads [RP][J], zero past D and past R. All are issued before
// the caller looks at the slot (no address depends on it): a decode launch waits for memory once.
template <InDtype T, bool kQ8, int J, int RP>
__device__ __forceinline__ void qa_load_all(const QaArgs& a, int64_t t, int64_t g, int lane, float (&k)[J],
                                            float (&v)[J], float (&q)[RP][J]) {
  const KvArgs& kv = a.kv;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int64_t d = lane + 32 * j;
    const bool in = qa_in<J>(j, lane, kv.D);
    k[j] = in ? qa_load<T, false>(kv.key, t * kv.k_ts + g * kv.k_hs + d * kv.k_ds) : 0.0f;
    v[j] = in ? qa_load<T, false>(kv.value, t * kv.v_ts + g * kv.v_hs + d * kv.v_ds) : 0.0f;
#pragma unroll
    for (int h = 0; h < RP; ++h)
      q[h][j] = in && h < a.R ? qa_load<T, kQ8>(a.query, t * a.q_ts + (g * a.R + h) * a.q_hs + d * a.q_ds) : 0.0f;
  }
}

// sum_h v[h]^2 in order of h (the reference's norm). Heads R .. RP-1 (padding up to the kernel's RP) hold +-0
// or NaN (their query is 0; NaN only from a NaN e0, which makes every real head NaN too): their +0 squares leave
// every sum as it was.
template <int RP>
__device__ __forceinline__ float qa_norm(const float (&v)[RP]) {
  float acc = __fmul_rn(v[0], v[0]);
#pragma unroll
  for (int h = 1; h < RP; ++h) acc = __fadd_rn(acc, __fmul_rn(v[h], v[h]));
  return acc;
}

// A candidate's norm n (>= 0, or NaN) as an ordered key, as the reference orders them: NaN reads as +inf. Floats
// >= 0 order like their bits.
__device__ __forceinline__ uint32_t qa_key(float n) { return isnan(n) ? 0x7F800000u : __float_as_uint(n); }

// The search, for one (token, KV head) per warp. The reference's new[h] = res[h] + q[h, d] * delta[d] takes the
// product p[h][j] = q * delta, which a flip of d negates exactly (RN is symmetric), so the warp keeps p instead
// of q: a step is then per lane J * RP additions and J norms (RP products, RP - 1 sums), a lane-local argmin, two
// redux.sync (the least key, then the least d holding it) and RP shuffles of the winner's column. That chain of at
// most 8 steps bounds the time at decode; no shared memory.
template <int J, int RP>
__device__ __forceinline__ void qa_warp(const QaArgs& a, int lane, int64_t slot, int64_t g, float ks, float vs,
                                        const float (&k)[J], const float (&v)[J], const float (&q)[RP][J]) {
  const KvArgs& kv = a.kv;
  constexpr uint32_t kAll = 0xFFFFFFFFu;
  const int64_t blk = slot / kv.block_size, off = slot - blk * kv.block_size;
  uint8_t* kdst = kv.key_cache + blk * kv.c_bs + off * kv.c_ps + g * kv.c_hs + lane * kv.c_ds;
  uint8_t* vdst = kv.value_cache + blk * kv.c_bs + off * kv.c_ps + g * kv.c_hs + lane * kv.c_ds;
  // V first (round to nearest: the RTN kernels' bytes), which frees its registers before the search.
#pragma unroll
  for (int j = 0; j < J; ++j)
    if (qa_in<J>(j, lane, kv.D)) vdst[32 * j * kv.c_ds] = f32_to_e4m3(__fdiv_rn(v[j], vs));

  // Per element, with xs = clamp(k / ks, +-448): r = the nearest code, o = _other_neighbour, e0 = r - xs,
  // e1 = o - xs, delta = e1 - e0 (past D: the reference's zero padding, so products of +0).
  uint32_t codes[J];  // r | o << 8
  float e0[J], delta[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    float xs = __fdiv_rn(k[j], ks);
    xs = xs > kF8E4M3Max ? kF8E4M3Max : (xs < -kF8E4M3Max ? -kF8E4M3Max : xs);  // torch.clamp: NaN stays NaN
    const uint32_t rc = f32_to_e4m3(xs);  // torch's .to(float8_e4m3fn) after the clamp (a NaN's sign aside)
    const float rf = e4m3x2_to_f32x2(static_cast<uint16_t>(rc)).x;
    // E4M3 magnitudes are ordered like their 7-bit codes: the neighbour is the code +-1, 0x7E (448) the last.
    const uint32_t mag = rc & 0x7Fu;
    const uint32_t oc = (fabsf(rf) < fabsf(xs) ? min(mag + 1u, 0x7Eu) : (mag == 0u ? 0u : mag - 1u)) | (rc & 0x80u);
    codes[j] = rc | oc << 8;
    const float e1 = __fsub_rn(e4m3x2_to_f32x2(static_cast<uint16_t>(oc)).x, xs);
    const bool in = qa_in<J>(j, lane, kv.D);
    e0[j] = in ? __fsub_rn(rf, xs) : 0.0f;
    delta[j] = in ? __fsub_rn(e1, e0[j]) : 0.0f;
  }
  // res[h]: the lane's products in order of j, then the xor butterfly; a + b is commutative, so every lane ends
  // with the same bits.
  float res[RP], p[RP][J];
#pragma unroll
  for (int h = 0; h < RP; ++h) {
    float acc = __fmul_rn(q[h][0], e0[0]);
#pragma unroll
    for (int j = 1; j < J; ++j) acc = __fadd_rn(acc, __fmul_rn(q[h][j], e0[j]));
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(kAll, acc, m));
    res[h] = acc;
#pragma unroll
    for (int j = 0; j < J; ++j) p[h][j] = __fmul_rn(q[h][j], delta[j]);
  }
  float cur = qa_norm<RP>(res);
  uint32_t flips = 0;  // bit j: element lane + 32 j holds o
#pragma unroll 1       // a step is J * RP wide already
  for (int step = 0; step < kQaMaxFlips; ++step) {
    uint32_t best = kAll;  // above every key: elements past D never win
    int jb = 0;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      float nw[RP];
#pragma unroll
      for (int h = 0; h < RP; ++h) nw[h] = __fadd_rn(res[h], p[h][j]);
      const uint32_t key = qa_in<J>(j, lane, kv.D) ? qa_key(qa_norm<RP>(nw)) : kAll;
      if (key < best) best = key, jb = j;  // strict: the lowest j among the lane's least keys
    }
    const uint32_t least = __reduce_min_sync(kAll, best);
    const uint32_t dstar = __reduce_min_sync(kAll, best == least ? static_cast<uint32_t>(lane + 32 * jb) : kAll);
    if (!(__uint_as_float(least) < cur)) break;  // uniform: every lane holds the same least and cur
    const int src = dstar & 31, js = dstar >> 5;
    float pb[RP];
#pragma unroll
    for (int j = 0; j < J; ++j) {
      if (j == js) {  // uniform: js is the same in every lane (J branches instead of RP * J selects)
#pragma unroll
        for (int h = 0; h < RP; ++h) pb[h] = __shfl_sync(kAll, p[h][j], src);
        if (lane == src) {
          // The flipped element's delta is now e0 - e1: -(e1 - e0) but for a zero's sign (e1 == e0 gives +0 both
          // ways), which reaches res only as the sign of a zero sum, never a square, a key or a choice.
#pragma unroll
          for (int h = 0; h < RP; ++h) p[h][j] = -p[h][j];
          flips ^= 1u << j;
        }
      }
    }
#pragma unroll
    for (int h = 0; h < RP; ++h) res[h] = __fadd_rn(res[h], pb[h]);  // new[h] of d*: the winner's own sums
    cur = __uint_as_float(least);
  }
#pragma unroll
  for (int j = 0; j < J; ++j)
    if (qa_in<J>(j, lane, kv.D)) kdst[32 * j * kv.c_ds] = static_cast<uint8_t>(codes[j] >> (flips >> j & 1u ? 8 : 0));
}

// Min 1 block per SM in the bounds: with the thread count alone ptxas aimed at occupancy steps (64, 72, 80
// registers) and spilled 4-176 bytes in a third of the instantiations.
template <int J, int RP>
__global__ void __launch_bounds__(kQaWarps * 32, 1) kv_write_query_aware_kernel(const QaArgs a, InDtype dtype,
                                                                              bool q_fp8) {
  const int lane = threadIdx.x & 31;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kQaWarps + (threadIdx.x >> 5);
  if (w >= a.kv.T * a.kv.H) return;  // whole warps
  const int64_t t = w / a.kv.H, g = w - t * a.kv.H;
  const int64_t slot = __ldg(a.kv.slots + t);
  const float ks = __ldg(a.kv.k_scale), vs = __ldg(a.kv.v_scale);
  float k[J], v[J], q[RP][J];
  // Uniform over the launch. Only the loads depend on the dtypes (the rest is fp32), so the dtypes are not
  // template parameters of the kernel: 5 x 8 instantiations rather than 30 x 8.
  switch (dtype) {
    case InDtype::kBF16:
      q_fp8 ? qa_load_all<InDtype::kBF16, true, J, RP>(a, t, g, lane, k, v, q)
            : qa_load_all<InDtype::kBF16, false, J, RP>(a, t, g, lane, k, v, q);
      break;
    case InDtype::kF16:
      q_fp8 ? qa_load_all<InDtype::kF16, true, J, RP>(a, t, g, lane, k, v, q)
            : qa_load_all<InDtype::kF16, false, J, RP>(a, t, g, lane, k, v, q);
      break;
    default:
      q_fp8 ? qa_load_all<InDtype::kF32, true, J, RP>(a, t, g, lane, k, v, q)
            : qa_load_all<InDtype::kF32, false, J, RP>(a, t, g, lane, k, v, q);
      break;
  }
  if (slot < 0 || slot >= a.kv.num_slots) return;  // padding (vLLM's -1) or past the cache, as the RTN kernels
  qa_warp<J, RP>(a, lane, slot, g, ks, vs, k, v, q);
}

template <int J>
cudaError_t launch_query_aware_j(const QaArgs& a, InDtype dtype, bool q_fp8, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(ceil_div(a.kv.T * a.kv.H, kQaWarps));
  const int threads = kQaWarps * 32;
  // Heads per KV head rounded up to a power of two (the extra heads get a zero query, which changes no sum):
  // 1, 2, 4, 8 cover MHA and the usual GQA ratios exactly (Llama-3 8B/70B: 4 and 8); 3, 5-7 and 9-16 pay
  // for the padding.
  if (a.R <= 1) kv_write_query_aware_kernel<J, 1><<<blocks, threads, 0, stream>>>(a, dtype, q_fp8);
  else if (a.R <= 2) kv_write_query_aware_kernel<J, 2><<<blocks, threads, 0, stream>>>(a, dtype, q_fp8);
  else if (a.R <= 4) kv_write_query_aware_kernel<J, 4><<<blocks, threads, 0, stream>>>(a, dtype, q_fp8);
  else if (a.R <= 8) kv_write_query_aware_kernel<J, 8><<<blocks, threads, 0, stream>>>(a, dtype, q_fp8);
  else kv_write_query_aware_kernel<J, 16><<<blocks, threads, 0, stream>>>(a, dtype, q_fp8);
  return cudaGetLastError();
}

}  // namespace

// key/value: [T, H, D] with strides (token, head, dim) in elements; caches: [num_blocks, block_size, H, D] bytes
// with strides (block, page, head, dim); slots: [T] int64; k_scale, v_scale: one float each on the device. K is
// rounded query-aware when query is not null: query [>= T, H * R, D] with strides (q_ts, q_hs, q_ds), of key's dtype
// or E4M3 bytes (q_fp8); 1 <= R <= kKvQueryAwareMaxR, D <= kKvQueryAwareMaxD.
cudaError_t launch_fp8_kv_cache_write(const Fp8KvCacheWriteArgs& args, cudaStream_t stream) {
  const int64_t T = args.T, H = args.H, D = args.D, R = args.R;
  const InDtype dtype = args.dtype;
  if (T == 0 || H == 0 || D == 0) return cudaSuccess;
  const KvArgs kv{args.key, args.value, T, H, D,
                  args.k_ts, args.k_hs, args.k_ds,
                  args.v_ts, args.v_hs, args.v_ds,
                  args.key_cache, args.value_cache,
                  args.num_blocks * args.block_size, args.block_size,
                  args.c_bs, args.c_ps, args.c_hs, args.c_ds,
                  args.slots, args.k_scale, args.v_scale};
  if (dtype != InDtype::kBF16 && dtype != InDtype::kF16 && dtype != InDtype::kF32) return cudaErrorInvalidValue;
  if (args.query == nullptr) {
    switch (dtype) {
      case InDtype::kBF16: return launch_typed<InDtype::kBF16>(kv, stream);
      case InDtype::kF16: return launch_typed<InDtype::kF16>(kv, stream);
      case InDtype::kF32: return launch_typed<InDtype::kF32>(kv, stream);
    }
  }
  if (R < 1 || R > kKvQueryAwareMaxR || D > kKvQueryAwareMaxD) return cudaErrorInvalidValue;
  const QaArgs a{kv, args.query, args.q_ts, args.q_hs, args.q_ds, static_cast<int>(R)};
  const bool q_fp8 = args.q_fp8;
  // J = elements per lane: every D up to 256 runs the J that fits it exactly (lanes past D idle in the last j).
  switch ((D + 31) / 32) {
    case 1: return launch_query_aware_j<1>(a, dtype, q_fp8, stream);
    case 2: return launch_query_aware_j<2>(a, dtype, q_fp8, stream);
    case 3: return launch_query_aware_j<3>(a, dtype, q_fp8, stream);
    case 4: return launch_query_aware_j<4>(a, dtype, q_fp8, stream);
    case 5: return launch_query_aware_j<5>(a, dtype, q_fp8, stream);
    case 6: return launch_query_aware_j<6>(a, dtype, q_fp8, stream);
    case 7: return launch_query_aware_j<7>(a, dtype, q_fp8, stream);
    default: return launch_query_aware_j<8>(a, dtype, q_fp8, stream);
  }
}

}  // namespace cublade
