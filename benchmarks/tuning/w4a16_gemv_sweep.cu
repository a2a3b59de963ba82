// w4a16_gemv_sweep.cu: a small-M (M = 1..8, tuned for 1..4) W4A16 GEMV that streams the weights of the
// EXISTING repacked layout (plugin/ops/w4a16_gemm.py, w4a16_repack; int4, group 128, symmetric) with per-lane
// 16-byte loads, plus a stand-alone harness that checks and times it against the production launcher
// (launch_w4a16_gemm, plugin/csrc/w4a16_gemm.cu, included below) in one run. No torch: CUDA runtime only.
// Result (one run on the H200, `bash scripts/device_e2e.sh tuning`; raw: benchmarks/runs/2026-11-22-tuning-sweeps-h200.txt):
// every variant passed its checks, and none beat the production kernel of that run: the fastest ran 0.98x / 0.92x /
// 0.91x its speed at M = 1 / 2 / 4 on 8192 x 28672 and 0.83x-0.87x on 4096 x 14336 (docs/decisions.md). The speeds
// the design notes below aim at are intents; the run's table is what was measured.
//
// ---- Build / run (on the H200; nothing here needs a Python environment) ----------------------------------
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I plugin/csrc \
//        benchmarks/tuning/w4a16_gemv_sweep.cu -o /tmp/gemv_sweep
//   /tmp/gemv_sweep            # optional: /tmp/gemv_sweep REPS   (timed runs per case, default 100, min 50)
//   /tmp/gemv_sweep --skip=w16x2,fold   # leave out variants whose name contains one of these (after a crash)
// It runs in a few seconds (most of it: filling 150 MB of random weights, one 121 MB copy back to the host).
// Exit status: 0 when every variant passed its checks, 1 when one failed (the table says which), 2 on a CUDA
// error.
//
// ---- The layout it reads (same bytes as the production kernel; nothing is repacked) -------------------------
//   blob int32 [TG = ceil(N/64)][C = ceil(K/512)][4 tiles][1056 words]; a tile block (4224 B) is
//   8 packets x 32 lanes x 4 words (4096 B) then 32 scale words (128 B): word (grp*8 + g) = bf16 pair
//   (s[row g], s[row g+8]) of the tile's rows for group grp (0..3, 128 K each) of the chunk.
//   Lane (g = lane/4, t = lane%4), word s of packet p holds rows g and g+8 at
//   K0 = 512c + 64p + 32(s/2) + 8t + 4(s%2) .. +3, nibble j at bits 4j: j=0 (g, K0), 1 (g+8, K0), 2 (g, K0+2),
//   3 (g+8, K0+2), 4 (g, K0+1), 5 (g+8, K0+1), 6 (g, K0+3), 7 (g+8, K0+3).
//   => one warp-wide 16-byte load per lane of packet p is exactly the A fragments (rows of N) of 4
//   mma.m16n8k16 k-steps (the same orientation as the production kernel: weight = A, tokens = B, n = 8 >= M);
//   lane (g, t) needs x[tok = g][64p + 8t .. +8] and x[tok = g][64p + 32 + 8t .. +8] (two 16-byte x reads).
//
// ---- Kernel design (gemv_kernel<WARPS, D, XS, LM, MINB, FOLD>) ---------------------------------------------
//   * Work unit = (tile of 16 rows, group of 128 K) = 2 packets (1 KB per warp: lane L loads 16 B at
//     +16L and at +512+16L) + one 4-byte scale word per lane (word grp*8+g of the chunk's records).
//     Units are numbered tile-major: u = tile * (K/128) + group (groups past K -- the K padding -- and tiles
//     past ceil(N/16) are never read: K % 128 == 0, so the padding is whole groups).
//   * Stream-K over warps: the grid is G warps (default: #SMs x CTAs/SM x WARPS, i.e. exactly one full wave;
//     G <= #units). Warp w owns units [w*U/G, (w+1)*U/G) (U = #units; the ranges differ by <= 1 unit, so
//     every SM streams the same bytes +-1 KB and all finish together -- no wave quantization).
//   * Per warp, a register ring of D units (2 x uint4 + 1 u32 per lane each; D KB per warp in flight, 16 x D
//     KB per SM with 16 warps/SM): consume unit i, then issue unit i+D into the freed slot. The loads are
//     ld.global.nc.L1::no_allocate (LM 1/2 add .L2::256B; LM 2 also an L2 evict_first policy, as the
//     production kernel's weights; LM 3 plain ld.global.nc, added after quant_sweep.cu measured the L1 hint
//     costing 6-10 % in the streaming quant kernels).
//   * Compute (per lane, per unit): 8 words -> 8 x (3 SHF + 4 LOP3 + 4 HSUB2) magic-number dequant (OR the
//     nibble into the mantissa of bf16 128.0, subtract 136 = 128 + 8: exact), 8 mma.m16n8k16 (bf16 in, fp32
//     out) into two independent fp32 partials (one per packet, 4-deep chains), then
//     acc += (part0 + part1) * scale in fp32 per row (the group's scale applied to the group's fp32 partial
//     sum, as the production kernel: the weights are never rounded). Lanes with g >= M feed zeros.
//     FOLD (variant "_fold"): skip the 32 HSUB2 per unit (~1/4 of the unit's instructions): the mma gets
//     128 + u (exact), and the group's correction 136 * sum(x over the group) (fp32, computed once per CTA
//     from the staged x) is subtracted from the group's fp32 partial before the scale. Not bit-identical:
//     the partial is ~30x larger than the result before the subtraction, so the tensor core's fp32
//     accumulation error is ~30x larger (expected still << the bf16 output rounding; rel_cpu shows it).
//   * x: XS = staged once per CTA into shared memory (all M rows x K, row stride 2K+64 bytes so that the
//     8 lanes of an LDS.128 phase (2 tokens x 4 t) hit distinct banks), filled while the ring's first D units
//     are already in flight; XG = read per lane from global through L1 (__ldg). XS needs M*(2K+64) bytes
//     of shared memory (64 KB at M=4, K=8192); a production launcher would fall back to XG above ~200 KB.
//   * Split-K reduction, one launch, no second kernel: a tile that one warp covers entirely is stored as bf16
//     directly. A tile split over c warps (c is known from the partition formula by every contributor):
//     each adds its fp32 partial into ws[tok][row] (atomicAdd f32), fence.acq_rel.gpu, then lane 0 bumps
//     cnt[tile]; the warp that sees c-1 reads the sums with atomicExch(ws, 0) (read + reset in one op at L2),
//     writes bf16, and resets cnt[tile] to 0. So the workspace (M x tiles*16 fp32 + tiles int32, from the
//     caller, zeroed ONCE at allocation) is left zeroed by every call: no memset per call, CUDA-graph safe as
//     long as calls on one workspace do not overlap (one stream). Non-deterministic fp32 summation order
//     across the contributors of a split tile (2-6 here: the order of a few fp32 additions).
//   * Only rows < N and tokens < M are written; out is bf16 [M, N] with row stride out_stride.
//   * "tile" variants: G = #tiles, so every warp owns whole tiles (no workspace touched), for comparison.
//
// ---- What it checks (per shape, per M, per variant) ---------------------------------------------------------
//   shapes: K x N = 8192 x 28672 and 4096 x 14336 (timed), and 2176 x 1000 (correctness only: K and N not
//   multiples of 512 / 64 / 16, so the padding paths run). Data are built directly in the repacked layout
//   on the device: random nibbles (zero in the padding, as the repack writes), scales uniform in
//   0.002..0.012 as bf16 (zero in the padding), x ~ N(0, 1) in bf16.
//   - vs the existing kernel (split auto): mean|a-b|/mean|b| ("rel_ex", FAIL > 2e-3) and max|a-b|/mean|b|
//     ("max_ex"), over all M x N outputs;
//   - vs an fp64 host reference for 64 sampled output columns (dequantized on the host from the same bytes,
//     an independent decode of the layout): mean|a-r|/mean|r| ("rel_cpu", FAIL > 3e-3; bf16 output rounding
//     alone gives ~1.4e-3);
//   - NaN/inf anywhere, writes outside [M, N] (out has a padded row stride filled with a sentinel), and the
//     workspace left non-zero after the call (the self-reset above) are failures too.
//   The existing kernel is also checked against the host reference (a sanity check of the harness itself).
//   Checked off-device before the run (CPU only): the host decode and fill_blob's forward map agree with
//   plugin/ops/w4a16_gemm.py's w4a16_repack on a 1000 x 2176 weight (0 mismatches), and a Python emulation of
//   the kernel's cursors (ring slots, tile-block addresses, partition, contributor counts) covers every unit
//   exactly once for every shape / variant geometry here.
//
// ---- Timing (as triton's do_bench) -----------------------------------------------------------------------
//   Before every timed launch: cudaMemsetAsync of a 256 MB scratch buffer (flushes the 50 MB L2); a
//   cudaEvent pair around the launch alone; median of REPS runs (after 3 warm-ups). "copy" is a
//   cudaMemcpyAsync device-to-device of the same number of bytes (weights + scales), timed the same way;
//   copy TB/s counts read + write (2 x bytes / time: the convention of the 4.27 TB/s ceiling).
//
// ---- How to read the output ---------------------------------------------------------------------------
//   One table, one block per (shape, M), rows sorted by time: us (median), TB/s = (N*K/2 + N*K/128*2) / us
//   (weight + scale bytes, read once), %copy = TB/s / copy TB/s, then the checks. Then one line per
//   (shape, M): the fastest variant that passed and its speedup over the existing kernel (its faster of
//   split auto / split 2). Variant names: sk_w<warps per CTA>x<CTAs per SM>_d<ring depth>_<xs|xg>_<ld>
//   (ld: nc = ld.global.nc.L1::no_allocate, l2p = + .L2::256B, ef = + .L2::256B + L2 evict_first,
//   plainnc = ld.global.nc without L1/L2 hints),
//   _fold = FOLD above; tile_... = whole tiles per warp (G = #tiles). Lines starting with two spaces are
//   progress lines printed as each case finishes (the same numbers; useful if the run dies half-way).
//   For scale: 3.6 TB/s is ~34 us at 8192 x 28672, M = 1.

#define CUBLADE_W4A16_ONE_TU  // the wide kernel's instantiations in this program too (w4a16_gemm_wide.cuh)
#include "w4a16_gemm.cu"  // the production launcher (launch_w4a16_gemm) and its kernel, for the comparison
#include "harness.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace gemv {

constexpr int kTileWords = 1024 + 32;  // int4 g128 symmetric tile block: 4096 B weights + 128 B scale records
constexpr int kTileBytes = kTileWords * 4;
constexpr int kMaxM = 8;

struct Params {
  const __nv_bfloat16* x;
  int64_t x_stride;  // elements
  int M, K, N;
  const unsigned char* w;  // the blob
  int chunks;              // ceil(K/512)
  int tiles;               // ceil(N/16)
  int gpt;                 // groups (of 128 K) per tile = K/128
  int64_t total;           // units = tiles * gpt
  int64_t G;               // warps that own units (<= total)
  __nv_bfloat16* out;
  int64_t out_stride;  // elements
  float* ws;           // [M][tiles*16] fp32, zero on entry and on exit
  int* cnt;            // [tiles], zero on entry and on exit
  int ws_stride;       // tiles*16
  int xs_stride;       // bytes per staged x row (2K + 64)
};

// ---- loads --------------------------------------------------------------------------------------------------
template <int LM>
__device__ __forceinline__ uint4 ldw(const void* p, uint64_t pol) {
  uint4 v;
  if constexpr (LM == 0) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  } else if constexpr (LM == 3) {  // no L1 hint: 6-10 % faster in the streaming quant kernels (quant_sweep.cu)
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  } else if constexpr (LM == 1) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(pol));
  }
  return v;
}
template <int LM>
__device__ __forceinline__ uint32_t lds_scale(const void* p, uint64_t pol) {
  uint32_t v;
  if constexpr (LM == 2) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.u32 %0, [%1], %2;" : "=r"(v) : "l"(p), "l"(pol));
  } else if constexpr (LM == 3) {
    asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  }
  return v;
}

// ---- dequant + mma --------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t lop_and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ uint32_t bsub2(uint32_t a, uint32_t b) {
  const __nv_bfloat162 r =
      __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}
// One word -> the A fragment of one k-step: a0 (row g, K0..+1), a1 (g+8, K0..+1), a2 (g, K0+2..+3), a3 (g+8, ..).
// (128 + u) - 136 = u - 8, exact in bf16.
__device__ __forceinline__ void deq(uint32_t q, uint32_t (&a)[4]) {
  constexpr uint32_t kMask = 0x000F000Fu, kBase = 0x43004300u, kBias = 0x43084308u;
  a[0] = bsub2(lop_and_or(q, kMask, kBase), kBias);
  a[1] = bsub2(lop_and_or(q >> 4, kMask, kBase), kBias);
  a[2] = bsub2(lop_and_or(q >> 8, kMask, kBase), kBias);
  a[3] = bsub2(lop_and_or(q >> 12, kMask, kBase), kBias);
}
template <bool kFirst>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kFirst) {
    const float z = 0.0f;
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};"
        : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(z));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}
// One packet (16 B per lane = 4 k-steps) with its x (xa: K0 = base + 8t .. +8, xb: base + 32 + 8t .. +8).
// FOLD: A = 128 + u (no subtraction; the caller subtracts 136 * sum(x) per group, see the header comment).
__device__ __forceinline__ void deq_fold(uint32_t q, uint32_t (&a)[4]) {
  constexpr uint32_t kMask = 0x000F000Fu, kBase = 0x43004300u;
  a[0] = lop_and_or(q, kMask, kBase);
  a[1] = lop_and_or(q >> 4, kMask, kBase);
  a[2] = lop_and_or(q >> 8, kMask, kBase);
  a[3] = lop_and_or(q >> 12, kMask, kBase);
}
template <bool FOLD>
__device__ __forceinline__ void packet(float (&p)[4], const uint4 q, const uint4 xa, const uint4 xb) {
  uint32_t a[4];
  auto dq = [&](uint32_t w) {
    if constexpr (FOLD) deq_fold(w, a);
    else deq(w, a);
  };
  dq(q.x);
  mma<true>(p, a, xa.x, xa.y);
  dq(q.y);
  mma<false>(p, a, xa.z, xa.w);
  dq(q.z);
  mma<false>(p, a, xb.x, xb.y);
  dq(q.w);
  mma<false>(p, a, xb.z, xb.w);
}

// Warp that owns unit u under the balanced partition start(w) = w * total / G: the largest w with start(w) <= u.
__device__ __forceinline__ int64_t owner(int64_t u, int64_t G, int64_t total) {
  return ((u + 1) * G + total - 1) / total - 1;
}

template <int WARPS, int D, bool XS, int LM, int MINB, bool FOLD>
__global__ void __launch_bounds__(WARPS * 32, MINB) gemv_kernel(const __grid_constant__ Params p) {
  static_assert(!FOLD || XS, "FOLD needs the staged x (its per-group sums)");
  extern __shared__ __align__(16) unsigned char xs[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * WARPS + warp;
  int64_t q0 = 0, q1 = 0;
  if (gw < p.G) {
    q0 = gw * p.total / p.G;
    q1 = (gw + 1) * p.total / p.G;
  }
  const int n = static_cast<int>(q1 - q0);  // units of this warp
  uint64_t pol = 0;
  if constexpr (LM == 2) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));

  // Load cursor: (tile, group in tile).
  int ltile = 0, lq = 0;
  if (n > 0) {
    ltile = static_cast<int>(q0 / p.gpt);
    lq = static_cast<int>(q0 - static_cast<int64_t>(ltile) * p.gpt);
  }
  const int ctile0 = ltile, cq0 = lq;
  uint4 b0[D], b1[D];
  uint32_t bs[D];
  // Tile block of (tile, chunk): ((tile/4 * chunks + chunk) * 4 + tile%4) * 4224 bytes into the blob.
  auto block_of = [&](int tile, int q) {
    return p.w + ((static_cast<int64_t>(tile >> 2) * p.chunks + (q >> 2)) * 4 + (tile & 3)) * kTileBytes;
  };
  const unsigned char* lblock = block_of(ltile, lq);  // tile block of the next unit to load
  auto issue = [&](uint4& r0, uint4& r1, uint32_t& rs) {
    const unsigned char* pk = lblock + (lq & 3) * 1024 + lane * 16;
    r0 = ldw<LM>(pk, pol);
    r1 = ldw<LM>(pk + 512, pol);
    rs = lds_scale<LM>(lblock + 4096 + ((lq & 3) * 8 + g) * 4, pol);
    if (++lq == p.gpt) {  // next tile
      lq = 0;
      ++ltile;
      lblock = block_of(ltile, 0);
    } else if ((lq & 3) == 0) {  // next chunk of the same tile: 4 tile blocks further
      lblock += 4 * kTileBytes;
    }
  };
#pragma unroll
  for (int d = 0; d < D; ++d)
    if (d < n) issue(b0[d], b1[d], bs[d]);

  // x: staged in shared memory (XS) while the first D units are in flight, or read from global (XG).
  if constexpr (XS) {
    const int vec_per_row = p.K / 8;
    const int nvec = p.M * vec_per_row;
    for (int i = threadIdx.x; i < nvec; i += WARPS * 32) {
      const int r = i / vec_per_row, c = i - r * vec_per_row;
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(p.x + r * p.x_stride) + c);
      *reinterpret_cast<uint4*>(xs + r * p.xs_stride + c * 16) = v;
    }
    __syncthreads();
    if constexpr (FOLD) {  // xsum[group][tok] = sum of x over the group (fp32), tokens >= M: 0
      float* xsum = reinterpret_cast<float*>(xs + p.M * p.xs_stride);
      for (int i = threadIdx.x; i < p.gpt * kMaxM; i += WARPS * 32) {
        const int grp = i / kMaxM, tok = i % kMaxM;
        float sum = 0.0f;
        if (tok < p.M) {
          const uint4* src = reinterpret_cast<const uint4*>(xs + tok * p.xs_stride + grp * 256);
#pragma unroll 4
          for (int v = 0; v < 16; ++v) {
            const uint4 q = src[v];
            const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) sum += __uint_as_float(w[e] << 16) + __uint_as_float(w[e] & 0xFFFF0000u);
          }
        }
        xsum[i] = sum;
      }
      __syncthreads();
    }
  }
  const bool has_tok = g < p.M;
  const unsigned char* xrow_s = xs + g * p.xs_stride + t * 16;
  const __nv_bfloat16* xrow_g = p.x + (has_tok ? g : 0) * p.x_stride + t * 8;
  auto xload = [&](int k) -> uint4 {  // x[tok g][k + 8t .. +8]
    if (!has_tok) return make_uint4(0u, 0u, 0u, 0u);
    if constexpr (XS) return *reinterpret_cast<const uint4*>(xrow_s + k * 2);
    else return __ldg(reinterpret_cast<const uint4*>(xrow_g + k));
  };

  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  int ctile = ctile0, cq = cq0;
  // Store / reduce one tile's outputs (warp-uniform call).
  auto flush = [&](int tile) {
    const int64_t u0 = static_cast<int64_t>(tile) * p.gpt;
    const int contributors = static_cast<int>(owner(u0 + p.gpt - 1, p.G, p.total) - owner(u0, p.G, p.total) + 1);
    const int row_lo = tile * 16 + g;
    int rows[4], toks[4];
    bool ok[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      rows[j] = row_lo + (j >= 2 ? 8 : 0);
      toks[j] = 2 * t + (j & 1);
      ok[j] = rows[j] < p.N && toks[j] < p.M;
    }
    if (contributors == 1) {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (ok[j]) p.out[toks[j] * p.out_stride + rows[j]] = __float2bfloat16_rn(acc[j]);
      return;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (ok[j]) atomicAdd(p.ws + toks[j] * p.ws_stride + rows[j], acc[j]);
    asm volatile("fence.acq_rel.gpu;" ::: "memory");  // release: the partials before the count
    __syncwarp();
    int old = 0;
    if (lane == 0) old = atomicAdd(p.cnt + tile, 1);
    old = __shfl_sync(0xffffffffu, old, 0);
    if (old == contributors - 1) {  // the last contributor: every other partial is in ws
      asm volatile("fence.acq_rel.gpu;" ::: "memory");  // acquire: the others' partials after the count
      // Lane 0 read the count; the other lanes only got its value through the shuffle (no memory ordering):
      // the barrier orders lane 0's acquire (its atomic, then its fence) before every lane's reads below.
      __syncwarp();
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (ok[j]) {
          const float v = atomicExch(p.ws + toks[j] * p.ws_stride + rows[j], 0.0f);
          p.out[toks[j] * p.out_stride + rows[j]] = __float2bfloat16_rn(v);
        }
      if (lane == 0) atomicExch(p.cnt + tile, 0);
    }
  };

  for (int i0 = 0; i0 < n; i0 += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int i = i0 + d;
      if (i < n) {
        // ---- consume unit i (slot d): tile ctile, group cq ----
        const int k = cq * 128;
        float pa[4], pb[4];
        packet<FOLD>(pa, b0[d], xload(k), xload(k + 32));
        packet<FOLD>(pb, b1[d], xload(k + 64), xload(k + 96));
        const float s_lo = __uint_as_float(bs[d] << 16), s_hi = __uint_as_float(bs[d] & 0xFFFF0000u);
        if constexpr (FOLD) {  // part = sum (128 + u) x  ->  part - 136 * sum x = sum (u - 8) x
          const float2 sx = *reinterpret_cast<const float2*>(
              xs + p.M * p.xs_stride + (cq * kMaxM + 2 * t) * sizeof(float));
          acc[0] = fmaf(fmaf(-136.0f, sx.x, pa[0] + pb[0]), s_lo, acc[0]);
          acc[1] = fmaf(fmaf(-136.0f, sx.y, pa[1] + pb[1]), s_lo, acc[1]);
          acc[2] = fmaf(fmaf(-136.0f, sx.x, pa[2] + pb[2]), s_hi, acc[2]);
          acc[3] = fmaf(fmaf(-136.0f, sx.y, pa[3] + pb[3]), s_hi, acc[3]);
        } else {
          acc[0] = fmaf(pa[0] + pb[0], s_lo, acc[0]);
          acc[1] = fmaf(pa[1] + pb[1], s_lo, acc[1]);
          acc[2] = fmaf(pa[2] + pb[2], s_hi, acc[2]);
          acc[3] = fmaf(pa[3] + pb[3], s_hi, acc[3]);
        }
        // ---- refill slot d with unit i + D ----
        if (i + D < n) issue(b0[d], b1[d], bs[d]);
        // ---- tile end / range end ----
        const bool tile_end = ++cq == p.gpt;
        if (tile_end || i + 1 == n) {
          flush(ctile);
          acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
          if (tile_end) {
            cq = 0;
            ++ctile;
          }
        }
      }
    }
  }
}

// Workspace (fp32 partials + counters) a caller provides, zeroed once.
inline size_t ws_floats(int M, int N) { return static_cast<size_t>(M) * ((N + 15) / 16) * 16; }
inline size_t cnt_ints(int N) { return static_cast<size_t>((N + 15) / 16); }

// warps: how many warps own units (clamped to the unit count); CTAs = ceil(warps / WARPS).
template <int WARPS, int D, bool XS, int LM, int MINB, bool FOLD = false>
cudaError_t launch(const __nv_bfloat16* x, int M, int K, int64_t x_stride, const void* blob, __nv_bfloat16* out,
                   int64_t out_stride, int N, float* ws, int* cnt, int64_t warps, cudaStream_t stream) {
  if (M < 1 || M > kMaxM || K % 128 != 0 || x_stride % 8 != 0) return cudaErrorInvalidValue;
  Params p = {};
  p.x = x;
  p.x_stride = x_stride;
  p.M = M;
  p.K = K;
  p.N = N;
  p.w = static_cast<const unsigned char*>(blob);
  p.chunks = (K + 511) / 512;
  p.tiles = (N + 15) / 16;
  p.gpt = K / 128;
  p.total = static_cast<int64_t>(p.tiles) * p.gpt;
  p.G = std::min<int64_t>(std::max<int64_t>(warps, 1), p.total);
  p.out = out;
  p.out_stride = out_stride;
  p.ws = ws;
  p.cnt = cnt;
  p.ws_stride = p.tiles * 16;
  p.xs_stride = 2 * K + 64;
  const size_t smem = XS ? static_cast<size_t>(M) * p.xs_stride + (FOLD ? p.gpt * kMaxM * sizeof(float) : 0) : 0;
  static const cudaError_t attr =
      cudaFuncSetAttribute(gemv_kernel<WARPS, D, XS, LM, MINB, FOLD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           227 * 1024);
  if (attr != cudaSuccess) return attr;
  if (smem > 227 * 1024) return cudaErrorInvalidValue;
  const unsigned ctas = static_cast<unsigned>((p.G + WARPS - 1) / WARPS);
  gemv_kernel<WARPS, D, XS, LM, MINB, FOLD><<<ctas, WARPS * 32, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace gemv

// =============================================================================================================
// Harness
// =============================================================================================================

__host__ __device__ inline uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Random blob in the repacked layout; padded rows / K get zero nibbles and zero scales (as w4a16_repack).
__global__ void fill_blob(uint32_t* w, int64_t nwords, int N, int K, int chunks, uint64_t seed) {
  const int kKoff[8] = {0, 0, 2, 2, 1, 1, 3, 3};
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < nwords;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t tb = idx / gemv::kTileWords;
    const int within = static_cast<int>(idx - tb * gemv::kTileWords);
    const int64_t tg = tb / (static_cast<int64_t>(chunks) * 4);
    const int rem = static_cast<int>(tb - tg * chunks * 4);
    const int c = rem / 4, tr = rem % 4;
    const int64_t tile = tg * 4 + tr;
    const uint64_t h = mix64(seed ^ (static_cast<uint64_t>(idx) * 0x2545F4914F6CDD1Dull));
    uint32_t v;
    if (within < 1024) {
      const int pk = within / 128, lane = (within / 4) % 32, s = within % 4;
      const int g = lane / 4, t = lane % 4;
      const int k0 = c * 512 + 64 * pk + 32 * (s / 2) + 8 * t + 4 * (s % 2);
      v = static_cast<uint32_t>(h);
      for (int j = 0; j < 8; ++j) {
        const int64_t row = tile * 16 + g + (j & 1) * 8;
        const int k = k0 + kKoff[j];
        if (row >= N || k >= K) v &= ~(0xFu << (4 * j));
      }
    } else {
      const int r = within - 1024, grp = r / 8, g = r % 8;
      const int64_t row_lo = tile * 16 + g, row_hi = row_lo + 8;
      const int kg = c * 512 + grp * 128;
      const float u0 = static_cast<float>(h & 0xFFFFFF) / 16777216.0f;
      const float u1 = static_cast<float>((h >> 32) & 0xFFFFFF) / 16777216.0f;
      const __nv_bfloat16 s0 = __float2bfloat16_rn(0.002f + 0.010f * u0);
      const __nv_bfloat16 s1 = __float2bfloat16_rn(0.002f + 0.010f * u1);
      const uint32_t lo = (row_lo < N && kg < K) ? static_cast<uint32_t>(__bfloat16_as_ushort(s0)) : 0u;
      const uint32_t hi = (row_hi < N && kg < K) ? static_cast<uint32_t>(__bfloat16_as_ushort(s1)) : 0u;
      v = lo | (hi << 16);
    }
    w[idx] = v;
  }
}

__global__ void fill_x(__nv_bfloat16* x, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t h = mix64(seed ^ (static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull));
    const float u1 = (static_cast<float>(h & 0xFFFFFF) + 1.0f) / 16777217.0f;
    const float u2 = static_cast<float>((h >> 32) & 0xFFFFFF) / 16777216.0f;
    x[i] = __float2bfloat16_rn(sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2));
  }
}

static float bf2f(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Shape {
  int K, N;
  bool timed;
};

struct Row {
  std::string shape;
  int M;
  std::string name;
  bool existing;
  float us;
  double tbs, pct;
  double rel_ex, max_ex, rel_cpu;
  bool pass;
  std::string why;
};

using Launch = std::function<cudaError_t(const __nv_bfloat16* x, int M, int K, const void* blob, __nv_bfloat16* out,
                                         int64_t out_stride, int N, cudaStream_t s)>;
struct Variant {
  std::string name;
  bool existing;
  Launch run;
};

// do_bench-like: flush L2 with a 256 MB memset before every launch; events around the launch; median.
static float bench(const std::function<cudaError_t()>& f, void* scratch, size_t scratch_bytes, int reps,
                   cudaStream_t s) {
  return static_cast<float>(harness::time_us(f, harness::memset_flush(scratch, scratch_bytes, s), reps, s));
}

int main(int argc, char** argv) {
  int reps = 100;
  std::string skip;  // --skip=a,b: leave out variants whose name contains a or b (e.g. after a crash)
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--skip=", 7) == 0) skip = argv[i] + 7;
    else reps = std::atoi(argv[i]);
  }
  if (reps < 50) reps = 50;
  const harness::Device device;
  const int sms = device.sms;
  cudaStream_t st = device.stream;
  std::printf("device: %s, %d SMs, L2 %d MB; reps %d (median), L2 flushed by a 256 MB memset before each launch\n",
              device.prop.name, sms, device.prop.l2CacheSize >> 20, reps);

  const std::vector<Shape> shapes = {{8192, 28672, true}, {4096, 14336, true}, {2176, 1000, false}};
  const std::vector<int> Ms = {1, 2, 4};
  const int kMaxMUsed = 4;

  // Workspace for the stream-K variants: zeroed once, left zeroed by every call.
  size_t wsf = 0, cni = 0;
  for (const auto& sh : shapes) {
    wsf = std::max(wsf, gemv::ws_floats(gemv::kMaxM, sh.N));
    cni = std::max(cni, gemv::cnt_ints(sh.N));
  }
  float* ws;
  int* cnt;
  CK(cudaMalloc(&ws, wsf * sizeof(float)));
  CK(cudaMalloc(&cnt, cni * sizeof(int)));
  CK(cudaMemset(ws, 0, wsf * sizeof(float)));
  CK(cudaMemset(cnt, 0, cni * sizeof(int)));
  CK(cudaDeviceSynchronize());  // st is non-blocking: it does not wait for the legacy stream's memsets
  const size_t scratch_bytes = 256ull << 20;
  void* scratch;
  CK(cudaMalloc(&scratch, scratch_bytes));

  // ---- variants ----
  std::vector<Variant> vars;
  auto existing = [&](int split) -> Launch {
    return [split, sms](const __nv_bfloat16* x, int M, int K, const void* blob, __nv_bfloat16* out, int64_t os,
                        int N, cudaStream_t s) {
      cublade::W4a16GemmArgs a;  // M <= 16 here: no workspace
      a.x = x; a.M = M; a.K = K; a.x_stride = K; a.packed = blob; a.group_size = 128;
      a.out = out; a.out_stride = os; a.N = N; a.split_k = split; a.sms = sms;
      return cublade::launch_w4a16_gemm(a, s);
    };
  };
  vars.push_back({"existing_split_auto", true, existing(0)});
  vars.push_back({"existing_split_2", true, existing(2)});
#define GEMV_VARIANT(NAME, WARPS, D, XS, LM, MINB, WARPS_TOTAL_EXPR, ...)                                             \
  vars.push_back({NAME, false,                                                                                   \
                  [&, sms](const __nv_bfloat16* x, int M, int K, const void* blob, __nv_bfloat16* out, int64_t os, \
                           int N, cudaStream_t s) {                                                              \
                    const int64_t tiles = (N + 15) / 16;                                                         \
                    (void)tiles;                                                                                 \
                    return gemv::launch<WARPS, D, XS, LM, MINB, ##__VA_ARGS__>(x, M, K, K, blob, out, os, N, ws,   \
                                                                               cnt, (WARPS_TOTAL_EXPR), s);      \
                  }})
  // stream-K, one wave: #SMs x CTAs/SM x warps per CTA
  GEMV_VARIANT("sk_w16x1_d8_xs_nc", 16, 8, true, 0, 1, int64_t(sms) * 16);
  GEMV_VARIANT("sk_w16x1_d8_xs_l2p", 16, 8, true, 1, 1, int64_t(sms) * 16);
  GEMV_VARIANT("sk_w16x1_d8_xs_plainnc", 16, 8, true, 3, 1, int64_t(sms) * 16);
  GEMV_VARIANT("sk_w8x2_d8_xs_plainnc", 8, 8, true, 3, 2, int64_t(sms) * 16);
  GEMV_VARIANT("sk_w16x1_d8_xs_ef", 16, 8, true, 2, 1, int64_t(sms) * 16);
  GEMV_VARIANT("sk_w16x1_d4_xs_l2p", 16, 4, true, 1, 1, int64_t(sms) * 16);
  GEMV_VARIANT("sk_w16x1_d6_xs_l2p", 16, 6, true, 1, 1, int64_t(sms) * 16);
  GEMV_VARIANT("sk_w8x2_d8_xs_l2p", 8, 8, true, 1, 2, int64_t(sms) * 16);
  GEMV_VARIANT("sk_w8x1_d12_xs_l2p", 8, 12, true, 1, 1, int64_t(sms) * 8);
  GEMV_VARIANT("sk_w16x2_d4_xs_l2p", 16, 4, true, 1, 2, int64_t(sms) * 32);
  GEMV_VARIANT("sk_w16x1_d8_xs_l2p_fold", 16, 8, true, 1, 1, int64_t(sms) * 16, true);
  GEMV_VARIANT("sk_w16x1_d8_xg_l2p", 16, 8, false, 1, 1, int64_t(sms) * 16);
  GEMV_VARIANT("sk_w8x3_d4_xg_l2p", 8, 4, false, 1, 3, int64_t(sms) * 24);
  // whole tiles per warp (no split, no workspace traffic), for comparison
  GEMV_VARIANT("tile_w4_d8_xg_l2p", 4, 8, false, 1, 4, tiles);
#undef GEMV_VARIANT
  if (!skip.empty()) {
    std::vector<std::string> pats;
    for (size_t a = 0, b; a <= skip.size(); a = b + 1) {
      b = skip.find(',', a);
      if (b == std::string::npos) b = skip.size();
      if (b > a) pats.push_back(skip.substr(a, b - a));
    }
    std::vector<Variant> kept;
    for (auto& v : vars) {
      bool drop = false;
      for (const auto& q : pats) drop = drop || (!v.existing && v.name.find(q) != std::string::npos);
      if (!drop) kept.push_back(v);
      else std::printf("skipping %s\n", v.name.c_str());
    }
    vars = kept;
  }
  std::printf("progress lines: KxN M variant us TB/s rel_ex rel_cpu check (the sorted table follows at the end)\n");

  std::vector<Row> rows;
  bool all_pass = true;
  for (const auto& sh : shapes) {
    const int K = sh.K, N = sh.N;
    const int chunks = (K + 511) / 512, tgs = (N + 63) / 64;
    const int64_t nwords = static_cast<int64_t>(tgs) * chunks * 4 * gemv::kTileWords;
    const double bytes = static_cast<double>(N) * K / 2 + static_cast<double>(N) * K / 128 * 2;
    uint32_t* blob;
    CK(cudaMalloc(&blob, nwords * 4));
    fill_blob<<<4 * sms, 256, 0, st>>>(blob, nwords, N, K, chunks, 0x1234ull + K * 131 + N);
    CK(cudaGetLastError());
    __nv_bfloat16* x;
    CK(cudaMalloc(&x, static_cast<size_t>(kMaxMUsed) * K * 2));
    fill_x<<<sms, 256, 0, st>>>(x, static_cast<int64_t>(kMaxMUsed) * K, 0xABCDull + K);
    CK(cudaGetLastError());
    // outputs with a padded row stride; the gap is a sentinel (0xFFFF: a bf16 NaN) that must stay untouched
    const int64_t os = N + 64;
    const size_t out_elems = static_cast<size_t>(kMaxMUsed) * os;
    __nv_bfloat16 *out_ref, *out;
    CK(cudaMalloc(&out_ref, out_elems * 2));
    CK(cudaMalloc(&out, out_elems * 2));
    CK(cudaStreamSynchronize(st));

    std::vector<uint32_t> hblob(nwords);
    CK(cudaMemcpy(hblob.data(), blob, nwords * 4, cudaMemcpyDeviceToHost));
    std::vector<uint16_t> hx(static_cast<size_t>(kMaxMUsed) * K);
    CK(cudaMemcpy(hx.data(), x, hx.size() * 2, cudaMemcpyDeviceToHost));

    // sampled columns and their fp64 reference: y[m][n] = sum_k (u - 8) * s * x
    std::vector<int> cols;
    for (int i = 0; i < 63; ++i)
      cols.push_back(std::min(N - 1, static_cast<int>(static_cast<int64_t>(i) * N / 63) + (i * 7) % 16));
    cols.push_back(N - 1);
    const int kJ[4] = {0, 4, 2, 6};  // nibble of (row half 0, koff) ; +1 for the g+8 half
    std::vector<double> ref(static_cast<size_t>(kMaxMUsed) * cols.size(), 0.0);
    for (size_t ci = 0; ci < cols.size(); ++ci) {
      const int n = cols[ci];
      const int tile = n / 16, r = n % 16, g = r % 8, hi = r / 8, tg = tile / 4, tr = tile % 4;
      for (int k = 0; k < K; ++k) {
        const int c = k / 512, kk = k % 512, pk = kk / 64, w = kk % 64, h = w / 32, t = (w % 32) / 8, w3 = w % 8;
        const int s = 2 * h + w3 / 4, koff = w3 % 4, j = hi + kJ[koff];
        const int64_t tb = (static_cast<int64_t>(tg) * chunks + c) * 4 + tr;
        const uint32_t word = hblob[tb * gemv::kTileWords + pk * 128 + (g * 4 + t) * 4 + s];
        const int u = (word >> (4 * j)) & 0xF;
        const uint32_t sw = hblob[tb * gemv::kTileWords + 1024 + (kk / 128) * 8 + g];
        const double sc = bf2f(static_cast<uint16_t>(hi ? (sw >> 16) : (sw & 0xFFFF)));
        const double wv = (u - 8) * sc;
        for (int m = 0; m < kMaxMUsed; ++m) ref[m * cols.size() + ci] += wv * bf2f(hx[static_cast<size_t>(m) * K + k]);
      }
    }

    // copy of the same bytes (device to device), timed the same way
    void* cdst;
    CK(cudaMalloc(&cdst, static_cast<size_t>(bytes) + 64));
    const float copy_us = bench(
        [&] { return cudaMemcpyAsync(cdst, blob, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, st); },
                                scratch, scratch_bytes, reps, st);
    const double copy_tbs = 2.0 * bytes / (copy_us * 1e-6) / 1e12;
    char shape_name[64];
    std::snprintf(shape_name, sizeof(shape_name), "%dx%d", K, N);
    std::printf("copy %s: %.1f MB (weights+scales) in %.2f us = %.2f TB/s (read + write)\n", shape_name,
                bytes / 1e6, copy_us, copy_tbs);

    std::vector<uint16_t> h_ref(out_elems), h_out(out_elems);
    for (int M : Ms) {
      // the existing kernel (split auto) as the reference output
      // on st: st is a non-blocking stream, so a legacy-stream cudaMemset (asynchronous for device memory) would
      // not be ordered before the launch and could overwrite its outputs
      CK(cudaMemsetAsync(out_ref, 0xFF, out_elems * 2, st));
      CK(vars[0].run(x, M, K, blob, out_ref, os, N, st));
      CK(cudaStreamSynchronize(st));
      CK(cudaMemcpy(h_ref.data(), out_ref, out_elems * 2, cudaMemcpyDeviceToHost));
      for (const auto& v : vars) {
        Row row;
        row.shape = shape_name;
        row.M = M;
        row.name = v.name;
        row.existing = v.existing;
        row.pass = true;
        // ---- correctness ----
        CK(cudaMemsetAsync(out, 0xFF, out_elems * 2, st));
        const cudaError_t le = v.run(x, M, K, blob, out, os, N, st);
        if (le != cudaSuccess) {
          row.pass = false;
          row.why = std::string("launch: ") + cudaGetErrorName(le);
          cudaGetLastError();
          row.us = 0;
          row.tbs = row.pct = row.rel_ex = row.max_ex = row.rel_cpu = 0;
          std::printf("  %s M=%d %-24s FAIL: %s\n", row.shape.c_str(), M, row.name.c_str(), row.why.c_str());
          rows.push_back(row);
          all_pass = false;
          continue;
        }
        CK(cudaStreamSynchronize(st));
        CK(cudaMemcpy(h_out.data(), out, out_elems * 2, cudaMemcpyDeviceToHost));
        double sad = 0, sab = 0, mad = 0;
        bool finite = true, guard = true;
        for (int m = 0; m < M; ++m) {
          for (int n = 0; n < N; ++n) {
            const double a = bf2f(h_out[m * os + n]), b = bf2f(h_ref[m * os + n]);
            if (!std::isfinite(a)) finite = false;
            sad += std::fabs(a - b);
            sab += std::fabs(b);
            mad = std::max(mad, std::fabs(a - b));
          }
          for (int64_t n = N; n < os; ++n)
            if (h_out[m * os + n] != 0xFFFF) guard = false;
        }
        for (size_t e = static_cast<size_t>(M) * os; e < out_elems; ++e)
          if (h_out[e] != 0xFFFF) guard = false;
        row.rel_ex = sad / std::max(sab, 1e-30);
        row.max_ex = mad / std::max(sab / (static_cast<double>(M) * N), 1e-30);
        double scd = 0, scr = 0;
        for (int m = 0; m < M; ++m)
          for (size_t ci = 0; ci < cols.size(); ++ci) {
            const double a = bf2f(h_out[m * os + cols[ci]]), r = ref[m * cols.size() + ci];
            scd += std::fabs(a - r);
            scr += std::fabs(r);
          }
        row.rel_cpu = scd / std::max(scr, 1e-30);
        if (!finite) { row.pass = false; row.why += "non-finite/unwritten output; "; }
        if (!guard) { row.pass = false; row.why += "wrote outside [M,N]; "; }
        if (!v.existing && row.rel_ex > 2e-3) { row.pass = false; row.why += "rel_ex > 2e-3; "; }
        if (row.rel_cpu > 3e-3) { row.pass = false; row.why += "rel_cpu > 3e-3; "; }
        if (!v.existing) {  // the workspace must be left zeroed
          std::vector<float> hws(gemv::ws_floats(M, N));
          std::vector<int> hc(gemv::cnt_ints(N));
          CK(cudaMemcpy(hws.data(), ws, hws.size() * 4, cudaMemcpyDeviceToHost));
          CK(cudaMemcpy(hc.data(), cnt, hc.size() * 4, cudaMemcpyDeviceToHost));
          bool z = true;
          for (float f : hws) z = z && f == 0.0f;
          for (int c : hc) z = z && c == 0;
          if (!z) {
            row.pass = false;
            row.why += "workspace not left zeroed; ";
            CK(cudaMemsetAsync(ws, 0, wsf * sizeof(float), st));
            CK(cudaMemsetAsync(cnt, 0, cni * sizeof(int), st));
          }
        }
        // ---- timing ----
        row.us = sh.timed
                     ? bench([&] { return v.run(x, M, K, blob, out, os, N, st); }, scratch, scratch_bytes, reps, st)
                          : 0.0f;
        row.tbs = row.us > 0 ? bytes / (row.us * 1e-6) / 1e12 : 0.0;
        row.pct = row.tbs / copy_tbs * 100.0;
        if (!row.pass) all_pass = false;
        std::printf("  %s M=%d %-24s %8.2f us %5.2f TB/s  rel_ex %.2e rel_cpu %.2e  %s%s\n", row.shape.c_str(), M,
                    row.name.c_str(), row.us, row.tbs, row.rel_ex, row.rel_cpu, row.pass ? "ok" : "FAIL: ",
                    row.why.c_str());
        rows.push_back(row);
      }
    }
    CK(cudaFree(cdst));
    CK(cudaFree(blob));
    CK(cudaFree(x));
    CK(cudaFree(out_ref));
    CK(cudaFree(out));
  }

  // ---- the table: one block per (shape, M), sorted by time ----
  std::printf("\n%-10s %2s  %-22s %8s %6s %6s  %9s %9s %9s  %s\n", "KxN", "M", "variant", "us", "TB/s", "%copy",
              "rel_ex", "max_ex", "rel_cpu", "check");
  std::vector<std::string> best_lines;
  for (size_t b = 0; b < rows.size();) {
    size_t e = b;
    while (e < rows.size() && rows[e].shape == rows[b].shape && rows[e].M == rows[b].M) ++e;
    std::vector<Row> blk(rows.begin() + b, rows.begin() + e);
    std::stable_sort(blk.begin(), blk.end(), [](const Row& a, const Row& c) { return a.us < c.us; });
    float ex_best = 0;
    const Row* best = nullptr;
    for (const auto& r : blk) {
      std::printf("%-10s %2d  %-22s %8.2f %6.2f %5.0f%%  %9.2e %9.2e %9.2e  %s%s\n", r.shape.c_str(), r.M,
                  r.name.c_str(), r.us, r.tbs, r.pct, r.rel_ex, r.max_ex, r.rel_cpu, r.pass ? "ok" : "FAIL: ",
                  r.why.c_str());
      if (r.existing && r.pass && r.us > 0 && (ex_best == 0 || r.us < ex_best)) ex_best = r.us;
      if (!r.existing && r.pass && r.us > 0 && (!best || r.us < best->us)) best = &r;
    }
    std::printf("\n");
    char line[256];
    bool timed = false;  // not blk[0].us == 0: a variant that failed to launch (us = 0) sorts first
    for (const auto& r : blk) timed = timed || r.us > 0;
    if (!timed) {
      bool ok = true;
      for (const auto& r : blk) ok = ok && r.pass;
      std::snprintf(line, sizeof(line), "%-10s M=%d: correctness only: %s", blk[0].shape.c_str(), blk[0].M,
                    ok ? "all variants pass" : "SOME VARIANTS FAIL");
    } else if (best && ex_best > 0) {
      std::snprintf(line, sizeof(line),
                    "%-10s M=%d: fastest passing = %s, %.2f us, %.2f TB/s; %.2fx vs existing (%.2f us)",
                    blk[0].shape.c_str(), blk[0].M, best->name.c_str(), best->us, best->tbs, ex_best / best->us,
                    ex_best);
    } else {
      std::snprintf(line, sizeof(line), "%-10s M=%d: no passing variant", blk[0].shape.c_str(), blk[0].M);
    }
    best_lines.push_back(line);
    b = e;
  }
  for (const auto& l : best_lines) std::printf("%s\n", l.c_str());
  std::printf("%s\n", all_pass ? "ALL CHECKS PASSED" : "SOME CHECKS FAILED (see 'check' column)");
  CK(cudaFree(ws));
  CK(cudaFree(cnt));
  CK(cudaFree(scratch));
  return all_pass ? 0 : 1;
}
