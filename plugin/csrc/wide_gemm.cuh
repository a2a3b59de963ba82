// The wide (wgmma) kernel shared by w4a16_gemm.cu (int4 weights, from 17 tokens) and fp4_gemm.cu (FP4 experts at
// prefill sizes): y[M, N] = x[M, K] @ W[N, K]^T over the blob of w4a16_gemm.cuh, tokens as the MMA's N.
//
// The streaming kernel (w4a16_gemm.cuh) issues one mma.sync per 8 tokens and re-stages x for every 64 weight rows,
// so from ~24 tokens its consumer warps, not the weights, set the pace (ncu: latency-bound, DRAM 23% busy at M =
// 32). This kernel feeds the same blob to wgmma: a packet's lane vectors are wgmma A fragments as they are (the 4
// tiles of a group are the 4 warps of a warpgroup, 64 rows), and x is the shared-memory B operand, N = NTOK tokens,
// so one instruction covers 64 rows x NTOK (16 to 128) tokens x 16 K and reads x from shared memory itself. A CTA
// has WG (2 or 4) consumer warpgroups, one per tile group, sharing each staged x, and one producer warpgroup (one
// lane issues the bulk copies, as in the streaming kernel; its registers go to the consumers). A policy P turns a
// batch of 2 packets (128 K, 8 k-steps) into A fragments and says how scales apply (Scaling):
//   kFoldPerBatch  the batch's mma's accumulate from zero into `part`, then acc += part * the batch's fp32 scales
//                  (int4, group size 128: the weights are never rounded);
//   kPerChannel    the mma's accumulate into acc; the outputs are multiplied by the batch's (every batch's) scales
//                  (int4, one scale per output channel);
//   kNone          the A fragments are the weights as the mma's take them (FP4: e2m1 times its block scale, exact in
//                  bf16; int4 prescaled: (u - z) * s rounded once to bf16); the mma's accumulate into acc over all
//                  of K.
// Every policy's outputs are then multiplied by Params::row_scale when set (FP4's per-row factor).
//
// Experts (FP4 MoE): with Params::offsets the rows of x are sorted by expert, expert e's rows [offsets[e],
// offsets[e+1]); grid slice blockIdx.z runs the z-th expert with rows, in passes of NTOK tokens. A pass's tokens
// are a window of x starting on a multiple of 8 (the core-matrix height): [8 tg, 8 tg + NTOK) from tg = offsets[e]
// / 8; the window's rows of other experts are computed and not stored. Without offsets: one expert, rows [0, M).
//
// Schedules: a CTA runs whole tiles of WG tile groups, K split over a cluster of 1-8 CTAs that add up their partial
// sums in distributed shared memory (split-K), or, for one pass of one expert when that is faster (pick_stream_k), the
// CTAs (one per SM) share out (tile, ring stage) units evenly and add up the tiles cut between them through a global
// slot and flag per CTA (stream-K; kStreamK below).
//
// x must reach wgmma in the packets' permuted k order (w4a16_gemm.cuh) and in core matrices (8 tokens x 8 K):
// prep_x writes xp [stages of KS K][x_groups token groups][KS/8 core matrices along K][8 tokens][8 K] (zero past M
// and K) into the caller's workspace, so each stage's window is one contiguous bulk copy. The kernel is a
// programmatic dependent launch of the prep: its producer fetches the first stages' weights while the prep runs.
#pragma once

#include "w4a16_gemm.cuh"
#include "wgmma.cuh"

#include <algorithm>
#include <type_traits>

namespace cublade {
namespace wide {

constexpr int kBlobChunkK = lowbit::kChunk * lowbit::kPacketK;  // 512: K per chunk of the blob
constexpr int kMaxPassRows = 128;                                // rows per pass (but the int4 op's rounded passes)
constexpr int kRoundedPassRows = 256;  // rows per pass of the int4 op's rounded-weight passes (Int4PrescaledBatch)
// Stream-K: a CTA's slot of fp32 partial sums, NTOK / 2 per consumer thread: NTOK x WG <= 256 up to 128 tokens,
// 512 at 256 (2 warpgroups).
__host__ __device__ constexpr int slot_floats(int ntok) { return ntok > kMaxPassRows ? 64 * 512 : 64 * 256; }

// Tokens per pass (wgmma N) for a pass of `rows` rows. A pass costs about its token count whatever the rows (padded
// tokens are computed), hence the steps of 16 and 32: int4 8192x28672 at 32 / 64 / 128 tokens 52.7 / 77.9 / 125.8
// us, 47.6 at 16 (benchmarks/tuning/w4a16_wide.cu).
constexpr int ntok(int64_t rows) {
  return rows <= 16 ? 16 : rows <= 32 ? 32 : rows <= 48 ? 48 : rows <= 64 ? 64 : rows <= 96 ? 96 : 128;
}

// Token groups of 8 that xp holds per stage: one window at token 0 (no offsets, M <= NTOK), else a window may start
// at any token group of x.
constexpr int64_t x_groups(int64_t M, int ntok, bool grouped) {
  return !grouped && M <= ntok ? ntok / 8 : (M - 1) / 8 + ntok / 8;
}
// Workspace bytes of the prepped x for K (every stage size: K rounded up to the blob's chunks).
constexpr int64_t x_workspace_bytes(int64_t M, int64_t K, int ntok, bool grouped) {
  return (K + kBlobChunkK - 1) / kBlobChunkK * kBlobChunkK * 2 * 8 * x_groups(M, ntok, grouped);
}
// Stream-K's part of the workspace, after the prepped x: a flag per CTA (at most one CTA per SM), then a slot each.
constexpr int64_t stream_k_flag_bytes(int sms) { return (sms * 4 + 127) / 128 * 128; }
constexpr int64_t stream_k_bytes(int sms, int ntok) {
  return stream_k_flag_bytes(sms) + int64_t(sms) * slot_floats(ntok) * 4;
}
// The workspace a launch_kernel of up to M rows needs; sms = 0: none for stream-K (then it is not picked).
constexpr int64_t workspace_bytes(int64_t M, int64_t K, int ntok, bool grouped, int sms) {
  return x_workspace_bytes(M, K, ntok, grouped) + (grouped ? 0 : stream_k_bytes(sms, ntok));
}

// xp's 16-byte unit i = ((c * xg + tg) * KS/8 + kb) * 8 + r: token 8 tg + r, logical K 8 kb .. 8 kb + 7 of stage c
// (KS K per stage; xg = x_groups), i.e. logical k kl = c KS + 8 kb of packet P = kl / 64, k-step s = (kl % 64) / 16
// and half h = (kl % 16) / 8; logical pair t (k 2t, 2t+1, + 8h) is actual K0(s, t) + 2h (w4a16_gemm.cuh: K0 = 64 P +
// 32 (s / 2) + 8 t + 4 (s % 2)). Lets the kernel launched after it (PDL) start at once: it waits for xp itself.
// flags: the stream-K kernel's (nflags of them), zeroed here for the kernel that follows (null: none).
template <typename T>
__global__ void prep_x(const T* __restrict__ x, int64_t x_stride, int M, int K, int xg, int ks, int stages_k,
                       uint4* __restrict__ xp, int* __restrict__ flags = nullptr, int nflags = 0) {
  lowbit::pdl_launch_dependents();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < nflags; i += gridDim.x * blockDim.x) flags[i] = 0;
  const int kbs = ks / 8;
  const int64_t total = static_cast<int64_t>(stages_k) * xg * kbs * 8;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int r = static_cast<int>(i % 8), kb = static_cast<int>((i / 8) % kbs);
    const int64_t rest = i / (8 * kbs);
    const int tok = static_cast<int>(rest % xg) * 8 + r, c = static_cast<int>(rest / xg);
    const int kl = c * ks + 8 * kb, s = (kl % 64) / 16, h = (kl % 16) / 8;
    const int k0 = kl / 64 * 64 + 32 * (s / 2) + 4 * (s % 2) + 2 * h;
    uint32_t v[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const int k = k0 + 8 * t;
      v[t] = tok < M && k < K ? *reinterpret_cast<const uint32_t*>(x + tok * x_stride + k) : 0u;
    }
    xp[i] = make_uint4(v[0], v[1], v[2], v[3]);
  }
}

enum class Scaling { kFoldPerBatch, kPerChannel, kNone };

struct Params {
  const unsigned char* xp;  // prepped x
  int x_groups;             // its token groups per stage
  const unsigned char* w;   // the blob ([experts] x groups x blob_chunks x 4 tile blocks)
  const int* offsets;       // int32 [experts + 1] (rows sorted by expert), or null: one expert, rows [0, M)
  int experts;
  const float* row_scale;   // [experts, groups * 64] factor per output row, or null
  int M, N, groups;
  int blob_chunks;          // the blob's chunks of 512 K
  int chunks;               // ring stages of KS K over the whole K
  int chunks_per_cta, stages;
  void* out;
  int64_t out_stride;
  // Stream-K (kStreamK): tiles of WG tile groups x ring stages, the units the CTAs share out; a slot of partial
  // sums (slot_floats(NTOK)) and a flag per CTA.
  int units;
  float* slots;
  int* flags;
};

// Stream-K's walk of a CTA's units and its flags: lowbit::sk_first_unit, sk_segments, ld_acquire, st_release
// (w4a16_gemm.cuh).
using lowbit::ld_acquire;
using lowbit::sk_first_unit;
using lowbit::sk_segments;
using lowbit::st_release;

// Shared memory: 128-byte barrier header, then stages x [WG tile groups' KS-K blocks (4 tiles: KS/64 packets, then
// their scale records) | x: NTOK tokens x KS K]. KS = 512 stages a whole chunk of the blob (one copy per tile
// group); KS = 256 half of one (two copies per tile), which leaves room for 4 warpgroups at 64 tokens or 128
// tokens at 2. Per-channel records are the same in every chunk: a half-chunk stage copies them whole.
template <class P, int NTOK, int WG, int KS>
struct Layout {
  static_assert(KS == 512 || KS == 256 || KS == 128, "a stage is a chunk of the blob, half or a quarter of one");
  static constexpr int kPerChunk = kBlobChunkK / KS;  // stages per chunk of the blob
  static constexpr bool kRecWhole = P::kScaling == Scaling::kPerChannel;
  static constexpr int kBlobTileBytes = lowbit::kChunk * P::kPacketBytes + P::kBlobRecBytes;
  static constexpr int kPacketBytes = KS / lowbit::kPacketK * P::kPacketBytes;  // a tile's packets in a stage
  static constexpr int kRecBytes = kRecWhole ? P::kBlobRecBytes : P::kBlobRecBytes / kPerChunk;  // and records
  static constexpr int kTileBytes = kPacketBytes + kRecBytes;
  static constexpr int kGroupBytes = lowbit::kGroupTiles * kTileBytes;
  static constexpr int kXBytes = NTOK * KS * 2;
  static constexpr int kStageBytes = WG * kGroupBytes + kXBytes;
  static constexpr int kRedBytes = NTOK / 2 * WG * 128 * 4;  // the K splits' partial sums, in the ring's memory
  static constexpr int kMaxStages = std::min(4 * kPerChunk, lowbit::kMaxStages);
  static constexpr int bytes(int stages) { return 128 + stages * kStageBytes; }
};

// A CTA is WG consumer warpgroups and one producer warpgroup (one lane of it issues the copies). The producer gives
// its registers to the consumers (setmaxnreg): 4 warpgroups at 64 tokens need ~100 registers a thread, and the launch
// bound of 640 threads caps every thread at 96. The CTA's registers are a fixed pool (threads x the launch count):
// setmaxnreg.inc waits for registers the CTA's own decs returned, so asking for more than the pool holds hangs. With
// token windows (kWindows) the producer keeps its pass state and spilled at 24 registers (ptxas -v: 76 bytes, FP4 at
// 4 warpgroups); its 40 leave those consumers 104.
template <int WG, bool kWindows>
struct Regs {
  static constexpr int kThreads = (WG + 1) * 128;
  static constexpr int kLaunch = 65536 / kThreads / 8 * 8;  // ptxas's count under __launch_bounds__(kThreads, 1)
  static constexpr int kProducer = kWindows ? 40 : 24;
  static constexpr int kConsumer = std::min(240, (kThreads * kLaunch - 128 * kProducer) / (WG * 128) / 8 * 8);
  static_assert(128 * kProducer + WG * 128 * kConsumer <= kThreads * kLaunch, "setmaxnreg beyond the CTA's pool");
};

// Issue order (CUTLASS's "ping-pong"): with two consumer warpgroups from 48 tokens, warpgroup w waits on named
// barrier 1 + w before it issues a batch's 8 mma's and lets the other go once they are issued, so the tensor cores run
// whole batches in turn, one warpgroup's while the other dequantizes (and folds). Left free, both tend to issue
// together and then dequantize together while the tensor cores idle. benchmarks/tuning/wgmma_rate.cu (no memory
// traffic), share of the tensor peak, free -> ordered: int4 g128 at 128 / 96 / 64 tokens 72.4% /
// 67.5% / 59.4% -> 84.4% / 79.3% / 65.4%; FP4's loop (no fold) at 128 / 96 85.3% / 75.0% -> 99.1% / 85.4%. At 32
// tokens (44.7% -> 39.5%) and on 4 warpgroups (e.g. 63.6% -> 54.8% at 48) ordering lost, so those run free.
// The int4 op (experiments/int4_ab.cu, same machine, alternated, us): 8192x28672 M = 96 / 128 / 256 105.7 / 128.5 /
// 254.6 -> 102.0 / 119.9 / 237.3, the other three shapes 2-7% at 96-256 rows; at 48 / 64 rows on the shapes that run
// 2 warpgroups there 4-8% (28672x8192 63.3 / 71.6 -> 59.8 / 66.1). FP4 experts: at 128 tokens (48 a pass) 1.5-3%, from
// 256 no change beyond noise (the FP4 kernel's time goes elsewhere).
template <int NTOK, int WG>
constexpr bool kOrderedIssue = WG == 2 && NTOK >= 48;
__device__ __forceinline__ void bar_sync(int id) { asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id) { asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory"); }
// Named barrier 3: the WG consumer warpgroups only (stream-K's epilogue; the producer has left).
template <int WG>
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 3, %0;" ::"n"(WG * 128) : "memory"); }

// k-steps per issue: P::kSteps where the policy sets it, else a batch of 8.
template <class P, class = void>
struct IssueSteps { static constexpr int value = 8; };
template <class P>
struct IssueSteps<P, std::void_t<decltype(P::kSteps)>> { static constexpr int value = P::kSteps; };

template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N)); }

// P provides: using T (x and out); kPacketBytes (512: 4-bit weights, 1024: 8-bit; w4a16_gemm.cuh); kBlobRecBytes
// (record bytes per blob tile block); kScaling; kRowScale (whether Params::row_scale may be set); and
//   __device__ static void batch(const unsigned char* packets, const unsigned char* recs, int b, int lane,
//                                uint32_t (&a)[8][4], float& s_lo, float& s_hi)
// the A fragments of k-steps 8b .. 8b+7 of the stage's packets of one tile (recs: that tile's records in the
// stage) and the batch's scales of rows g and g+8 (kFoldPerBatch, kPerChannel). A kNone policy may instead set
// kSteps = 4 and provide steps(packets, recs, b, h, lane, uint32_t (&a)[4][4]) (k-steps 8b + 4h .. 8b + 4h + 3):
// the kernel then issues 4 mma's at a time, with half the fragment registers live under them.
// kWindows: experts (Params::offsets) or more rows than NTOK, in passes over token windows; without it the kernel
// makes one pass over rows [0, M), M <= NTOK, and keeps no pass state in registers (the int4 op's 48-64 token
// configurations are at their register limit).
// kStreamK (one pass, no windows; every tile has WG tile groups): a unit is (tile of WG tile groups, ring stage), and
// the gridDim.x CTAs (one per SM at most) share the prm.units units evenly, CTA i the units [sk_first_unit(i),
// sk_first_unit(i + 1)), so every SM works to the end whatever the tile count (split-K's grid is whole tiles: 224
// CTAs of 8192x28672 run 1.7 waves of 132). A tile cut between CTAs belongs to the CTA holding its last stage. It
// does that tile last (sk_segments) and adds the partial sums the lower CTAs left in their slots (each did its share
// of the tile first and raised its flag) in a fixed order, so the outputs do not depend on timing; an owner waits only
// for lower CTAs, which did that work first (no deadlock even if not every CTA is resident, as long as CTAs start in
// index order, as they do in practice).
template <class P, int NTOK, int WG, int KS, bool kWindows, bool kStreamK = false>
__global__ void __launch_bounds__(Regs<WG, kWindows>::kThreads, 1)
    wide_gemm_kernel(const __grid_constant__ Params prm) {
  static_assert(!(kStreamK && kWindows), "stream-K runs one pass of one expert");
  static_assert(!kStreamK || Layout<P, NTOK, WG, KS>::kRedBytes <= slot_floats(NTOK) * 4, "a slot holds a CTA's sums");
  using T = typename P::T;
  using Lay = Layout<P, NTOK, WG, KS>;
  constexpr int ND = NTOK / 2;  // accumulators per thread
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int split = blockIdx.y, nsplit = gridDim.y;
  const int cb = split * prm.chunks_per_cta;
  const int nchunks = max(min(cb + prm.chunks_per_cta, prm.chunks) - cb, 0);
  const int group0 = blockIdx.x * WG, ngroups = kStreamK ? WG : min(WG, prm.groups - group0);
  const int nst = prm.stages;
  // The expert and its rows (the offsets were written before the x prep ran, so they are visible before pdl_wait).
  int e = 0, r0 = 0, r1 = prm.M;
  if (kWindows && prm.offsets != nullptr) {
    e = lowbit::nth_expert_with_rows(prm.offsets, prm.experts, blockIdx.z);
    if (e < 0) return;  // the whole CTA: every warp got the same answer
    r0 = prm.offsets[e];
    r1 = prm.offsets[e + 1];
  }
  const int64_t expert_bytes = static_cast<int64_t>(prm.groups) * prm.blob_chunks * lowbit::kGroupTiles *
                               Lay::kBlobTileBytes;
  const unsigned char* wexp = prm.w + e * expert_bytes;
  const int npass = kWindows ? (r1 - r0 / 8 * 8 + NTOK - 1) / NTOK : 1;  // windows of NTOK tokens from 8 (r0 / 8)
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + lowbit::kMaxStages;
  auto stage = [&](int s) { return smem + 128 + s * Lay::kStageBytes; };
  if (threadIdx.x == 0) {
    for (int s = 0; s < nst; ++s) {
      lowbit::mbar_init(full + s, 1);
      lowbit::mbar_init(empty + s, ngroups * 4);  // the consumer warps with a tile group (the last CTA may have fewer)
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  const int wg = warp / 4, wq = warp % 4;
  if (wg == WG) {  // ---- producer warpgroup: one lane issues the stage's copies ----
    setmaxnreg_dec<Regs<WG, kWindows>::kProducer>();
    const bool issuer = warp == WG * 4 && lane == 0;
    const uint64_t wpol = lowbit::CUBLADE_WEIGHT_POLICY(), xpol = lowbit::policy_evict_last();
    auto weights = [&](int g0, int ng, int cc, int s) {  // ring stage cc of K's blocks of tile groups [g0, g0 + ng)
      const int bc = cc / Lay::kPerChunk, half = cc % Lay::kPerChunk;
      for (int q = 0; q < ng; ++q) {
        unsigned char* dst = stage(s) + q * Lay::kGroupBytes;
        const int64_t block = static_cast<int64_t>(g0 + q) * prm.blob_chunks + bc;  // of 4 tile blocks
        const unsigned char* src = wexp + block * lowbit::kGroupTiles * Lay::kBlobTileBytes;
        if constexpr (Lay::kPerChunk == 1) {
          lowbit::bulk_g2s(dst, src, Lay::kGroupBytes, full + s, wpol);
        } else {
          for (int tile = 0; tile < lowbit::kGroupTiles; ++tile, dst += Lay::kTileBytes, src += Lay::kBlobTileBytes) {
            lowbit::bulk_g2s(dst, src + half * Lay::kPacketBytes, Lay::kPacketBytes, full + s, wpol);
            const int rec = lowbit::kChunk * P::kPacketBytes + (Lay::kRecWhole ? 0 : half * Lay::kRecBytes);
            lowbit::bulk_g2s(dst + Lay::kPacketBytes, src + rec, Lay::kRecBytes, full + s, wpol);
          }
        }
      }
    };
    auto activations = [&](int cc, int s, int tg) {  // ring stage cc of K's x window of NTOK tokens from group tg
      lowbit::bulk_g2s(stage(s) + WG * Lay::kGroupBytes,
                       prm.xp + (static_cast<int64_t>(cc) * prm.x_groups + tg) * (KS * 16), Lay::kXBytes, full + s,
                       xpol);
    };
    const uint32_t stage_tx = ngroups * Lay::kGroupBytes + Lay::kXBytes;
    if constexpr (kStreamK) {  // the CTA's units in sk_segments' order; the first stages' weights before xp is ready
      if (issuer) {
        const int u0 = sk_first_unit(blockIdx.x, prm.units, gridDim.x);
        const int u1 = sk_first_unit(blockIdx.x + 1, prm.units, gridDim.x);
        const int first = min(nst, u1 - u0);
        int j = 0;  // the unit's place in the CTA's order
        sk_segments(u0, u1, prm.chunks, [&](int tile, int c0, int c1) {
          for (int c = c0; c < c1 && j < first; ++c, ++j) {
            lowbit::mbar_expect_tx(full + j, stage_tx);
            weights(tile * WG, WG, c, j);
          }
        });
        lowbit::pdl_wait();
        j = 0;
        sk_segments(u0, u1, prm.chunks, [&](int tile, int c0, int c1) {
          for (int c = c0; c < c1; ++c, ++j) {
            const int s = j % nst;
            if (j >= first) {
              if (j >= nst) lowbit::mbar_wait(empty + s, (j / nst - 1) & 1);
              lowbit::mbar_expect_tx(full + s, stage_tx);
              weights(tile * WG, WG, c, s);
            }
            activations(c, s, 0);
          }
        });
      }
    } else {
      for (int p = 0; p < npass; ++p) {
        const int tg = r0 / 8 + p * (NTOK / 8), it = p * nchunks;  // the window; stages streamed before it
        if (issuer) {
          // The first pass's first stages' weights go out before xp is ready (the x prep may still run).
          const int first = it == 0 ? min(nst, nchunks) : 0;
          for (int c = 0; c < first; ++c) {
            lowbit::mbar_expect_tx(full + c, stage_tx);
            weights(group0, ngroups, cb + c, c);
          }
          if (it == 0) lowbit::pdl_wait();
          for (int c = 0; c < first; ++c) activations(cb + c, c, tg);
          for (int c = first; c < nchunks; ++c) {
            const int s = (it + c) % nst;
            if (it + c >= nst) lowbit::mbar_wait(empty + s, ((it + c) / nst - 1) & 1);
            lowbit::mbar_expect_tx(full + s, stage_tx);
            weights(group0, ngroups, cb + c, s);
            activations(cb + c, s, tg);
          }
        }
        if (nsplit > 1) {  // the consumers' barriers below; the next pass's copies wait for them
          __syncthreads();
          lowbit::cluster_sync();
          lowbit::cluster_sync();
        }
      }
    }
    return;
  }

  // ---- consumer warpgroup wg: tile group group0 + wg, warp wq its tile wq ----
  setmaxnreg_inc<Regs<WG, kWindows>::kConsumer>();
  const bool consumer = wg < ngroups;
  // Ordered issue between the two warpgroups when both have a tile group: warpgroup 0 goes first; the last batch of
  // warpgroup 1 lets nobody go, so no arrival is left pending.
  const bool ordered = kOrderedIssue<NTOK, WG> && ngroups == 2;
  // Ring slot s's math into acc (first / last: whether it holds the CTA's first / last batch).
  auto mma_stage = [&](int s, bool first_stage, bool last_stage, float(&acc)[ND], [[maybe_unused]] float(&part)[ND],
                       float& s_lo, float& s_hi) {
    const unsigned char* tb = stage(s) + wg * Lay::kGroupBytes + wq * Lay::kTileBytes;
    const uint32_t xs = lowbit::smem_u32(stage(s) + WG * Lay::kGroupBytes);
    constexpr int kSteps = IssueSteps<P>::value, kIssues = KS / 128 * 8 / kSteps;
    static_assert(kSteps == 8 || P::kScaling == Scaling::kNone, "the fold needs the batch's mma's at once");
#pragma unroll
    for (int i = 0; i < kIssues; ++i) {
      const int b = i * kSteps / 8, h = i % (8 / kSteps);  // batch, and the part of it
      uint32_t a[kSteps][4];  // the k-steps issued together
      if constexpr (kSteps == 8) P::batch(tb, tb + Lay::kPacketBytes, b, lane, a, s_lo, s_hi);
      else P::steps(tb, tb + Lay::kPacketBytes, b, h, lane, a);
      const bool first = first_stage && i == 0, last = last_stage && i == kIssues - 1;
      if (ordered && !(first && wg == 0)) bar_sync(1 + wg);
      wgmma::fence();
#pragma unroll
      for (int k = 0; k < kSteps; ++k) {
        // k-step 8b + kSteps h + k: its two core matrices of every 8 tokens (128 B apart), token groups KS * 16 B
        // apart
        const uint64_t desc = wgmma::desc(xs + (8 * b + kSteps * h + k) * 256, 128, KS * 16);
        if constexpr (P::kScaling == Scaling::kFoldPerBatch) wgmma::MmaRS<T, NTOK>::run(part, a[k], desc, k);
        else wgmma::MmaRS<T, NTOK>::run(acc, a[k], desc, 1);
      }
      // The next batch rewrites a (these mma's read it as they run); the stage's last batch frees the stage.
      wgmma::commit();
      if (ordered && !(last && wg == 1)) bar_arrive(2 - wg);
      wgmma::wait<0>();
      if constexpr (P::kScaling == Scaling::kFoldPerBatch) {
        wgmma::fence_regs(part);
#pragma unroll
        for (int i = 0; i < ND; ++i) acc[i] = fmaf(part[i], (i & 2) ? s_hi : s_lo, acc[i]);
      } else {
        wgmma::fence_regs(acc);
      }
    }
  };
  // The outputs of tile group `group` (this warpgroup's), tokens from token group tg, rows [r0, r1) stored.
  auto store = [&](int group, int tg, const float(&acc)[ND], float s_lo, float s_hi) {
    const int row0 = group * 64 + wq * lowbit::kTileN + g;  // this thread's rows: row0, row0 + 8
    float o_lo = P::kScaling == Scaling::kPerChannel ? s_lo : 1.0f;
    float o_hi = P::kScaling == Scaling::kPerChannel ? s_hi : 1.0f;
    if (P::kRowScale && prm.row_scale != nullptr) {
      const float* rs = prm.row_scale + static_cast<int64_t>(e) * prm.groups * 64;
      o_lo *= rs[row0];
      o_hi *= rs[row0 + 8];
    }
    T* out = static_cast<T*>(prm.out);
#pragma unroll
    for (int i = 0; i < ND; ++i) {
      const int row = row0 + 8 * ((i >> 1) & 1), tok = 8 * tg + 8 * (i >> 2) + 2 * t + (i & 1);
      if (row < prm.N && tok >= r0 && tok < r1)
        out[static_cast<int64_t>(tok) * prm.out_stride + row] = lowbit::from_float<T>(acc[i] * ((i & 2) ? o_hi : o_lo));
    }
  };

  if constexpr (kStreamK) {
    const int u0 = sk_first_unit(blockIdx.x, prm.units, gridDim.x);
    const int u1 = sk_first_unit(blockIdx.x + 1, prm.units, gridDim.x);
    const int tid = threadIdx.x;  // < WG * 128
    int j = 0;                    // the unit's place in the CTA's order
    sk_segments(u0, u1, prm.chunks, [&](int tile, int c0, int c1) {
      float acc[ND], part[ND];
#pragma unroll
      for (int i = 0; i < ND; ++i) acc[i] = 0.0f;
      float s_lo = 1.0f, s_hi = 1.0f;
      for (int c = c0; c < c1; ++c, ++j) {
        const int s = j % nst;
        lowbit::mbar_wait(full + s, (j / nst) & 1);
        mma_stage(s, j == 0, j == u1 - u0 - 1, acc, part, s_lo, s_hi);
        __syncwarp();
        if (lane == 0) lowbit::mbar_arrive(empty + s);
      }
      if (c1 < prm.chunks) {  // not the tile's last stage: the partial sums go to this CTA's slot for the owner
        float* slot = prm.slots + static_cast<int64_t>(blockIdx.x) * slot_floats(NTOK);
#pragma unroll
        for (int i = 0; i < ND; ++i) __stcg(slot + i * WG * 128 + tid, acc[i]);
        consumers_sync<WG>();
        if (tid == 0) {
          __threadfence();
          st_release(prm.flags + blockIdx.x, 1);
        }
        return;
      }
      if (c0 > 0) {  // the lower CTAs whose ranges end inside this tile did its first stages
        const int tile_u = tile * prm.chunks;
        auto contributor = [&](int i) { return i >= 0 && sk_first_unit(i + 1, prm.units, gridDim.x) > tile_u; };
        if (tid == 0)
          for (int i = blockIdx.x - 1; contributor(i); --i)
            while (ld_acquire(prm.flags + i) == 0) __nanosleep(64);
        consumers_sync<WG>();
        for (int i = blockIdx.x - 1; contributor(i); --i) {
          const float* slot = prm.slots + static_cast<int64_t>(i) * slot_floats(NTOK);
#pragma unroll
          for (int k = 0; k < ND; ++k) acc[k] += __ldcg(slot + k * WG * 128 + tid);
        }
      }
      store(tile * WG + wg, 0, acc, s_lo, s_hi);
    });
  } else {
    for (int p = 0; p < npass; ++p) {
      const int tg = r0 / 8 + p * (NTOK / 8), it = p * nchunks;
      float acc[ND];
#pragma unroll
      for (int i = 0; i < ND; ++i) acc[i] = 0.0f;
      float s_lo = 1.0f, s_hi = 1.0f;  // the last batch's scales (kPerChannel: the same in every batch)
      if (consumer) {
        float part[ND];
        for (int c = 0; c < nchunks; ++c) {
          const int s = (it + c) % nst;
          lowbit::mbar_wait(full + s, ((it + c) / nst) & 1);
          mma_stage(s, p == 0 && c == 0, p == npass - 1 && c == nchunks - 1, acc, part, s_lo, s_hi);
          __syncwarp();
          if (lane == 0) lowbit::mbar_arrive(empty + s);
        }
      }

      // ---- the splits of the cluster (the producer warpgroup meets these barriers on its own path), then the outputs
      const int tid = threadIdx.x;  // < WG * 128
      if (nsplit > 1) {
        __syncthreads();  // every stage consumed: the ring's memory holds the partial sums now
        float* red = reinterpret_cast<float*>(smem + 128);
        if (consumer)
#pragma unroll
          for (int i = 0; i < ND; ++i) red[i * WG * 128 + tid] = acc[i];
        lowbit::cluster_sync();
        if (split == 0 && consumer)
          for (int q = 1; q < nsplit; ++q)
#pragma unroll
            for (int i = 0; i < ND; ++i) acc[i] += lowbit::ld_dsmem(red + i * WG * 128 + tid, q);
        lowbit::cluster_sync();  // the other CTAs keep their shared memory until rank 0 has read it
      }
      if (split == 0 && consumer) store(group0 + wg, tg, acc, s_lo, s_hi);
    }
  }
}

// K splits: the CTAs (WG tile groups each) fill at most one wave at one CTA per SM, so split K while that leaves
// every SM at most one CTA and each split at least 8 chunks of the blob. Measured (int4, w4a16_wide.cu, M = 32):
// 28672x8192 (64 CTAs) 104.3 us on 1 split, 60.2 on 2; 8192x10240 (80 CTAs) 37.7 on 1, 41.7 on 2; 4096x14336 (112)
// 24.1 on 1, 29.7 on 2.
inline int pick_split(int64_t ctas, int blob_chunks, int sms) {
  int S = 1;
  while (S < lowbit::kMaxSplit && 2 * ctas * S <= sms && blob_chunks >= 16 * S) S *= 2;
  return S;
}

// Stream-K instead of split-K (one pass of one expert, every tile WG tile groups) when it should be 3% faster. Time in
// ring stages per SM: split-K's grid of ctas x S CTAs (one per SM) runs its waves of ceil(chunks / S) stages each;
// stream-K runs units / sms stages and about 3 more (each CTA's two cut tiles, the partial sums). Measured (int4 g128,
// benchmarks/tuning/w4a16_wide.cu; stream-K / split-K
// time, same configuration): units / sms and split-K's stages 6.8 / 8 (4096x14336, 2 warpgroups, 32-64 tokens)
// 1.11-1.17; 13.6 / 16 (4096x14336 at 96-128; 8192x28672 on 4 warpgroups at 32) 1.02-1.06; 27.2 / 32 (8192x28672,
// 2 warpgroups, 32-64 tokens) 0.93-0.97; 54.3 / 64 (8192x28672 at 96-256) 0.87-0.89; 9.7 / 16 and 19.4 / 32
// (8192x10240) 0.90-0.94 and 0.78; 27.2 / 28 and 54.3 / 56 (28672x8192, 2 splits) 1.09-1.11 and 0.97-1.00.
inline bool pick_stream_k(int64_t ctas, int S, int chunks, int sms) {
  const int64_t waves = ceil_div(ctas * S, sms), stages = ceil_div(chunks, S);
  return static_cast<double>(ctas) * chunks / sms + 3.0 < 0.97 * static_cast<double>(waves * stages);
}

constexpr int kStreamKSplit = -1;  // S for launch_kernel: stream-K

// The schedule launch_kernel picks for a launch of `ctas` CTAs (S = 0): K splits (pick_split), or kStreamKSplit
// where stream-K may run (sk_fits: one pass of one expert, every tile full) and pick_stream_k says it is faster.
// blob_chunks: the blob's chunks of 512 K; chunks: ring stages over the whole K.
inline int pick_schedule(int64_t ctas, bool sk_fits, int blob_chunks, int chunks, int sms) {
  const int S = pick_split(ctas, blob_chunks, sms);
  return sk_fits && pick_stream_k(ctas, S, chunks, sms) ? kStreamKSplit : S;
}

// The x prep, then the kernel (S: K splits, 0: pick (split-K or stream-K), kStreamKSplit: stream-K; stages = 0: as
// deep as fits). prm: w, offsets, experts, row_scale, M, N, out, out_stride set; x [M, K] (row stride x_stride);
// workspace: workspace_bytes(M, K, NTOK, offsets != null, sms_ws) bytes, where stream-K may run only if sms_ws =
// sms. pdl: the kernel is a programmatic dependent launch of the prep (it fetches its first weight stages while the
// prep runs).
template <class P, int NTOK, int WG, int KS, bool kWindows>
cudaError_t launch_kernel(Params prm, const void* x, int64_t x_stride, int K, int S, int stages, bool pdl,
                          void* workspace, int sms, cudaStream_t stream) {
  using Lay = Layout<P, NTOK, WG, KS>;
  const bool grouped = prm.offsets != nullptr;
  prm.xp = static_cast<const unsigned char*>(workspace);
  prm.x_groups = static_cast<int>(x_groups(prm.M, NTOK, grouped));
  prm.groups = static_cast<int>(ceil_div(prm.N, 64));
  prm.blob_chunks = static_cast<int>(ceil_div(K, kBlobChunkK));
  prm.chunks = static_cast<int>(ceil_div(K, KS));
  const int slices = static_cast<int>(lowbit::expert_slices(grouped, prm.experts, prm.M));
  const int64_t ctas = ceil_div(prm.groups, WG) * slices;
  const bool sk_fits = !kWindows && !grouped && prm.groups % WG == 0;  // every tile WG tile groups
  if (S == 0) S = pick_schedule(ctas, sk_fits, prm.blob_chunks, prm.chunks, sms);
  const bool stream_k = S == kStreamKSplit;
  if (stream_k && !sk_fits) return cudaErrorInvalidValue;
  if (stream_k) S = 1;
  if (S < 1 || S > lowbit::kMaxSplit) return cudaErrorInvalidValue;
  prm.chunks_per_cta = (prm.chunks + S - 1) / S;
  prm.stages = stages;
  if (prm.stages <= 0) {
    prm.stages = Lay::kMaxStages;
    while (prm.stages > 2 && Lay::bytes(prm.stages) > lowbit::kMaxSmemKB * 1024) --prm.stages;
  }
  const int smem = Lay::bytes(prm.stages);
  if (prm.stages > lowbit::kMaxStages || smem > lowbit::kMaxSmemKB * 1024 ||
      (S > 1 && Lay::kRedBytes > prm.stages * Lay::kStageBytes))
    return cudaErrorInvalidValue;

  if (!kWindows && (grouped || prm.M > NTOK)) return cudaErrorInvalidValue;
  using T = typename P::T;
  const int64_t x_units = static_cast<int64_t>(prm.chunks) * prm.x_groups * KS;  // 16-byte units: xg * 8 * KS / 8
  const int prep_blocks = static_cast<int>(std::min<int64_t>(ceil_div(x_units, 256), 8LL * sms));
  auto prep = [&](int* flags, int nflags) {
    prep_x<T><<<prep_blocks, 256, 0, stream>>>(static_cast<const T*>(x), x_stride, prm.M, K, prm.x_groups, KS,
                                               prm.chunks, static_cast<uint4*>(workspace), flags, nflags);
    return cudaGetLastError();
  };
  if constexpr (!kWindows) {
    if (stream_k) {
      constexpr auto kernel = wide_gemm_kernel<P, NTOK, WG, KS, false, true>;
      if (const cudaError_t e = lowbit::allow_max_smem<kernel>(); e != cudaSuccess) return e;
      prm.units = static_cast<int>(ctas * prm.chunks);
      const int grid = std::min(sms, prm.units);
      unsigned char* sk = static_cast<unsigned char*>(workspace) + x_workspace_bytes(prm.M, K, NTOK, grouped);
      prm.flags = reinterpret_cast<int*>(sk);
      prm.slots = reinterpret_cast<float*>(sk + stream_k_flag_bytes(sms));
      if (const cudaError_t e = prep(prm.flags, grid); e != cudaSuccess) return e;
      return lowbit::launch_split_k(kernel, dim3(static_cast<unsigned>(grid)), Regs<WG, false>::kThreads, smem, 1,
                                    stream, prm, pdl);
    }
  }
  constexpr auto kernel = wide_gemm_kernel<P, NTOK, WG, KS, kWindows>;
  if (const cudaError_t e = lowbit::allow_max_smem<kernel>(); e != cudaSuccess) return e;
  if (const cudaError_t e = prep(nullptr, 0); e != cudaSuccess) return e;
  return lowbit::launch_split_k(kernel, dim3(static_cast<unsigned>(ctas / slices), S, slices),
                                Regs<WG, kWindows>::kThreads, smem, S, stream, prm, pdl);
}

// Four warpgroups per CTA (256 rows sharing each staged x) when their grid (ctas_of_4 CTAs) still fills 3/4 of the
// SMs; else two. Measured with split-K (int4, w4a16_wide.cu, us, best splits, prep included; M = 17 / 24 / 32):
// 8192x28672 (112 CTAs of 4) 51.6 / 52.0 / 52.0 vs 59.3 / 59.4 / 59.9 with 2; 4096x14336 (56 CTAs of 4) 24.1 (2
// splits) vs 22.1; 28672x8192 (32) 82.9 vs 53.4. At 64 tokens (half-chunk stages, M = 48 / 64, PDL): 8192x28672
// 76.7 / 77.9 vs 78.9 / 79.8; the three smaller shapes lose (4096x14336 M = 64: 30.4+ vs 26.5). With stream-K the
// int4 op asks only at 16-32 tokens, the FP4 op at 32, the MXFP8 op never (their with_config / launch_wide).
inline bool four_warpgroups(int64_t ctas_of_4, int sms) { return 4 * ctas_of_4 >= 3LL * sms; }

// A kernel configuration: tokens per pass (wgmma N), consumer warpgroups per CTA, K per ring stage.
template <int NTOK, int WG, int KS>
struct PassConfig {
  static constexpr int kTokens = NTOK, kWarpgroups = WG, kStageK = KS;
};

}  // namespace wide
}  // namespace cublade
