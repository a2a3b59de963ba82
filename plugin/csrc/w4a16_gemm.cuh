// Weight-streaming GEMM core shared by w4a16_gemm.cu (int4 weights) and fp4_gemm.cu (FP4 E2M1 weights):
// y[M, N] = x[M, K] @ W[N, K]^T for small M (decode), memory-bound on the 4-bit weights.
//
// Repacked weights (both ops; the Python repack writes them: plugin/ops/w4a16_gemm.py, fp4_gemm.py):
//   blob int32 [experts][tile groups = ceil(N/64)][chunks = ceil(K/512)][4 tiles][tile block]
//   tile block = 8 packets of 512 bytes (1024 for 8-bit weights), then the scale records those 512 K need (sbytes)
// N and K are zero-padded to whole tile groups / chunks. A packet is 16 rows x 64 K; word s (0..3) of lane
// (g = lane/4, t = lane%4) is the A fragment of one mma.m16n8k16 k-step: rows g and g+8 at the 4 K
//     K0(s) = 64*packet + 32*(s/2) + 8*t + 4*(s%2) .. +3
// (the mma's k index is permuted; x is read with the same permutation, so the sum is unchanged). With this
// permutation one 16-byte x read per lane gives the B fragments of two k-steps (x[tok][32*half + 8t .. +8]),
// and each 32-K half of a packet is closed under the mma's reduction, so per-group scales (groups >= 32) can
// be applied to an fp32 partial sum. The weight is the mma's A operand (16 rows of N), the tokens are B
// (8 per n-tile): the "swapped" orientation keeps 16 weight rows per instruction even at M = 1.
//
// Schedule (one CTA = 4 consumer warps + 1 producer warp, one tile group = 64 rows):
//   * the CTA covers the chunks of split blockIdx.y of K; consumer warp w owns TPW tiles of the group over a
//     1/TPW slice of every chunk (TPW = 1: tile w, all of it; see stream_gemm_kernel); the slices of a tile are
//     added through shared memory, and the splits of one group form a thread-block cluster and add up their
//     fp32 partials through distributed shared memory (no workspace, no atomics, one launch);
//   * the producer warp streams the CTA's share into a ring of shared-memory stages with the bulk-copy engine
//     (cp.async.bulk, completion counted in bytes on an mbarrier): per stage ONE 17 KB copy (the 4 tile blocks
//     of a chunk, contiguous by construction of the layout) and one copy per x row of the token pass (issued
//     by the producer's lanes in parallel; the rows are shared by the 4 consumers);
//   * consumers wait on a stage's "full" barrier, read their 16 bytes per packet from shared memory,
//     dequantize in registers, issue the mma's, and arrive on the stage's "empty" barrier; the producer
//     refills a stage once all consumers released it.
// Why (measured on the H200, docs/kernels.md, "w4a16_gemm"): per-lane loads (LDG or cp.async) keep every request in the
// L1TEX pipeline, whose outstanding-request budget capped them at ~2.3 TB/s; bulk copies move kilobytes per request
// outside it, but each copy has a fixed cost, so the layout makes them few and large (2 KB copies: 52 us at 8192x28672,
// 4 KB: 44 us, one 17 KB copy per stage: this layout). Weights are loaded evict-first in L2 (read once; they should not
// push out the activations or a model's KV cache).
#pragma once

#include "common.cuh"

#include <cuda.h>  // CUtensorMap

#include <algorithm>
#include <type_traits>
#include <utility>

namespace cublade {
namespace lowbit {

constexpr int kTileN = 16;      // weight rows per tile (the mma's M)
constexpr int kPacketK = 64;    // K per 16-byte lane vector (4 k-steps of 16)
constexpr int kChunk = 8;       // packets per tile per chunk (512 K)
constexpr int kGroupTiles = 4;  // tiles per tile group = consumer warps per CTA
constexpr int kMaxStages = 8;   // ring depth limit (the 128-byte header holds 2 x 8 mbarriers)
constexpr int kMaxSplit = 8;    // cluster size limit (portable)
// Staged x row. A 16-byte shared load is served 8 lanes at a time: lanes (g, t) = (0..1, 0..3) read rows g = 0, 1
// at byte 16t, so rows 64 bytes (16 banks) apart put the two rows in disjoint banks. (The former +16 B made the
// rows overlap in 12 of 16 banks: ncu counted 6.5 wavefronts per shared-load request at M = 32 instead of 4.)
constexpr int kXRowBytes = kChunk * kPacketK * 2 + 64;
constexpr int kMaxSmemKB = 227;                          // dynamic shared memory per CTA (sm_90)

template <typename T>
__host__ __device__ constexpr bool is_bf16() { return std::is_same<T, __nv_bfloat16>::value; }

// Phase stamps of the streaming kernel, for the `phases` mode of benchmarks/tuning/w4a16_layers.cu only: built with
// -DCUBLADE_STREAM_STAMPS, each CTA of a launch writes kStampSlots values to g_stream_stamps (when set) at its entry,
// at its first and last stage's arrival, when its math is done and at its end; production builds compile them out.
#ifdef CUBLADE_STREAM_STAMPS
constexpr int kStampSlots = 10;  // 0 entry (globaltimer ns), 1 entry (clock64), 2 first stage landed, 3 last stage
                                 // landed, 4 math done, 5 end (clock64), 6 end (globaltimer ns), 7 SM id; with K
                                 // splits (clock64): 8 the split's sums written, 9 past the first cluster barrier
__device__ unsigned long long* g_stream_stamps = nullptr;
__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned sm_id() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}
#define CUBLADE_STREAM_STAMP(slot, value)                                                                     \
  do {                                                                                                        \
    if (::cublade::lowbit::g_stream_stamps)                                                                   \
      ::cublade::lowbit::g_stream_stamps[((static_cast<size_t>(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + \
                                          blockIdx.x) * ::cublade::lowbit::kStampSlots + (slot)] = (value);       \
  } while (0)
#endif

// Everything a launch passes (both ops; fields an op does not use are null / 0).
struct GemmParams {
  const void* x;
  int64_t x_stride;
  int M, K;
  const int* offsets;  // int32 [E+1]: rows of expert e are [offsets[e], offsets[e+1]); null: one expert, M rows
  int experts;         // E (with offsets)
  const unsigned char* w;  // the blob
  int tiles, groups, chunks;  // tiles (ceil(N/16)), tile groups (ceil(N/64)), chunks (ceil(K/512))
  int sbytes;                 // scale-record bytes per tile block
  const float* row_scale;     // fp4 (nvfp4): [E, groups*64] factor per output row, or null
  void* out;
  int64_t out_stride;
  int N;
  int chunks_per_cta;  // chunks per split
  int xrows;           // staged x rows per stage (= tokens per pass, capped by the rows an expert can have)
  int stages;          // ring depth (0: launch_stream picks it)
  int tpw;             // tiles per consumer warp (0: the launcher's rule, default_tpw)
  int ksl;             // K slices per chunk (0: tpw; more: more consumer warps, see stream_gemm_kernel)
  int sms;             // the device's multiprocessor count (host side: the launch's choices)
};

// The launch of a plain-rows policy (kPlainRows, fp8_gemm.cu): the weight [N, K] of 1-byte codes as a TMA tensor map
// (boxes of 64 rows x 128 K, 128-byte swizzle; `w` unused), and the activations' fp32 scale per token
// (tok_scale_stride 1) or per tensor (0); row_scale is [N] (not padded). A type of its own, so that the other
// kernels' parameters stay 120 bytes.
struct PlainRowsParams : GemmParams {
  CUtensorMap wmap;
  const float* tok_scale;
  int tok_scale_stride;
  bool pdl;  // host side: launch as a programmatic dependent launch of the stream's previous kernel
};

// Shared memory: barriers, stages x [W: 4 tile blocks | X: xrows x kXRowBytes], reduction buffer (the partial
// sums of every tile: one slot per K slice beyond the first when a warp owns several tiles, else one slot for the
// split-K reduction).
static_assert(2 * kMaxStages * 8 <= 128, "the full/empty mbarriers must fit the 128-byte header");
// PB: bytes per packet (16 rows x 64 K), 512 for 4-bit weights, 1024 for 8-bit. (A run-time member instead made ptxas
// spill 12 bytes in the int4 M <= 8 kernel.)
// ALIGN (0 or 1024): stages start at multiples of ALIGN bytes from a base the kernel aligns (the TMA's 128-byte swizzle
// repeats every 1024 bytes, so a swizzled box must start at such a multiple); total() includes the slack.
template <int PB, int ALIGN = 0>
struct LayoutOf {
  int sbytes, xrows, stages;
  static constexpr int kHeader = ALIGN > 128 ? ALIGN : 128;
  __host__ __device__ int tile_bytes() const { return kChunk * PB + sbytes; }
  __host__ __device__ int w_bytes() const { return kGroupTiles * tile_bytes(); }
  __host__ __device__ int stage_bytes() const {
    const int b = w_bytes() + xrows * kXRowBytes;
    return ALIGN ? (b + ALIGN - 1) / ALIGN * ALIGN : b;
  }
  __host__ __device__ int stage_offset(int s) const { return kHeader + s * stage_bytes(); }
  __host__ __device__ int red_offset() const { return kHeader + stages * stage_bytes(); }
  __host__ __device__ static int red_slots(int ksl) { return ksl > 1 ? ksl - 1 : 1; }
  __host__ __device__ static int red_slot_floats(int nt) { return kGroupTiles * nt * 4 * 32; }
  __host__ __device__ int total(int nt, int ksl) const {  // ksl: K slices per chunk (see stream_gemm_kernel)
    return red_offset() + red_slots(ksl) * red_slot_floats(nt) * 4 + ALIGN;
  }
};
using Layout = LayoutOf<512>;

// Policies whose weights are plain rows ([N, K], 1 byte per code) read through a TMA tensor map (kPlainRows = true)
// instead of a repacked blob.
template <class P, class = void>
struct plain_rows : std::false_type {};
template <class P>
struct plain_rows<P, std::void_t<decltype(P::kPlainRows)>> : std::bool_constant<P::kPlainRows> {};
constexpr int kPlainBoxK = 128;                              // K per TMA box (the 128-byte swizzle span)
constexpr int kPlainBoxBytes = kGroupTiles * kTileN * kPlainBoxK;  // 64 rows x 128 K
template <class P>
using LayoutFor = LayoutOf<P::kPacketBytes, plain_rows<P>::value ? 1024 : 0>;
template <class P>
using ParamsFor = std::conditional_t<plain_rows<P>::value, PlainRowsParams, GemmParams>;

// ---- PTX wrappers ------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
// Bulk copy global -> this CTA's shared memory, completion counted on `bar` (16-byte aligned, size % 16 == 0),
// with an L2 eviction policy (createpolicy).
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(policy)
      : "memory");
}
// 2-D TMA copy of the box at (c0 = K, c1 = row) of `map` into this CTA's shared memory, completion counted on `bar`.
__device__ __forceinline__ void tma_g2s_2d(void* dst, const CUtensorMap* map, int c0, int c1, uint64_t* bar,
                                           uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar)), "l"(policy)
      : "memory");
}
__device__ __forceinline__ uint2 lds64(const void* p) { return *reinterpret_cast<const uint2*>(p); }
// Weights are read once per call: evict them first, so they do not push out of L2 what others still need
// (the activations, and in a model the KV cache) nor force write-backs of dirty lines.
__device__ __forceinline__ uint64_t policy_evict_first() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint64_t policy_evict_last() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint64_t policy_evict_normal() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(p));
  return p;
}
#ifndef CUBLADE_WEIGHT_POLICY
#define CUBLADE_WEIGHT_POLICY policy_evict_first
#endif
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Read a float from the same offset of another CTA's shared memory in the cluster.
__device__ __forceinline__ float ld_dsmem(const float* local, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_u32(local)), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
__device__ __forceinline__ uint4 lds128(const void* p) { return *reinterpret_cast<const uint4*>(p); }
// One packet's x fragments for NT 8-token n-tiles from a stage's x rows (kXRowBytes apart): lane (g, t) reads token
// 8 n + g, K halves h = 0, 1 at x + row * kXRowBytes + 64 h, where x is the packet's first K of row 0 plus the lane's
// t * 16 bytes. Rows from `rows` on, and halves in_k(h) rejects, read as zeros.
template <int NT, class InK>
__device__ __forceinline__ void load_x_packet(uint4 (&xv)[2][NT], const unsigned char* x, int rows, int g, InK in_k) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const int row = 8 * n + g;
      xv[h][n] = row < rows && in_k(h) ? lds128(x + row * kXRowBytes + 64 * h) : make_uint4(0u, 0u, 0u, 0u);
    }
}
// Programmatic dependent launch: a kernel launched with launch_split_k(..., pdl = true) may start while the
// stream's previous kernel runs; pdl_wait() returns once that kernel has finished and its writes are visible
// (at once without PDL). The previous kernel's pdl_launch_dependents() lets the dependent launch start early.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" :::); }

// c += A(16x16, row) * B(16x8, col), fp32 accumulators, bf16 or fp16 operands.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (is_bf16<T>()) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}
// c = A * B (accumulators start from zero: the first k-step of a scale group).
template <typename T>
__device__ __forceinline__ void mma_16816_first(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const float z = 0.0f;
  if constexpr (is_bf16<T>()) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};"
        : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(z));
  } else {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};"
        : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(z));
  }
}

// acc[n] += the packet's 4 k-steps (A fragments a[0..3], exact weights) times its x fragments, for each of the NT
// n-tiles: the packet step of the policies whose weights need no per-group fold (FP4, MXFP8).
template <typename T, int NT>
__device__ __forceinline__ void mma_packet(float (&acc)[NT][4], const uint32_t (&a)[4][4], const uint4 (&xc)[2][NT]) {
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    mma_16816<T>(acc[n], a[0], xc[0][n].x, xc[0][n].y);
    mma_16816<T>(acc[n], a[1], xc[0][n].z, xc[0][n].w);
    mma_16816<T>(acc[n], a[2], xc[1][n].x, xc[1][n].y);
    mma_16816<T>(acc[n], a[3], xc[1][n].z, xc[1][n].w);
  }
}

// Two bf16 products in one HMUL2: (a.lo * b.lo, a.hi * b.hi), each rounded once.
__device__ __forceinline__ uint32_t hmul2_bf16(uint32_t a, uint32_t b) {
  const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                   *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
// (a & b) | c in one LOP3 (the compiler splits it in two when b and c are both immediates).
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Compile-time loop: f(std::integral_constant<int, 0>{}), ..., f(std::integral_constant<int, N-1>{}).
template <typename F, int... I>
__device__ __forceinline__ void static_for_impl(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
__device__ __forceinline__ void static_for(F&& f) {
  static_for_impl(f, std::make_integer_sequence<int, N>{});
}

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// The n-th expert, in expert order, that has rows (offsets[e+1] > offsets[e]), or -1 when fewer than n + 1 have
// rows. Every warp that calls it gets the same answer (one ballot per 32 experts).
__device__ __forceinline__ int nth_expert_with_rows(const int* offsets, int E, int n) {
  const int lane = threadIdx.x & 31;
  for (int e0 = 0; e0 < E; e0 += 32) {
    const int e = e0 + lane;
    unsigned has = __ballot_sync(~0u, e < E && offsets[e + 1] > offsets[e]);
    const int c = __popc(has);
    if (n < c) {
      for (int i = 0; i < n; ++i) has &= has - 1;  // drop the n lowest set bits
      return e0 + __ffs(has) - 1;
    }
    n -= c;
  }
  return -1;
}

// Named barrier of the CW consumer warps only (the producer runs ahead on its own).
template <int CW>
__device__ __forceinline__ void consumer_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(CW * 32) : "memory");
}

// Stream-K (the wide kernel's kStreamK; the streaming kernel's in tuning builds): the helpers both the producer and
// the consumers walk a CTA's units with.
// First unit of CTA i when `ctas` CTAs share `units` units evenly.
__host__ __device__ __forceinline__ int sk_first_unit(int i, int units, int ctas) {
  return static_cast<int>(static_cast<int64_t>(i) * units / ctas);
}
// The CTA's units [u0, u1) as segments of one tile each, f(tile, c0, c1) with stages [c0, c1) of the tile, the last
// tile first: the segment that ends the range (a tile's first stages, whose partial sums another CTA adds) is done
// first, and the one that starts it (a tile's last stages: this CTA adds the others' partial sums) last.
template <class F>
__device__ __forceinline__ void sk_segments(int u0, int u1, int chunks, F&& f) {
  if (u1 <= u0) return;
  for (int tile = (u1 - 1) / chunks; tile >= u0 / chunks; --tile)
    f(tile, max(u0 - tile * chunks, 0), min(u1 - tile * chunks, chunks));
}
__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

#ifdef CUBLADE_STREAM_K
// Stream-K for the streaming kernel, in tuning builds only (-DCUBLADE_STREAM_K: benchmarks/tuning/w4a16_layers.cu's
// "stream-K" rows): policy P's kernel with the CTAs sharing the (tile group, chunk) units evenly, as the wide kernel's
// kStreamK does its (tile, stage) units; one pass of one expert, blob layouts, one n-tile of tokens. A CTA's sums of
// the group its range ends in go to its slot of g_sk_slots and its flag; the flags start at zero (static memory) and
// the group's owner clears them once it has read the slots, for the next launch.
template <class P>
struct StreamK : P {};
#pragma nv_diag_suppress 128  // the kernel's split-K passes after its stream-K block: unreachable in StreamK's
constexpr int kSkMaxCtas = 2048;
constexpr int kSkSlotFloats = kGroupTiles * 4 * 32;  // one CTA's owner sums: [tile][j][lane]
__device__ int g_sk_flags[kSkMaxCtas];
__device__ float g_sk_slots[kSkMaxCtas * kSkSlotFloats];
#endif
template <class P>
struct is_stream_k : std::false_type {};
#ifdef CUBLADE_STREAM_K
template <class P>
struct is_stream_k<StreamK<P>> : std::true_type {};
#endif

// The kernel. A policy P says how a packet becomes mma's (dequant, scales) and provides:
//   using T; static constexpr int NT;  struct State;
//   static constexpr int kPacketBytes   (512: 4-bit weights, one 16-byte vector per lane; 1024: 8-bit, two: V =
//       kPacketBytes / 512)
//   template <int kSliceK> __device__ static const unsigned char* slice_records(const unsigned char* srec, int slice)
//       (the scale records of K slice `slice` of kSliceK within a tile block's records srec)
//   template <int j, int kSliceK> __device__ static void packet(State&, const uint4 (&q)[V], const unsigned char* srec,
//       const uint4 (&x)[2][NT], float (&acc)[NT][4], int lane)   (packet j of a K slice of kSliceK: q this lane's
//       vectors of it, the second 512 bytes after the first; srec: that slice's scale records)
//   __device__ static const float* row_scale(const GemmParams&, int e)   (null: none)
// TPW (tiles per warp) and KSL (K slices per chunk): the CTA has R = 4 / TPW x KSL consumer warps; warp w owns
// tiles TPW*(w/KSL) .. +TPW-1 over K slice w%KSL of every chunk (kChunk/KSL packets). More tiles per warp: each
// x fragment read from shared memory feeds TPW tiles' mma's (x traffic 1/TPW of one tile per warp) and a warp
// has TPW independent mma chains. More slices: more consumer warps over the same bytes, for grids too small to
// give every SM enough warps to hide the dequant's latency. The KSL slices of a tile are added through shared
// memory at the end of a token pass.
template <int TPW, int KSL>
__host__ __device__ constexpr int consumer_warps() { return kGroupTiles / TPW * KSL; }
template <class P, int TPW, int KSL>
__global__ void __launch_bounds__((consumer_warps<TPW, KSL>() + 1) * 32)
stream_gemm_kernel(const __grid_constant__ ParamsFor<P> prm) {
  using T = typename P::T;
  constexpr int NT = P::NT;
  constexpr int R = consumer_warps<TPW, KSL>();
  constexpr int PPW = kChunk / KSL;            // packets per warp per chunk
  constexpr int V = P::kPacketBytes / 512;     // 16-byte vectors per lane per packet
  constexpr int kSliceK = PPW * kPacketK;      // K per slice
  constexpr bool kPlain = plain_rows<P>::value;
  static_assert(kGroupTiles % TPW == 0 && kChunk % KSL == 0 && KSL % TPW == 0,
                "tiles per warp must divide the tile group, slices the chunk, and a warp's tiles its slices");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // plain rows: the layout's 1024-byte stages from a 1024-byte aligned base (the layout's total has the slack)
  unsigned char* smem = kPlain ? smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u) : smem_raw;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  // Grouped: blockIdx.z is the z-th expert that has rows (at most M have), so no CTA is spent on the others.
  const int e = prm.offsets ? nth_expert_with_rows(prm.offsets, prm.experts, blockIdx.z) : 0;
  if (e < 0) return;  // fewer experts have rows than the grid has slots: the whole cluster (same z) leaves
#ifdef CUBLADE_STREAM_STAMPS
  if (threadIdx.x == 0) {
    CUBLADE_STREAM_STAMP(0, globaltimer_ns());
    CUBLADE_STREAM_STAMP(1, clock64());
    CUBLADE_STREAM_STAMP(7, sm_id());
  }
#endif
  const int m_begin = prm.offsets ? prm.offsets[e] : 0;
  const int m_end = prm.offsets ? prm.offsets[e + 1] : prm.M;

  const int nsplit = gridDim.y, split = blockIdx.y;
  const int cb = split * prm.chunks_per_cta;
  const int ce = min(cb + prm.chunks_per_cta, prm.chunks);
  const int nchunks = max(ce - cb, 0);
  const int group = blockIdx.x;
  const int nst = prm.stages;
  const LayoutFor<P> L{prm.sbytes, prm.xrows, nst};
  const int tile0 = (warp / KSL) * TPW, slice = warp % KSL;  // consumers: first tile, K slice
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kMaxStages;
  float* red = reinterpret_cast<float*>(smem + L.red_offset());
  // partial sums of tile `tile`, slot `slot`: [slot][tile][n][j][lane]
  auto red_at = [&](int slot, int tile, int n, int j) {
    return red + slot * Layout::red_slot_floats(NT) + ((tile * NT + n) * 4 + j) * 32 + lane;
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < nst; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, R);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  // The pieces both schedules share. consume_chunk: a consumer warp's packets of absolute chunk `chunk` in stage s.
  auto consume_chunk = [&](int chunk, int s, typename P::State (&st)[TPW], float (&acc)[TPW][NT][4], int rows) {
    const int kb = chunk * kChunk * kPacketK + slice * kSliceK;  // this warp's first K
    const unsigned char* stg = smem + L.stage_offset(s);
    const unsigned char* tb = stg + tile0 * L.tile_bytes() + slice * PPW * P::kPacketBytes + lane * 16;
    const unsigned char* srec[TPW];
#pragma unroll
    for (int u = 0; u < TPW; ++u)
      srec[u] = P::template slice_records<kSliceK>(stg + (tile0 + u) * L.tile_bytes() + kChunk * P::kPacketBytes,
                                                   slice);
    const unsigned char* xsm = stg + L.w_bytes() + t * 16 + slice * kSliceK * 2;
    auto run = [&](auto checked_c) {
      constexpr bool kChecked = decltype(checked_c)::value;
      static_for<PPW>([&](auto j_c) {
        constexpr int j = decltype(j_c)::value;
        uint4 xv[2][NT];
        if constexpr (kPlain) {
          // Plain rows (a box: 64 rows x 8 chunks of 16 K, chunk c of row r stored at chunk c ^ (r % 8)). Half h
          // of packet pk (two k-steps) takes chunk a = 2 (pk % 2) + h for lanes t = 0, 1 and chunk a ^ 5 for t = 2,
          // 3, 8 K per lane (bytes 0-3 one k-step, 4-7 the next): the 4 rows g % 4 of a half-warp's 64-bit loads
          // then cover all 8 chunks (no bank conflict), and x's 16-byte loads for those K hit distinct banks.
          const int pk = slice * PPW + j, box = pk >> 1;  // packet of the chunk, its box
          const unsigned char* wbox = stg + box * kPlainBoxBytes;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int a = 2 * (pk & 1) + h, ch = t >> 1 ? a ^ 5 : a;
            const int kc = box * kPlainBoxK + ch * 16 + (t & 1) * 8;  // this lane's first K in the chunk
            const bool in = !kChecked || chunk * kChunk * kPacketK + kc < prm.K;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
              const int row = 8 * n + g;
              xv[h][n] = row < rows && in ? lds128(stg + L.w_bytes() + row * kXRowBytes + kc * 2)
                                          : make_uint4(0u, 0u, 0u, 0u);
            }
          }
#pragma unroll
          for (int u = 0; u < TPW; ++u) {
            const unsigned char* r_lo = wbox + ((tile0 + u) * kTileN + g) * kPlainBoxK;
            uint4 q[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int a = 2 * (pk & 1) + h, ch = t >> 1 ? a ^ 5 : a;
              const int off = ((ch ^ g) << 4) + (t & 1) * 8;
              const uint2 lo = lds64(r_lo + off), hi = lds64(r_lo + 8 * kPlainBoxK + off);
              q[h] = make_uint4(lo.x, hi.x, lo.y, hi.y);
            }
            P::template packet<j, kSliceK>(st[u], q, nullptr, xv, acc[u], lane);
          }
        } else {
          load_x_packet(xv, xsm + j * kPacketK * 2, rows, g,
                        [&](int h) { return !kChecked || kb + j * kPacketK + 32 * h + 8 * t < prm.K; });
#pragma unroll
          for (int u = 0; u < TPW; ++u) {
            uint4 q[V];
#pragma unroll
            for (int v = 0; v < V; ++v) q[v] = lds128(tb + u * L.tile_bytes() + j * P::kPacketBytes + v * 512);
            P::template packet<j, kSliceK>(st[u], q, srec[u], xv, acc[u], lane);
          }
        }
      });
    };
    // Past K the staged x holds stale bytes: the slice that reaches past K checks (the padded weights are
    // zero anyway).
    if (kb + kSliceK > prm.K) run(std::true_type{});
    else run(std::false_type{});
  };
  // The K slices of each tile (warps of one CTA) added into slice 0's warps (consumers only).
  auto reduce_slices = [&](float (&acc)[TPW][NT][4]) {
    if constexpr (KSL > 1) {
      if (warp < R) {
        consumer_sync<R>();  // the previous pass's readers of red are done
        if (slice > 0)
#pragma unroll
          for (int u = 0; u < TPW; ++u)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
              for (int j = 0; j < 4; ++j) *red_at(slice - 1, tile0 + u, n, j) = acc[u][n][j];
        consumer_sync<R>();
        if (slice == 0)
          for (int q = 1; q < KSL; ++q)  // in slice order: the sum does not depend on timing
#pragma unroll
            for (int u = 0; u < TPW; ++u)
#pragma unroll
              for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[u][n][j] += *red_at(q - 1, tile0 + u, n, j);
      }
    }
  };
  // Slice 0's sums of tile `tile` of tile group grp, tokens from m0, to the output (scaled).
  auto store = [&](float (&v)[NT][4], int tile, int grp, int m0) {
    const float* rs = P::row_scale(prm, e);
    const int row0 = (grp * kGroupTiles + tile) * kTileN;
    const int r_lo = row0 + g, r_hi = row0 + g + 8;
    float f_lo = 1.0f, f_hi = 1.0f;
    if constexpr (kPlain) {  // row_scale [N]
      f_lo = r_lo < prm.N ? rs[r_lo] : 0.0f;
      f_hi = r_hi < prm.N ? rs[r_hi] : 0.0f;
    } else if (rs) {  // row_scale is padded to groups
      f_lo = rs[r_lo];
      f_hi = rs[r_hi];
    }
    T* out = static_cast<T*>(prm.out);
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int row = j < 2 ? r_lo : r_hi;
        const int tok = m0 + 8 * n + 2 * t + (j & 1);
        if (row < prm.N && tok < m_end) {
          float y = v[n][j];
          if constexpr (kPlain)  // (sum x s_a) x s_w, the reference's order
            y *= prm.tok_scale[static_cast<int64_t>(tok) * prm.tok_scale_stride];
          out[static_cast<int64_t>(tok) * prm.out_stride + row] = from_float<T>(y * (j < 2 ? f_lo : f_hi));
        }
      }
  };

  int it = 0;  // chunks streamed so far (stage = it % nst, use = it / nst), the same count in every thread
  // The producer's copies of absolute chunk `chunk` of tile group grp into stage s (the it-th chunk streamed): lane 0
  // the weights (issue_w false: they went out early, plain rows' first stages), lane r the x row r of the pass from m0.
  auto produce_chunk = [&](int grp, int chunk, int s, int m0, int rows, bool issue_w, uint64_t wpol, uint64_t xpol) {
    const unsigned char* xg = static_cast<const unsigned char*>(prm.x);
    const int k0 = chunk * kChunk * kPacketK;
    const int kbytes = (min(k0 + kChunk * kPacketK, prm.K) - k0) * 2;
    if (lane == 0 && issue_w) {
      if (it >= nst) mbar_wait(empty + s, ((it / nst) - 1) & 1);
      mbar_expect_tx(full + s, L.w_bytes() + rows * kbytes);
    }
    __syncwarp();  // the stage is free and its byte count is set before any copy lands
    unsigned char* st = smem + L.stage_offset(s);
    if constexpr (kPlain) {  // the chunk's 64 rows x 512 K as 4 swizzled boxes of 128 K (the padding: zeros)
      if (lane == 0 && issue_w)
#pragma unroll
        for (int b = 0; b < kChunk * kPacketK / kPlainBoxK; ++b)
          tma_g2s_2d(st + b * kPlainBoxBytes, &prm.wmap, k0 + b * kPlainBoxK, grp * kGroupTiles * kTileN, full + s,
                     wpol);
    } else if (lane == 0) {
      const int64_t block = (static_cast<int64_t>(e) * prm.groups + grp) * prm.chunks + chunk;
      bulk_g2s(st, prm.w + block * L.w_bytes(), L.w_bytes(), full + s, wpol);
    }
    for (int row = lane; row < rows; row += 32)
      bulk_g2s(st + L.w_bytes() + row * kXRowBytes, xg + ((static_cast<int64_t>(m0 + row) * prm.x_stride) + k0) * 2,
               kbytes, full + s, xpol);
  };
#ifdef CUBLADE_STREAM_K
  if constexpr (is_stream_k<P>::value) {
    static_assert(!kPlain && NT == 1, "stream-K: blob layouts, one n-tile of tokens");
    const int rows = min(prm.xrows, m_end - m_begin);  // one pass (launch_stream_k checks M <= xrows)
    const int units = prm.groups * prm.chunks;
    const int u0 = sk_first_unit(blockIdx.x, units, gridDim.x), u1 = sk_first_unit(blockIdx.x + 1, units, gridDim.x);
    if (warp == R) {  // ---- producer: the CTA's units in sk_segments' order, the ring running across groups ----
      const uint64_t wpol = CUBLADE_WEIGHT_POLICY(), xpol = policy_evict_last();
      sk_segments(u0, u1, prm.chunks, [&](int grp, int c0, int c1) {
        for (int c = c0; c < c1; ++c, ++it) produce_chunk(grp, c, it % nst, m_begin, rows, true, wpol, xpol);
      });
      return;  // the consumers wait on the copies' barriers, not on this warp
    }
    // ---- consumers: each segment's chunks, its K slices, then its cut: to the slot, or the owner's sum ----
    const bool owner = slice == 0;
    auto slot_at = [&](int cta, int tile, int j) {
      return g_sk_slots + static_cast<int64_t>(cta) * kSkSlotFloats + (tile * 4 + j) * 32 + lane;
    };
    sk_segments(u0, u1, prm.chunks, [&](int grp, int c0, int c1) {
      float acc[TPW][NT][4];
#pragma unroll
      for (int u = 0; u < TPW; ++u)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[u][0][j] = 0.0f;
      typename P::State st[TPW];
      for (int c = c0; c < c1; ++c, ++it) {
        const int s = it % nst;
        mbar_wait(full + s, (it / nst) & 1);
#ifdef CUBLADE_STREAM_STAMPS
        if (threadIdx.x == 0 && it == 0) CUBLADE_STREAM_STAMP(2, clock64());
        if (threadIdx.x == 0 && it == u1 - u0 - 1) CUBLADE_STREAM_STAMP(3, clock64());
#endif
        consume_chunk(c, s, st, acc, rows);
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + s);
      }
      reduce_slices(acc);
      if (c1 < prm.chunks) {  // the group's first chunks: the sums go to this CTA's slot, for the group's owner
        if (owner)
#pragma unroll
          for (int u = 0; u < TPW; ++u)
#pragma unroll
            for (int j = 0; j < 4; ++j) __stcg(slot_at(blockIdx.x, tile0 + u, j), acc[u][0][j]);
        consumer_sync<R>();
        if (threadIdx.x == 0) {
          __threadfence();
          st_release(g_sk_flags + blockIdx.x, 1);
        }
        return;
      }
      if (c0 > 0) {  // the lower CTAs whose ranges end inside this group did its first chunks: add their sums
        const int group_u = grp * prm.chunks;
        auto contributor = [&](int i) { return i >= 0 && sk_first_unit(i + 1, units, gridDim.x) > group_u; };
        if (threadIdx.x == 0)
          for (int i = blockIdx.x - 1; contributor(i); --i)
            while (ld_acquire(g_sk_flags + i) == 0) __nanosleep(64);
        consumer_sync<R>();
        if (owner)
          for (int i = blockIdx.x - 1; contributor(i); --i)  // in CTA order: the sum does not depend on timing
#pragma unroll
            for (int u = 0; u < TPW; ++u)
#pragma unroll
              for (int j = 0; j < 4; ++j) acc[u][0][j] += __ldcg(slot_at(i, tile0 + u, j));
        consumer_sync<R>();
        if (threadIdx.x == 0)
          for (int i = blockIdx.x - 1; contributor(i); --i) g_sk_flags[i] = 0;  // read: cleared for the next launch
      }
      if (owner)
#pragma unroll
        for (int u = 0; u < TPW; ++u) store(acc[u], tile0 + u, grp, m_begin);
    });
#ifdef CUBLADE_STREAM_STAMPS
    if (threadIdx.x == 0) {
      CUBLADE_STREAM_STAMP(4, clock64());
      CUBLADE_STREAM_STAMP(5, clock64());
      CUBLADE_STREAM_STAMP(6, globaltimer_ns());
    }
#endif
    return;
  }
#endif
  // Token passes of prm.xrows (<= 8 NT) rows: more rows than the launch planned for only cost more passes.
  for (int m0 = m_begin; m0 < m_end; m0 += prm.xrows) {
    const int rows = min(prm.xrows, m_end - m0);
    float acc[TPW][NT][4];
#pragma unroll
    for (int u = 0; u < TPW; ++u)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[u][n][j] = 0.0f;

    if (warp == R) {  // ---- producer: lane 0 the weights, lane r the x row r ----
      const uint64_t wpol = CUBLADE_WEIGHT_POLICY(), xpol = policy_evict_last();
      auto k0_of = [&](int c) { return (cb + c) * kChunk * kPacketK; };
      auto kbytes_of = [&](int c) { return (min(k0_of(c) + kChunk * kPacketK, prm.K) - k0_of(c)) * 2; };
      // Plain rows: the kernel is a programmatic dependent launch of the activations' quantization; the first pass's
      // first stages' weights go out before x is ready, then pdl_wait.
      int early = 0;
      if constexpr (kPlain) {
        if (m0 == m_begin) {
          early = min(nst, nchunks);
          if (lane == 0)
            for (int c = 0; c < early; ++c) {
              mbar_expect_tx(full + c, L.w_bytes() + rows * kbytes_of(c));
              for (int b = 0; b < kChunk * kPacketK / kPlainBoxK; ++b)
                tma_g2s_2d(smem + L.stage_offset(c) + b * kPlainBoxBytes, &prm.wmap, k0_of(c) + b * kPlainBoxK,
                           group * kGroupTiles * kTileN, full + c, wpol);
            }
          pdl_wait();
        }
      }
      for (int c = 0; c < nchunks; ++c, ++it) produce_chunk(group, cb + c, it % nst, m0, rows, c >= early, wpol, xpol);
    } else {  // ---- consumer ----
      if constexpr (kPlain) pdl_wait();  // the epilogue reads the quantization's token scales
      typename P::State st[TPW];
      for (int c = 0; c < nchunks; ++c, ++it) {
        const int s = it % nst;
        mbar_wait(full + s, (it / nst) & 1);
#ifdef CUBLADE_STREAM_STAMPS
        if (threadIdx.x == 0 && m0 == m_begin) {
          if (c == 0) CUBLADE_STREAM_STAMP(2, clock64());
          if (c == nchunks - 1) CUBLADE_STREAM_STAMP(3, clock64());
        }
#endif
        consume_chunk(cb + c, s, st, acc, rows);
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + s);
      }
#ifdef CUBLADE_STREAM_STAMPS
      if (threadIdx.x == 0 && m0 == m_begin) CUBLADE_STREAM_STAMP(4, clock64());
#endif
    }

    // ---- the K slices of each tile (warps of one CTA), then the splits of the cluster, then the outputs ----
    reduce_slices(acc);
    const bool owner = warp < R && slice == 0;  // holds its tiles' sums over the CTA's K
    if (nsplit == 1) {
      if (owner)
#pragma unroll
        for (int u = 0; u < TPW; ++u) store(acc[u], tile0 + u, group, m0);
    } else {
      // slot 0 of the owner's own tiles: it read them (KSL > 1) before it overwrites them
      if (owner)
#pragma unroll
        for (int u = 0; u < TPW; ++u)
#pragma unroll
          for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int j = 0; j < 4; ++j) *red_at(0, tile0 + u, n, j) = acc[u][n][j];
#ifdef CUBLADE_STREAM_STAMPS
      if (threadIdx.x == 0 && m0 == m_begin) CUBLADE_STREAM_STAMP(8, clock64());
#endif
      cluster_sync();
#ifdef CUBLADE_STREAM_STAMPS
      if (threadIdx.x == 0 && m0 == m_begin) CUBLADE_STREAM_STAMP(9, clock64());
#endif
      if (split == 0 && owner) {
#pragma unroll
        for (int u = 0; u < TPW; ++u) {
          for (int q = 1; q < nsplit; ++q)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
              for (int j = 0; j < 4; ++j) acc[u][n][j] += ld_dsmem(red_at(0, tile0 + u, n, j), q);
          store(acc[u], tile0 + u, group, m0);
        }
      }
      cluster_sync();  // the other CTAs keep their shared memory until rank 0 has read it
    }
  }
#ifdef CUBLADE_STREAM_STAMPS
  if (threadIdx.x == 0) {
    CUBLADE_STREAM_STAMP(5, clock64());
    CUBLADE_STREAM_STAMP(6, globaltimer_ns());
  }
#endif
}

// Lets `Kernel` take up to kMaxSmemKB of dynamic shared memory (once per kernel); the occupancy query and the
// launch both need it (the streaming kernel here, the wide kernel in w4a16_gemm.cu).
template <auto Kernel>
cudaError_t allow_max_smem() {
  static const cudaError_t e =
      cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmemKB * 1024);
  return e;
}

// CTAs of kernel <P, TPW, KSL> that one SM holds with `smem` bytes of dynamic shared memory (cached per
// instantiation and smem size: the occupancy query is not free, and this runs on every eager launch).
template <class P, int TPW, int KSL = TPW>
int ctas_per_sm(int smem) {
  static int cache[kMaxSmemKB + 1] = {};  // by smem in KB rounded up; 0 = not asked yet (an int race is benign)
  const int kb = (smem + 1023) / 1024;
  if (kb > kMaxSmemKB) return 0;
  if (cache[kb] == 0) {
    int n = 0;
    constexpr auto kernel = stream_gemm_kernel<P, TPW, KSL>;
    if (allow_max_smem<kernel>() != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, (consumer_warps<TPW, KSL>() + 1) * 32,
                                                      kb * 1024) != cudaSuccess)
      return 0;
    cache[kb] = n > 0 ? n : -1;
  }
  return std::max(cache[kb], 0);
}

// Ring depth. The consumers, not the copies, limit this kernel, so the shallowest ring (2 stages) is best: it
// lets the most CTAs, hence consumer warps, share an SM. The exception is a grid of 1 to 1.5 times the CTAs
// the GPU holds at once: its short second wave runs nearly alone, so a deeper ring (fewer CTAs per SM, more
// even waves) wins. Measured on the H200 (benchmarks/tuning/w4a16_occupancy.cu, 8192x28672 = 448 CTAs): M=1
// 44.5 us at 2 stages (5 CTAs/SM) vs 58.7 us at 4 (3/SM: 1.13 waves); M=16 80.5 us at 2 (3/SM, 1.13 waves) vs
// 64.9 us at 3 (2/SM, 1.7 waves). With more waves the last one matters less: 896 CTAs (2 splits) at M=16 ran
// 56.0 us at 2 stages (2.3 waves) and 88.7 us at 4 (1 CTA/SM, 6.8 waves). And one CTA per SM never pays:
// 8192x10240 M=32 in 2 splits (320 CTAs, 1.2 waves at 2/SM) ran 62.2 us at 3 stages (1/SM) against 47.3 at 2.
template <class P, int TPW, int KSL>
int pick_stages(LayoutFor<P> L, int64_t ctas, int sms) {
  for (int st = 2; st <= 4; ++st) {
    L.stages = st;
    const int per_sm = ctas_per_sm<P, TPW, KSL>(L.total(P::NT, KSL));
    if (per_sm == 0) continue;
    if (st > 2 && per_sm < 2) break;  // one CTA (4 consumer warps) per SM: always slower
    const int64_t slots = static_cast<int64_t>(per_sm) * sms, full = ctas / slots, rem = ctas % slots;
    if (full != 1 || rem == 0 || 2 * rem >= slots) return st;  // only a 1-1.5 wave grid deepens the ring
  }
  return 2;
}

// Launch kernel(arg) on `grid`, the S splits of K (grid.y) of a tile group forming one thread-block cluster (none
// when S = 1): they add up their partial sums through distributed shared memory. pdl: a programmatic dependent
// launch (the kernel calls pdl_wait() before it reads what the stream's previous kernel wrote).
template <typename Arg>
cudaError_t launch_split_k(void (*kernel)(Arg), dim3 grid, int threads, int smem, int S, cudaStream_t stream,
                           const Arg& arg, bool pdl = false) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attrs[2];
  unsigned n = 0;
  if (S > 1) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = 1;
    attrs[n].val.clusterDim.y = static_cast<unsigned>(S);
    attrs[n].val.clusterDim.z = 1;
    ++n;
  }
  if (pdl) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, arg);
}

// Grid slices (blockIdx.z) of a launch over E experts and M rows: one per expert that can have rows, at most M of
// the E (grouped: rows sorted by expert, `offsets` set); the kernels map slice z to the z-th expert with rows. Both
// kernels (this one and wide_gemm.cuh's) and fp4_gemm's choices (its split and tokens-per-pass rules) use it.
constexpr int64_t expert_slices(bool grouped, int64_t E, int64_t M) { return grouped ? std::min(E, M) : 1; }

inline bool launch_pdl(const GemmParams&) { return false; }
inline bool launch_pdl(const PlainRowsParams& prm) { return prm.pdl; }

// Launch one instantiation: S splits of K per cluster, E experts (prm.offsets set when E > 1); xrows and sbytes
// set in prm; prm.stages = 0 picks the ring depth (a tuning harness may set it).
template <class P, int TPW, int KSL = TPW>
cudaError_t launch_stream(ParamsFor<P> prm, int E, int S, cudaStream_t stream) {
  constexpr auto kernel = stream_gemm_kernel<P, TPW, KSL>;
  if (S < 1 || S > kMaxSplit || prm.stages > kMaxStages) return cudaErrorInvalidValue;
  if (const cudaError_t e = allow_max_smem<kernel>(); e != cudaSuccess) return e;
  prm.chunks_per_cta = (prm.chunks + S - 1) / S;
  prm.experts = E;
  LayoutFor<P> L{prm.sbytes, prm.xrows, kMaxStages};
  // Grouped launches: one grid slice (blockIdx.z) per expert that can have rows, at most M of the E; the kernel
  // maps slice z to the z-th expert with rows. (A slice per expert left the CTAs of the experts with rows packed
  // onto fewer SMs among the early exits: 14336x4096, 2 of 8 experts, 50.0 us against 36.9 for a blob of the two.)
  const int slices = static_cast<int>(expert_slices(prm.offsets != nullptr, E, prm.M));
  const int64_t ctas = static_cast<int64_t>(prm.groups) * S * slices;
  if (prm.stages <= 0) prm.stages = pick_stages<P, TPW, KSL>(L, ctas, prm.sms);
  L.stages = prm.stages;
  const int smem = L.total(P::NT, KSL);
  if (smem > kMaxSmemKB * 1024) return cudaErrorInvalidValue;
  return launch_split_k(kernel, dim3(static_cast<unsigned>(prm.groups), S, slices),
                        (consumer_warps<TPW, KSL>() + 1) * 32, smem, S, stream, prm, launch_pdl(prm));
}

#ifdef CUBLADE_STREAM_K
// Stream-K launch of P's streaming kernel (tuning builds): `ctas` CTAs (0: as many as the GPU holds at once, at most
// one per unit; never more, since an owner waits on the lower CTAs' flags) share the tile groups x chunks units at
// prm.stages stages. One pass of one expert: M <= prm.xrows, no offsets.
template <class P, int TPW, int KSL>
cudaError_t launch_stream_k(ParamsFor<P> prm, int ctas, cudaStream_t stream) {
  constexpr auto kernel = stream_gemm_kernel<StreamK<P>, TPW, KSL>;
  constexpr int kThreads = (consumer_warps<TPW, KSL>() + 1) * 32;
  if (prm.offsets != nullptr || prm.M > prm.xrows || prm.stages < 2 || prm.stages > kMaxStages)
    return cudaErrorInvalidValue;
  if (const cudaError_t e = allow_max_smem<kernel>(); e != cudaSuccess) return e;
  const LayoutFor<P> L{prm.sbytes, prm.xrows, prm.stages};
  const int smem = L.total(P::NT, KSL);
  int per_sm = 0;
  if (smem > kMaxSmemKB * 1024 ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem) != cudaSuccess || per_sm < 1)
    return cudaErrorInvalidValue;
  const int64_t most = std::min<int64_t>({static_cast<int64_t>(per_sm) * prm.sms,
                                          static_cast<int64_t>(prm.groups) * prm.chunks, kSkMaxCtas});
  if (ctas <= 0) ctas = static_cast<int>(most);
  if (ctas > most) return cudaErrorInvalidValue;
  prm.chunks_per_cta = prm.chunks;
  prm.experts = 1;
  return launch_split_k(kernel, dim3(static_cast<unsigned>(ctas)), kThreads, smem, 1, stream, prm, false);
}
#endif

// n-tiles of 8 tokens per pass (the policy's NT) for a launch whose experts have at most `rows` rows: 1, 2 or 4;
// more rows than 32 take more passes, each re-reading the weights.
constexpr int token_tiles(int rows) { return rows <= 8 ? 1 : rows <= 16 ? 2 : 4; }

// Tiles per consumer warp for NT n-tiles of tokens. More tiles per warp divide the shared-memory reads of x by TPW
// and give each warp TPW independent mma chains, at the cost of registers (TPW x the accumulators) and one
// reduction through shared memory per token pass. Measured on the H200 (benchmarks/tuning/w4a16_occupancy.cu,
// us after do_bench's flush, best splits/stages of each): 8192x28672 M = 1: 44.0 (1 tile per warp)
// vs 46.2 (2); M = 16: 63.5 vs 58.0; M = 32: 104.9 vs 95.3; M = 64: 195.8 vs 178.3. Four tiles per warp lost
// everywhere (one CTA per SM at NT = 4).
constexpr int default_tpw(int nt) { return nt == 1 ? 1 : 2; }

// Launch with prm.tpw tiles per warp (0: default_tpw) over prm.ksl K slices (0: tpw). Production builds
// instantiate the default only; tuning builds (CUBLADE_LOWBIT_ALL_TPW) every choice.
template <class P>
cudaError_t launch_tpw(ParamsFor<P> prm, int E, int S, cudaStream_t stream) {
  constexpr int kDefault = default_tpw(P::NT);
  const int tpw = prm.tpw > 0 ? prm.tpw : kDefault;
  const int ksl = prm.ksl > 0 ? prm.ksl : tpw;
  if (tpw == kDefault && ksl == tpw) return launch_stream<P, kDefault>(prm, E, S, stream);
#ifdef CUBLADE_LOWBIT_ALL_TPW
  if (ksl == tpw) {
    if (tpw == 1) return launch_stream<P, 1>(prm, E, S, stream);
    if (tpw == 2) return launch_stream<P, 2>(prm, E, S, stream);
    if (tpw == 4) return launch_stream<P, 4>(prm, E, S, stream);
  }
  if (tpw == 1 && ksl == 2) return launch_stream<P, 1, 2>(prm, E, S, stream);
  if (tpw == 1 && ksl == 4) return launch_stream<P, 1, 4>(prm, E, S, stream);
  if (tpw == 2 && ksl == 4) return launch_stream<P, 2, 4>(prm, E, S, stream);
#endif
  return cudaErrorInvalidValue;
}

// Up to 16 rows of 1-byte weights (MXFP8 at P::NT 1 or 2, FP8 rows at 1; prm.xrows and prm.sms set; split_k 0: the
// rule's):
// - two K slices per chunk at every row count (8 consumer warps of one tile each up to 8 rows, 4 of two tiles above);
// - K splits that spread the tile groups evenly over the SMs: doubled while that evens the per-SM share by 1.25x or
//   more (the share: the most CTAs one SM gets over the average, ceil(n / sms) * sms / n for n CTAs), each split
//   keeps 4 chunks, and the doubled grid fits in one wave of the 2-stage ring;
// - at 9-16 rows, a grid of one CTA per SM at most doubles its splits once more where each split keeps 8 chunks and
//   the doubled grid still fits one 2-stage wave (2 CTAs a SM on 128 tile groups: 8192x8192, 28672x8192);
// - a ring of 3 stages where the grid needs one CTA per SM at most, or holds 2 a SM at 3 stages without a short
//   second wave (at most 1.5 times the CTAs the GPU holds at once); else 2, for more CTAs a SM.
// As a decode step runs them (benchmarks/tuning/w4a16_layers.cu built with -DCUBLADE_LAYERS_MXFP8, `sweep`: weights
// of 32 layers replayed from one CUDA graph, every (slices, splits, stages); MXFP8, H200), this is within 3.4% of the
// fastest configuration at all 32 points of 1 / 2 / 4 / 8 rows on Llama-3-8B's and Llama-70B-like shapes, and takes
// 0.94x the time of the rule before it over them (which kept one slice from 3 rows, split on chunks alone): at 4 rows
// qkv 12.94 -> 10.96 us, o 12.42 -> 8.29 (2 splits), gate_up 35.87 -> 34.21, down 21.66 -> 18.42, 8192x57344 125.5 ->
// 114.3 (2 stages, 2 a SM); at one row o 10.41 -> 8.55, 8192x8192 21.51 -> 19.30 (1 split: 128 groups already cover
// the SMs), 28672x8192 60.10 -> 57.19. At 9-16 rows, against pick_split / pick_stages in one call (us, M = 16): o
// 12.75 -> 9.25 (2 splits), down 22.90 -> 21.02, 8192x10240 37.64 -> 32.88, an 8B layer's four 87.02 -> 80.87; the
// slowest point of 24 at 0.987x. Raw: benchmarks/runs/2026-12-02-mxfp8-layers-sweep-1-16-h200.txt,
// benchmarks/runs/2026-12-02-mxfp8-9-16-row-rule-h200.txt.
template <class P>
cudaError_t launch_byte_weights_few_rows(ParamsFor<P> prm, int split_k, cudaStream_t stream) {
  static_assert((P::NT == 1 || P::NT == 2) && P::kPacketBytes == 1024, "1-byte weights, one or two n-tiles of tokens");
  constexpr int kTpw = P::NT, kKsl = 2;
  const int64_t sms = prm.sms;
  auto per_sm = [&](int stages) {
    const LayoutFor<P> L{prm.sbytes, prm.xrows, stages};
    return ctas_per_sm<P, kTpw, kKsl>(L.total(P::NT, kKsl));
  };
  auto share = [&](int64_t n) { return static_cast<double>((n + sms - 1) / sms * sms) / static_cast<double>(n); };
  const int64_t groups = prm.groups;
  int S = split_k;
  if (S <= 0) {
    S = 1;
    const int64_t one_wave = per_sm(2) * sms;
    while (S < kMaxSplit && prm.chunks >= 2 * S * 4 && share(groups * 2 * S) * 1.25 <= share(groups * S) &&
           groups * 2 * S <= one_wave)
      S *= 2;
    if (P::NT == 2 && S < kMaxSplit && groups * S <= sms && prm.chunks >= 2 * S * 8 && groups * 2 * S <= one_wave)
      S *= 2;
  }
  const int64_t ctas = groups * S, slots3 = static_cast<int64_t>(per_sm(3)) * sms;
  const bool deep = slots3 > 0 && (ctas <= sms || (slots3 >= 2 * sms && (ctas <= slots3 || 2 * ctas > 3 * slots3)));
  prm.stages = deep ? 3 : 2;
  return launch_stream<P, kTpw, kKsl>(prm, 1, S, stream);
}

// K splits (cluster size): more CTAs per SM means more consumer warps, which is what this kernel needs, but each
// split's ring fills and drains on its own, so a split must keep at least 8 chunks (4096 K). Rule: double the splits
// while the grid has fewer than 1.5 CTAs per SM and the chunks allow it. Measured on the H200
// (benchmarks/tuning/w4a16_occupancy.cu, us after do_bench's flush, 1 / 2 splits at M = 1 / 16 / 32): K 28672 x N 8192
// (128 groups, 56 chunks) 52.2 / 42.2, 68.9 / 52.4, 113.2 / 79.7; 8192x10240 (160, 16) 25.1 / 21.1, 31.1 / 26.5, 46.7 /
// 47.3; 4096x14336 (224, 8) 16.3 / 17.5; 8192x28672 (448, 16) 42.5 / 45.4, 58.5 / 55.8, 89.6 / 93.1.
// `few_ctas_chunks`: the chunks a split must keep when the doubled grid still has at most 1.5 CTAs per SM. The int4 op
// passes 4 up to 16 rows. On Llama-3-8B's small layers (w4a16_occupancy.cu, us after a 256 MB read, 1 split / 2 splits
// at 2 stages, M = 1 / 4 / 16): K 4096 x N 4096 (64 groups, 8 chunks) 12.2 / 10.0, 12.2 / 10.1, 14.6 / 11.6; 4096x6144
// (96 groups) 12.6 / 11.4, 12.5 / 11.6, 14.9 / 13.9. 14336x4096 (64 groups, 28 chunks) keeps its 2 splits: 4 won by
// 5-7% at M = 1-4 but lost 4% at 16.
inline int pick_split(int64_t ctas, int chunks, int sms, int few_ctas_chunks = 8) {
  int S = 1;
  while (S < kMaxSplit && 2 * ctas * S < 3 * static_cast<int64_t>(sms)) {
    const int keep = 4 * ctas * S <= 3 * static_cast<int64_t>(sms) ? few_ctas_chunks : 8;
    if (chunks < 2 * S * keep) break;
    S *= 2;
  }
  return S;
}

}  // namespace lowbit
}  // namespace cublade
