// W4A16 GEMM for decode: y[M, N] = x[M, K] (bf16/fp16) @ dequant(W)[N, K]^T, W int4 with one bf16 scale
// (and, asymmetric, one zero point) per group of 32/64/128 K or per output channel. Numerics: the
// reference's w = (u - z) * s in fp32, summed in fp32 (cublade.ops.w4a16_gemm.w4a16_gemm_ref).
//
// Layout and the reasons: README.md, "w4a16_gemm"; the repacked tensors: w4a16_gemm.cuh and
// plugin/ops/w4a16_gemm.py (w4a16_repack).
//   packed  int32 [ceil(N/64), ceil(K/512), 4 tiles, 1024 + sbytes/4]: per tile block, 8 packets x 32 lanes x 4
//           words, then the chunk's scale records. Nibble u of lane (g, t), k-step s, in word s at bits 4j:
//           j=0 (row g, K0), 4 (g, K0+1), 1 (g+8, K0), 5 (g+8, K0+1), 2 (g, K0+2), 6 (g, K0+3), 3 (g+8, K0+2),
//           7 (g+8, K0+3), so that one mask+OR per pair gives the fragment register order.
//           Scale records: [512/G groups][8 g] x (s[row g], s[row g+8]) bf16, asymmetric (s[g], s[g+8], z[g],
//           z[g+8]) (z exact in bf16); per channel: one group, repeated in every chunk.
#define CUBLADE_KERNELS_ONLY  // the torch wrapper is w4a16_gemm_torch.cpp
#include "w4a16_gemm.cuh"
#include "wgmma.cuh"
#include "w4a16_gemm.h"

static_assert(cublade::kLowbitGroupRows == cublade::lowbit::kGroupTiles * cublade::lowbit::kTileN &&
                  cublade::kLowbitChunkK == cublade::lowbit::kChunk * cublade::lowbit::kPacketK &&
                  cublade::kLowbitTileWords == cublade::lowbit::kChunk * 128 &&
                  cublade::kLowbitMaxSplit == cublade::lowbit::kMaxSplit,
              "w4a16_gemm.h and w4a16_gemm.cuh disagree on the blob geometry");

#include <algorithm>

namespace cublade {
namespace {

using lowbit::kPacketK;
using lowbit::kTileN;

// int4 -> 16-bit float without a conversion instruction: OR the nibble u into the low mantissa bits of
// 128.0 (bf16 0x4300: ulp 1 for 128..255) or 1024.0 (fp16 0x6400: ulp 1 for 1024..2047); the result is
// exactly 128 + u (1024 + u); subtracting 128 + z (1024 + z) leaves u - z, exact. Two nibbles 16 bits
// apart become one packed pair with a single mask-and-OR (one LOP3).
template <typename T> struct Int4Magic;
template <> struct Int4Magic<__nv_bfloat16> {
  static constexpr uint32_t kBase = 0x43004300u;  // (128, 128)
  static constexpr float kBaseF = 128.0f;
};
template <> struct Int4Magic<__half> {
  static constexpr uint32_t kBase = 0x64006400u;  // (1024, 1024)
  static constexpr float kBaseF = 1024.0f;
};

template <typename T>
__device__ __forceinline__ uint32_t sub2(uint32_t a, uint32_t b) {
  uint32_t d;
  if constexpr (lowbit::is_bf16<T>()) {
    const __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                     *reinterpret_cast<const __nv_bfloat162*>(&b));
    d = *reinterpret_cast<const uint32_t*>(&r);
  } else {
    const __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
    d = *reinterpret_cast<const uint32_t*>(&r);
  }
  return d;
}

// (128 + z) as a packed pair (both halves equal) in T, from z as a float (exact: z <= 15).
template <typename T>
__device__ __forceinline__ uint32_t bias_pair(float z) {
  const float b = Int4Magic<T>::kBaseF + z;
  uint32_t d;
  if constexpr (lowbit::is_bf16<T>()) {
    const __nv_bfloat162 r = __float2bfloat162_rn(b);
    d = *reinterpret_cast<const uint32_t*>(&r);
  } else {
    const __half2 r = __float2half2_rn(b);
    d = *reinterpret_cast<const uint32_t*>(&r);
  }
  return d;
}

// One k-step's A fragment from one word: a[0] (row g, K0..K0+1), a[1] (row g+8, K0..), a[2] (row g,
// K0+2..), a[3] (row g+8, K0+2..).
template <typename T>
__device__ __forceinline__ void dequant_int4(uint32_t q, uint32_t bias_lo, uint32_t bias_hi, uint32_t (&a)[4]) {
  constexpr uint32_t kMask = 0x000F000Fu, kBase = Int4Magic<T>::kBase;
  a[0] = sub2<T>(lowbit::and_or(q, kMask, kBase), bias_lo);
  a[1] = sub2<T>(lowbit::and_or(q >> 4, kMask, kBase), bias_hi);
  a[2] = sub2<T>(lowbit::and_or(q >> 8, kMask, kBase), bias_lo);
  a[3] = sub2<T>(lowbit::and_or(q >> 12, kMask, kBase), bias_hi);
}

// Scale record of one group for rows (g, g+8): fp32 scales and packed (base + z) subtrahends.
template <typename T, bool ASYM, typename Rec>
__device__ __forceinline__ void unpack_rec(const Rec& r, float& s_lo, float& s_hi, uint32_t& b_lo, uint32_t& b_hi) {
  if constexpr (ASYM) {
    s_lo = bf16_lo(r.x); s_hi = bf16_hi(r.x);
    b_lo = bias_pair<T>(bf16_lo(r.y)); b_hi = bias_pair<T>(bf16_hi(r.y));
  } else {
    s_lo = bf16_lo(r); s_hi = bf16_hi(r);
  }
}

// int4 packets for the streaming kernel (w4a16_gemm.cuh). GS: group size 32 / 64 / 128, or 0 for one group per
// output channel (handled as one group per K slice: the repack repeats the record in every chunk, and a per-row
// scale may multiply any partial sum). Each group's k-steps accumulate from zero into `part` (fp32); at the
// group's end acc += part * scale, in fp32, so the weights are never rounded. A K slice starts on a group
// boundary for every GS, so which packet starts / ends a group is known at compile time. (Summing alternate
// k-steps into two partial sums, two independent mma chains at NT = 1, did not change M = 1 on the H200: 43.95 us
// either way, benchmarks/runs/2026-11-22-1723-*; the consumers' latency is not what limits M = 1.)
template <typename T_, int NT_, int GS, bool ASYM>
struct Int4Policy {
  using T = T_;
  static constexpr int NT = NT_;
  using Rec = typename std::conditional<ASYM, uint2, uint32_t>::type;
  static constexpr int kRecGS = GS == 0 ? lowbit::kChunk * kPacketK : GS;  // K per scale record
  static constexpr int kRecBytes = static_cast<int>(sizeof(Rec));
  static constexpr int kSBytes = lowbit::kChunk * kPacketK / kRecGS * 8 * kRecBytes;  // per tile block

  __device__ static const float* row_scale(const lowbit::GemmParams&, int) { return nullptr; }

  struct State {
    float s_lo = 0.0f, s_hi = 0.0f;  // the running group's fp32 scales, rows g and g+8
    uint32_t b_lo = 0, b_hi = 0;     // and its packed (base + z) subtrahends
    float part[NT][4];               // the running group's sum
  };
  template <int kSliceK>
  __device__ static const unsigned char* slice_records(const unsigned char* srec, int slice) {
    if constexpr (GS == 0) {
      return srec;  // one record per row, the same in every slice
    } else {
      static_assert(kSliceK % GS == 0, "a K slice must hold whole groups");
      return srec + slice * (kSliceK / GS) * 8 * kRecBytes;
    }
  }
  __device__ static void flush(State& st, float (&acc)[NT][4]) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      acc[n][0] = fmaf(st.part[n][0], st.s_lo, acc[n][0]);
      acc[n][1] = fmaf(st.part[n][1], st.s_lo, acc[n][1]);
      acc[n][2] = fmaf(st.part[n][2], st.s_hi, acc[n][2]);
      acc[n][3] = fmaf(st.part[n][3], st.s_hi, acc[n][3]);
    }
  }
  template <int j, int kSliceK>
  __device__ static void packet(State& st, const uint4 q, const unsigned char* srec, const uint4 (&xc)[2][NT],
                                float (&acc)[NT][4], int lane) {
    constexpr int kGS = GS == 0 ? kSliceK : GS;  // group within the slice
    constexpr bool kStart0 = (j * kPacketK) % kGS == 0;
    constexpr bool kStart1 = kGS == 32;
    constexpr bool kFlush0 = kGS == 32;
    constexpr bool kFlush1 = ((j + 1) * kPacketK) % kGS == 0;
    constexpr int kGroup0 = GS == 0 ? 0 : j * kPacketK / kGS;  // record (within the slice) of half 0
    const Rec* recs = reinterpret_cast<const Rec*>(srec) + (lane >> 2);
    uint32_t b1_lo = st.b_lo, b1_hi = st.b_hi;
    [[maybe_unused]] float s1_lo = 0.0f, s1_hi = 0.0f;
    if constexpr (kStart0) {
      st.b_lo = st.b_hi = bias_pair<T>(8.0f);  // symmetric: z = 8
      unpack_rec<T, ASYM>(recs[kGroup0 * 8], st.s_lo, st.s_hi, st.b_lo, st.b_hi);
    }
    if constexpr (kStart1) {
      b1_lo = b1_hi = bias_pair<T>(8.0f);
      unpack_rec<T, ASYM>(recs[(kGroup0 + 1) * 8], s1_lo, s1_hi, b1_lo, b1_hi);
    }
    uint32_t a[4][4];
    dequant_int4<T>(q.x, st.b_lo, st.b_hi, a[0]);
    dequant_int4<T>(q.y, st.b_lo, st.b_hi, a[1]);
    dequant_int4<T>(q.z, kStart1 ? b1_lo : st.b_lo, kStart1 ? b1_hi : st.b_hi, a[2]);
    dequant_int4<T>(q.w, kStart1 ? b1_lo : st.b_lo, kStart1 ? b1_hi : st.b_hi, a[3]);
    auto half = [&](int h, bool first) {  // two k-steps into the group's sum
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        if (first) lowbit::mma_16816_first<T>(st.part[n], a[2 * h], xc[h][n].x, xc[h][n].y);
        else lowbit::mma_16816<T>(st.part[n], a[2 * h], xc[h][n].x, xc[h][n].y);
        lowbit::mma_16816<T>(st.part[n], a[2 * h + 1], xc[h][n].z, xc[h][n].w);
      }
    };
    half(0, kStart0);
    if constexpr (kFlush0) flush(st, acc);
    if constexpr (kStart1) { st.s_lo = s1_lo; st.s_hi = s1_hi; st.b_lo = b1_lo; st.b_hi = b1_hi; }
    half(1, kStart1);
    if constexpr (kFlush1) flush(st, acc);
  }
};

// ---- The wide kernel (from 17 tokens; 9 on large weights): wgmma, tokens as the MMA's N ----------------------
// The streaming kernel issues one mma.sync per 8 tokens and re-stages x for every 64 weight rows, so from ~24
// tokens its consumer warps, not the weights, set the pace (ncu: latency-bound, DRAM 23% busy at M = 32). This
// kernel feeds the same blob to wgmma: a packet's lane vectors are wgmma A fragments as they are (the 4 tiles of
// a group are the 4 warps of a warpgroup, 64 rows), and x is the shared-memory B operand, N = NTOK tokens, so one
// instruction covers 64 rows x NTOK (16 to 128) tokens x 16 K and reads x from shared memory itself. A CTA has WG
// (2 or 4) consumer warpgroups, one per tile group, sharing each staged x, and one producer warpgroup (one lane
// issues the bulk copies, as in the streaming kernel; its registers go to the consumers). Per batch of 2 packets
// (128 K, 8 k-steps) the mma's accumulate from zero into `part`; the scale group's fp32 scales then fold it into
// acc, as the streaming kernel does, so the weights are never rounded (group size 128; per-channel scales multiply
// acc once at the end).
//
// x must reach wgmma in the packets' permuted k order (w4a16_gemm.cuh) and in core matrices (8 tokens x 8 K):
// prep_x writes xp [stages of KS K][NTOK/8][KS/8 core matrices along K][8 tokens][8 K] (zero past M and K) into the
// caller's workspace, so each stage's x is one contiguous bulk copy. The kernel is a programmatic dependent launch of
// the prep: its producer fetches the first stages' weights while the prep runs (a median 1.9 us per pass).
//
// Measured on the H200 (benchmarks/tuning/w4a16_wide.cu, 2026-11-22, us after do_bench's flush, prep included,
// streaming kernel / wide): 8192x28672 M = 16 59.2 / 62.2, M = 24 80.4 / 66.5, M = 32 88.7 / 67.1, M = 64 168.2 /
// 84.2; 8192x10240 M = 16 27.1 / 34.3, M = 24 42.4 / 36.8. So it takes M > 16, and 9-16 rows in 16-token passes
// on large weights (kSmallPassMinWeights, eighth session). Keeping batch i+1's mma's in flight
// while batch i is folded did not gain at 2 warpgroups (pairs of batches, M = 24-64: -0.8 to +2.5 us), and ptxas
// serializes the fully pipelined form at group size 128 (C7514: it will not let acc be read while another batch's
// mma's run).
namespace wide {

constexpr int kBlobChunkK = lowbit::kChunk * kPacketK;  // 512: K per chunk of the blob
constexpr int kMinRows = 17;                            // from this many rows the wide kernel, on every shape
constexpr int kMinSmallRows = 9;                        // from this many on large weights (kSmallPassMinWeights)
constexpr int kMaxPassRows = 128;                       // tokens per pass at most (wgmma N); more rows: more passes

// Passes of 9-16 rows (16 tokens) run the wide kernel when the weight has at least this many elements (64 MiB of
// int4). Measured (w4a16_wide.cu, 2026-11-22 eighth session, M = 16, us, prep included, streaming kernel / wide):
// 8192x28672 59.4 / 47.6, 28672x8192 53.6 / 50.5, but 8192x10240 26.8 / 29.5 and 4096x14336 20.2 / 21.4 (the wide
// kernel's fixed costs, the x prep and the pipeline's fill, weigh more on a shorter call). At 1-8 rows the
// streaming kernel was faster on all four (8192x28672 M = 8: 43.4 against 46.6 with 8 tokens per pass).
constexpr int64_t kSmallPassMinWeights = int64_t(1) << 27;

// Rows of the next wide pass when `left` rows remain (0: the streaming kernel takes them).
constexpr int64_t pass_rows(int64_t left, int64_t N, int64_t K) {
  return left >= kMinRows ? std::min<int64_t>(left, kMaxPassRows)
         : left >= kMinSmallRows && N * K >= kSmallPassMinWeights ? left
                                                                   : 0;
}

// Tokens per pass (wgmma N) for a pass of `rows` rows. A pass costs about its token count whatever the rows (padded
// tokens are computed), hence the steps of 16 and 32: 8192x28672 at 32 / 64 / 128 tokens 52.7 / 77.9 / 125.8 us
// (seventh session), 47.6 at 16 (eighth).
constexpr int ntok(int64_t rows) {
  return rows <= 16 ? 16 : rows <= 32 ? 32 : rows <= 48 ? 48 : rows <= 64 ? 64 : rows <= 96 ? 96 : 128;
}

// xp's 16-byte unit i = ((c * NTOK/8 + tg) * KS/8 + kb) * 8 + r: token 8 tg + r, logical K 8 kb .. 8 kb + 7 of
// stage c (KS K per stage), i.e. logical k kl = c KS + 8 kb of packet P = kl / 64, k-step s = (kl % 64) / 16 and
// half h = (kl % 16) / 8; logical pair t (k 2t, 2t+1, + 8h) is actual K0(s, t) + 2h (w4a16_gemm.cuh: K0 = 64 P +
// 32 (s / 2) + 8 t + 4 (s % 2)). Lets the kernel launched after it (PDL) start at once: it waits for xp itself.
template <typename T>
__global__ void prep_x(const T* __restrict__ x, int64_t x_stride, int M, int K, int ntok, int ks, int stages_k,
                       uint4* __restrict__ xp) {
  lowbit::pdl_launch_dependents();
  const int kbs = ks / 8;
  const int64_t total = static_cast<int64_t>(stages_k) * ntok * kbs;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int r = static_cast<int>(i % 8), kb = static_cast<int>((i / 8) % kbs);
    const int64_t rest = i / (8 * kbs);
    const int tok = static_cast<int>(rest % (ntok / 8)) * 8 + r, c = static_cast<int>(rest / (ntok / 8));
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

struct Params {
  const unsigned char* xp;  // prepped x
  const unsigned char* w;   // the blob
  int M, N, groups;
  int blob_chunks;          // the blob's chunks of 512 K
  int chunks;               // ring stages of KS K over the whole K
  int chunks_per_cta, stages;
  void* out;
  int64_t out_stride;
};

// Shared memory: 128-byte barrier header, then stages x [WG tile groups' KS-K blocks (4 tiles: KS/64 packets, then
// their scale records) | x: NTOK tokens x KS K]. KS = 512 stages a whole chunk of the blob (one copy per tile
// group); KS = 256 half of one (two copies per tile), which leaves room for 4 warpgroups at 64 tokens or 128
// tokens at 2.
template <int NTOK, int GS, bool ASYM, int WG, int KS>
struct Layout {
  static_assert(KS == 512 || KS == 256, "a stage is a chunk of the blob or half of one");
  static constexpr int kPerChunk = kBlobChunkK / KS;  // stages per chunk of the blob
  static constexpr int kBlobRecBytes = Int4Policy<__nv_bfloat16, 1, GS, ASYM>::kSBytes;
  static constexpr int kBlobTileBytes = lowbit::kChunk * 512 + kBlobRecBytes;
  static constexpr int kPacketBytes = KS / kPacketK * 512;  // a tile's packets in a stage
  static constexpr int kRecBytes = GS == 0 ? kBlobRecBytes : kBlobRecBytes / kPerChunk;  // and their records
  static constexpr int kTileBytes = kPacketBytes + kRecBytes;
  static constexpr int kGroupBytes = lowbit::kGroupTiles * kTileBytes;
  static constexpr int kXBytes = NTOK * KS * 2;
  static constexpr int kStageBytes = WG * kGroupBytes + kXBytes;
  static constexpr int kRedBytes = NTOK / 2 * WG * 128 * 4;  // the K splits' partial sums, in the ring's memory
  static constexpr int kMaxStages = 4 * kPerChunk;
  static constexpr int bytes(int stages) { return 128 + stages * kStageBytes; }
};

// A CTA is WG consumer warpgroups and one producer warpgroup (one lane of it issues the copies). The producer gives
// its registers to the consumers (setmaxnreg): 4 warpgroups at 64 tokens need ~100 registers a thread, and the launch
// bound of 640 threads caps every thread at 96. The CTA's registers are a fixed pool (threads x the launch count):
// setmaxnreg.inc waits for registers the CTA's own decs returned, so asking for more than the pool holds hangs.
template <int WG>
struct Regs {
  static constexpr int kThreads = (WG + 1) * 128;
  static constexpr int kLaunch = 65536 / kThreads / 8 * 8;  // ptxas's count under __launch_bounds__(kThreads, 1)
  static constexpr int kProducer = 24;
  static constexpr int kConsumer = std::min(240, (kThreads * kLaunch - 128 * kProducer) / (WG * 128) / 8 * 8);
  static_assert(128 * kProducer + WG * 128 * kConsumer <= kThreads * kLaunch, "setmaxnreg beyond the CTA's pool");
};

template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N)); }

template <typename T, int NTOK, int GS, bool ASYM, int WG, int KS>
__global__ void __launch_bounds__(Regs<WG>::kThreads, 1) wide_gemm_kernel(const __grid_constant__ Params prm) {
  static_assert(GS == 128 || GS == 0, "the wide kernel takes group size 128 or per-channel scales");
  using Lay = Layout<NTOK, GS, ASYM, WG, KS>;
  using Rec = typename Int4Policy<T, 1, GS, ASYM>::Rec;
  constexpr int ND = NTOK / 2;  // accumulators per thread
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int split = blockIdx.y, nsplit = gridDim.y;
  const int cb = split * prm.chunks_per_cta;
  const int nchunks = max(min(cb + prm.chunks_per_cta, prm.chunks) - cb, 0);
  const int group0 = blockIdx.x * WG, ngroups = min(WG, prm.groups - group0);
  const int nst = prm.stages;
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
    setmaxnreg_dec<Regs<WG>::kProducer>();
    if (warp == WG * 4 && lane == 0) {
      const uint64_t wpol = lowbit::CUBLADE_WEIGHT_POLICY(), xpol = lowbit::policy_evict_last();
      auto weights = [&](int c, int s) {  // stage c's blocks of the CTA's tile groups
        const int bc = (cb + c) / Lay::kPerChunk, half = (cb + c) % Lay::kPerChunk;
        for (int q = 0; q < ngroups; ++q) {
          unsigned char* dst = stage(s) + q * Lay::kGroupBytes;
          const unsigned char* src =
              prm.w + (static_cast<int64_t>(group0 + q) * prm.blob_chunks + bc) * lowbit::kGroupTiles *
                          Lay::kBlobTileBytes;
          if constexpr (Lay::kPerChunk == 1) {
            lowbit::bulk_g2s(dst, src, Lay::kGroupBytes, full + s, wpol);
          } else {
            for (int tile = 0; tile < lowbit::kGroupTiles; ++tile, dst += Lay::kTileBytes, src += Lay::kBlobTileBytes) {
              lowbit::bulk_g2s(dst, src + half * Lay::kPacketBytes, Lay::kPacketBytes, full + s, wpol);
              lowbit::bulk_g2s(dst + Lay::kPacketBytes,
                               src + lowbit::kChunk * 512 + (GS == 0 ? 0 : half * Lay::kRecBytes), Lay::kRecBytes,
                               full + s, wpol);
            }
          }
        }
      };
      auto activations = [&](int c, int s) {
        lowbit::bulk_g2s(stage(s) + WG * Lay::kGroupBytes, prm.xp + static_cast<int64_t>(cb + c) * Lay::kXBytes,
                         Lay::kXBytes, full + s, xpol);
      };
      const uint32_t stage_tx = ngroups * Lay::kGroupBytes + Lay::kXBytes;
      // The first stages' weights go out before xp is ready (the x prep, launched just before, may still run).
      const int first = min(nst, nchunks);
      for (int c = 0; c < first; ++c) {
        lowbit::mbar_expect_tx(full + c, stage_tx);
        weights(c, c);
      }
      lowbit::pdl_wait();
      for (int c = 0; c < first; ++c) activations(c, c);
      for (int c = first; c < nchunks; ++c) {
        const int s = c % nst;
        lowbit::mbar_wait(empty + s, ((c / nst) - 1) & 1);
        lowbit::mbar_expect_tx(full + s, stage_tx);
        weights(c, s);
        activations(c, s);
      }
    }
    if (nsplit > 1) {  // the consumers' barriers below
      __syncthreads();
      lowbit::cluster_sync();
      lowbit::cluster_sync();
    }
    return;
  }

  // ---- consumer warpgroup wg: tile group group0 + wg, warp wq its tile wq ----
  setmaxnreg_inc<Regs<WG>::kConsumer>();
  float acc[ND];
#pragma unroll
  for (int i = 0; i < ND; ++i) acc[i] = 0.0f;
  float s_lo = 1.0f, s_hi = 1.0f;  // per-channel scales (GS = 0), rows g and g+8
  if (wg < ngroups) {
    float part[ND];
    for (int c = 0; c < nchunks; ++c) {
      const int s = c % nst;
      lowbit::mbar_wait(full + s, (c / nst) & 1);
      const unsigned char* tb = stage(s) + wg * Lay::kGroupBytes + wq * Lay::kTileBytes;
      const Rec* recs = reinterpret_cast<const Rec*>(tb + Lay::kPacketBytes) + g;
      const uint32_t xs = lowbit::smem_u32(stage(s) + WG * Lay::kGroupBytes);
#pragma unroll
      for (int b = 0; b < KS / 128; ++b) {
        uint32_t b_lo = bias_pair<T>(8.0f), b_hi = b_lo;  // symmetric: z = 8
        float gs_lo, gs_hi;
        unpack_rec<T, ASYM>(recs[GS == 0 ? 0 : b * 8], gs_lo, gs_hi, b_lo, b_hi);
        if (GS == 0 && c == 0 && b == 0) { s_lo = gs_lo; s_hi = gs_hi; }  // the same record in every stage
        uint32_t a[8][4];  // the batch's 8 k-steps
#pragma unroll
        for (int pk = 0; pk < 2; ++pk) {
          const uint4 q = lowbit::lds128(tb + (2 * b + pk) * 512 + lane * 16);
          dequant_int4<T>(q.x, b_lo, b_hi, a[4 * pk + 0]);
          dequant_int4<T>(q.y, b_lo, b_hi, a[4 * pk + 1]);
          dequant_int4<T>(q.z, b_lo, b_hi, a[4 * pk + 2]);
          dequant_int4<T>(q.w, b_lo, b_hi, a[4 * pk + 3]);
        }
        wgmma::fence();
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          // k-step 8b + k: its two core matrices of every 8 tokens (128 B apart), token groups KS * 16 B apart
          const uint64_t desc = wgmma::desc(xs + (8 * b + k) * 256, 128, KS * 16);
          if constexpr (GS == 0) wgmma::MmaRS<T, NTOK>::run(acc, a[k], desc, 1);
          else wgmma::MmaRS<T, NTOK>::run(part, a[k], desc, k);  // k = 0: part = A * B
        }
        // The next batch rewrites a (these mma's read it as they run); the stage's last batch frees the stage.
        wgmma::commit();
        wgmma::wait<0>();
        if constexpr (GS != 0) {
          wgmma::fence_regs(part);
#pragma unroll
          for (int i = 0; i < ND; ++i) acc[i] = fmaf(part[i], (i & 2) ? gs_hi : gs_lo, acc[i]);
        } else {
          wgmma::fence_regs(acc);
        }
      }
      __syncwarp();
      if (lane == 0) lowbit::mbar_arrive(empty + s);
    }
  }

  // ---- the splits of the cluster (the producer warpgroup meets these barriers on its own path), then the outputs ----
  const bool consumer = wg < ngroups;
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
  if (split == 0 && consumer) {
    T* out = static_cast<T*>(prm.out);
    const int row0 = (group0 + wg) * 64 + wq * kTileN + g;
#pragma unroll
    for (int i = 0; i < ND; ++i) {
      const int row = row0 + 8 * ((i >> 1) & 1), tok = 8 * (i >> 2) + 2 * t + (i & 1);
      if (row < prm.N && tok < prm.M)
        out[static_cast<int64_t>(tok) * prm.out_stride + row] = lowbit::from_float<T>(acc[i] * ((i & 2) ? s_hi : s_lo));
    }
  }
}

// K splits: the CTAs (WG tile groups each) fill at most one wave at one CTA per SM, so split K while that leaves
// every SM at most one CTA and each split at least 8 chunks of the blob. Measured (w4a16_wide.cu, M = 32):
// 28672x8192 (64 CTAs) 104.3 us on 1 split, 60.2 on 2; 8192x10240 (80 CTAs) 37.7 on 1, 41.7 on 2; 4096x14336 (112)
// 24.1 on 1, 29.7 on 2.
inline int pick_split(int64_t ctas, int blob_chunks, int sms) {
  int S = 1;
  while (S < lowbit::kMaxSplit && 2 * ctas * S <= sms && blob_chunks >= 16 * S) S *= 2;
  return S;
}

// One pass of at most NTOK rows: the x prep, then the kernel (S splits, 0: pick_split; stages = 0: as deep as
// fits). pdl: the kernel is a programmatic dependent launch of the prep (it fetches its first weight stages while
// the prep runs).
template <typename T, int NTOK, int GS, bool ASYM, int WG, int KS>
cudaError_t launch(const void* x, int64_t x_stride, int M, int K, const unsigned char* w, void* out,
                   int64_t out_stride, int N, int S, int stages, bool pdl, void* workspace, int sms,
                   cudaStream_t stream) {
  using Lay = Layout<NTOK, GS, ASYM, WG, KS>;
  Params prm = {};
  prm.xp = static_cast<const unsigned char*>(workspace);
  prm.w = w;
  prm.M = M; prm.N = N;
  prm.groups = static_cast<int>(ceil_div(N, 64));
  prm.blob_chunks = static_cast<int>(ceil_div(K, kBlobChunkK));
  prm.chunks = static_cast<int>(ceil_div(K, KS));
  if (S <= 0) S = pick_split(ceil_div(prm.groups, WG), prm.blob_chunks, sms);
  if (S > lowbit::kMaxSplit || M > NTOK) return cudaErrorInvalidValue;
  prm.chunks_per_cta = (prm.chunks + S - 1) / S;
  prm.stages = stages;
  if (prm.stages <= 0) {
    prm.stages = Lay::kMaxStages;
    while (prm.stages > 2 && Lay::bytes(prm.stages) > lowbit::kMaxSmemKB * 1024) --prm.stages;
  }
  prm.out = out; prm.out_stride = out_stride;
  const int smem = Lay::bytes(prm.stages);
  if (prm.stages > lowbit::kMaxStages || smem > lowbit::kMaxSmemKB * 1024 ||
      (S > 1 && Lay::kRedBytes > prm.stages * Lay::kStageBytes))
    return cudaErrorInvalidValue;

  constexpr auto kernel = wide_gemm_kernel<T, NTOK, GS, ASYM, WG, KS>;
  if (const cudaError_t e = lowbit::allow_max_smem<kernel>(); e != cudaSuccess) return e;

  const int64_t units = static_cast<int64_t>(prm.chunks) * NTOK * (KS / 8);
  const int prep_blocks = static_cast<int>(std::min<int64_t>(ceil_div(units, 256), 8LL * sms));
  prep_x<T><<<prep_blocks, 256, 0, stream>>>(static_cast<const T*>(x), x_stride, M, K, NTOK, KS, prm.chunks,
                                             static_cast<uint4*>(workspace));
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  return lowbit::launch_split_k(kernel, dim3(static_cast<unsigned>(ceil_div(prm.groups, WG)), S, 1),
                                Regs<WG>::kThreads, smem, S, stream, prm, pdl);
}

// Four warpgroups per CTA (256 rows sharing each staged x) when their grid still fills 3/4 of the SMs; else two.
// Measured (w4a16_wide.cu, 2026-11-22, us, best splits, prep included; sixth session, M = 17 / 24 / 32):
// 8192x28672 (112 CTAs of 4) 51.6 / 52.0 / 52.0 vs 59.3 / 59.4 / 59.9 with 2; 4096x14336 (56 CTAs of 4) 24.1 (2
// splits) vs 22.1; 28672x8192 (32) 82.9 vs 53.4. At 64 tokens (half-chunk stages, seventh session, M = 48 / 64, PDL):
// 8192x28672 76.7 / 77.9 vs 78.9 / 79.8; the three smaller shapes lose (4096x14336 M = 64: 30.4+ vs 26.5).
inline bool four_warpgroups(int N, int sms) { return 4 * ceil_div(ceil_div(N, 64), 4) >= 3LL * sms; }

// A kernel configuration: tokens per pass (wgmma N), consumer warpgroups per CTA, K per ring stage.
template <int NTOK, int WG, int KS>
struct PassConfig {
  static constexpr int kTokens = NTOK, kWarpgroups = WG, kStageK = KS;
};

// One pass of at most 128 rows (group size 128 or -1); the kernel is a programmatic dependent launch of its x prep.
// Tokens per pass: ntok(M); 96 and 128 at 2 warpgroups with half-chunk stages (3 stages of 66 KB / 2 of 82 KB).
// Measured (w4a16_wide.cu, 2026-11-22 seventh session, us with PDL): M = 128 on 8192x28672 / 4096x14336 /
// 28672x8192 / 8192x10240 125.8 / 38.4 / 114.9 / 65.3 in one pass of 128, against 162.8 / 55.1 / 146.8 / 86.9 in two
// of 64 (no PDL).
template <typename T>
cudaError_t launch_pass(int group_size, bool asym, const void* x, int64_t x_stride, int M, int K,
                        const unsigned char* w, void* out, int64_t out_stride, int N, void* workspace, int sms,
                        cudaStream_t stream) {
  auto go = [&](auto gs_c, auto asym_c) {
    constexpr int GS = decltype(gs_c)::value;
    constexpr bool A = decltype(asym_c)::value;
    auto run = [&](auto cfg) {
      using C = decltype(cfg);
      return launch<T, C::kTokens, GS, A, C::kWarpgroups, C::kStageK>(x, x_stride, M, K, w, out, out_stride, N, 0,
                                                                         0, true, workspace, sms, stream);
    };
    const bool four = four_warpgroups(N, sms);
    switch (ntok(M)) {
      case 128: return run(PassConfig<128, 2, 256>{});
      case 96: return run(PassConfig<96, 2, 256>{});
      case 64: return four ? run(PassConfig<64, 4, 256>{}) : run(PassConfig<64, 2, 512>{});
      case 48: return four ? run(PassConfig<48, 4, 256>{}) : run(PassConfig<48, 2, 512>{});
      case 32: return four ? run(PassConfig<32, 4, 512>{}) : run(PassConfig<32, 2, 512>{});
      default: return four ? run(PassConfig<16, 4, 512>{}) : run(PassConfig<16, 2, 512>{});
    }
  };
  using G128 = std::integral_constant<int, 128>;
  using GChannel = std::integral_constant<int, 0>;
  if (group_size == 128) return asym ? go(G128{}, std::true_type{}) : go(G128{}, std::false_type{});
  return asym ? go(GChannel{}, std::true_type{}) : go(GChannel{}, std::false_type{});
}

}  // namespace wide

template <int GS, bool ASYM>
constexpr int int4_sbytes() { return Int4Policy<__nv_bfloat16, 1, GS, ASYM>::kSBytes; }

// Tokens per pass from M: 8 / 16 / 32 (lowbit::token_tiles); larger M makes several passes, each re-reading the
// weights (from L2 when they are still there). From 128 rows the torch op dequantizes and calls cuBLAS instead
// (w4a16_gemm_torch.cpp).
template <typename T, int GS, bool ASYM>
cudaError_t launch_nt(lowbit::GemmParams prm, int S, cudaStream_t stream) {
  const int nt = lowbit::token_tiles(prm.M);
  prm.xrows = std::min(8 * nt, prm.M);
  prm.sbytes = int4_sbytes<GS, ASYM>();
  if (nt == 1) return lowbit::launch_tpw<Int4Policy<T, 1, GS, ASYM>>(prm, 1, S, stream);
  if (nt == 2) return lowbit::launch_tpw<Int4Policy<T, 2, GS, ASYM>>(prm, 1, S, stream);
  return lowbit::launch_tpw<Int4Policy<T, 4, GS, ASYM>>(prm, 1, S, stream);
}

template <typename T>
cudaError_t launch_dtype(const lowbit::GemmParams& prm, int group_size, bool asym, int S, cudaStream_t stream) {
  switch (group_size) {
    case 32: return asym ? launch_nt<T, 32, true>(prm, S, stream) : launch_nt<T, 32, false>(prm, S, stream);
    case 64: return asym ? launch_nt<T, 64, true>(prm, S, stream) : launch_nt<T, 64, false>(prm, S, stream);
    case 128: return asym ? launch_nt<T, 128, true>(prm, S, stream) : launch_nt<T, 128, false>(prm, S, stream);
    case -1: return asym ? launch_nt<T, 0, true>(prm, S, stream) : launch_nt<T, 0, false>(prm, S, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

// Scale-record bytes per tile block (the repacked layout's last dim is 1024 + this / 4 int32 words).
int w4a16_gemm_sbytes(int group_size, bool asym) {
  switch (group_size) {
    case 32: return asym ? int4_sbytes<32, true>() : int4_sbytes<32, false>();
    case 64: return asym ? int4_sbytes<64, true>() : int4_sbytes<64, false>();
    case 128: return asym ? int4_sbytes<128, true>() : int4_sbytes<128, false>();
    case -1: return asym ? int4_sbytes<0, true>() : int4_sbytes<0, false>();
    default: return -1;
  }
}

// Workspace bytes launch_w4a16_gemm needs (0: none): the wide kernel's prepped x, one pass of up to 128 rows.
size_t w4a16_gemm_workspace_bytes(int64_t M, int64_t K, int64_t N, int group_size, int split_k) {
  if (split_k != 0 || wide::pass_rows(M, N, K) == 0 || !w4a16_gemm_wide_takes(group_size)) return 0;
  return static_cast<size_t>(ceil_div(K, wide::kBlobChunkK)) * wide::kBlobChunkK * 2 *
         wide::ntok(std::min<int64_t>(M, wide::kMaxPassRows));
}

// x: [M, K] (row stride x_stride elements, unit column stride, 16-byte aligned rows, K % 8 == 0); packed: the
// repacked blob above; out: [M, N] with row stride out_stride. split_k: K splits per cluster (0 = pick; >= 1
// forces the streaming kernel). workspace: w4a16_gemm_workspace_bytes(...) bytes, 16-byte aligned, or null when
// that is 0. sms: the multiprocessor count.
cudaError_t launch_w4a16_gemm(const void* x, InDtype dtype, int64_t M, int64_t K, int64_t x_stride,
                              const void* packed, int group_size, bool asym, void* out, int64_t out_stride,
                              int64_t N, int split_k, void* workspace, int sms, cudaStream_t stream) {
  if (M == 0 || N == 0) return cudaSuccess;
  if (dtype != InDtype::kBF16 && dtype != InDtype::kF16) return cudaErrorInvalidValue;
  const int esize = 2;
  if (w4a16_gemm_workspace_bytes(M, K, N, group_size, split_k) > 0) {
    // The wide kernel, up to 128 rows per pass; a last pass of at most 16 rows goes to the streaming kernel unless
    // wide::pass_rows gives it to the wide kernel too.
    if (workspace == nullptr) return cudaErrorInvalidValue;
    int64_t m0 = 0;  // rows done
    while (const int64_t pass = wide::pass_rows(M - m0, N, K)) {
      const int rows = static_cast<int>(pass);
      const auto* xr = static_cast<const unsigned char*>(x) + m0 * x_stride * esize;
      auto* outr = static_cast<unsigned char*>(out) + m0 * out_stride * esize;
      const auto* w = static_cast<const unsigned char*>(packed);
      const int k = static_cast<int>(K), n = static_cast<int>(N);
      const cudaError_t e =
          dtype == InDtype::kBF16
              ? wide::launch_pass<__nv_bfloat16>(group_size, asym, xr, x_stride, rows, k, w, outr, out_stride, n,
                                                 workspace, sms, stream)
              : wide::launch_pass<__half>(group_size, asym, xr, x_stride, rows, k, w, outr, out_stride, n, workspace,
                                          sms, stream);
      if (e != cudaSuccess) return e;
      m0 += rows;
    }
    if (m0 == M) return cudaSuccess;
    x = static_cast<const unsigned char*>(x) + m0 * x_stride * esize;
    out = static_cast<unsigned char*>(out) + m0 * out_stride * esize;
    M -= m0;
  }
  lowbit::GemmParams prm = {};
  prm.x = x; prm.x_stride = x_stride; prm.M = static_cast<int>(M); prm.K = static_cast<int>(K);
  prm.w = static_cast<const unsigned char*>(packed);
  prm.tiles = static_cast<int>(ceil_div(N, kTileN));
  prm.groups = static_cast<int>(ceil_div(N, kTileN * lowbit::kGroupTiles));
  prm.chunks = static_cast<int>(ceil_div(K, lowbit::kChunk * kPacketK));
  prm.out = out; prm.out_stride = out_stride; prm.N = static_cast<int>(N);
  prm.sms = sms;
  const int S = split_k > 0 ? split_k : lowbit::pick_split(prm.groups, prm.chunks, sms);
  return dtype == InDtype::kBF16 ? launch_dtype<__nv_bfloat16>(prm, group_size, asym, S, stream)
                                 : launch_dtype<__half>(prm, group_size, asym, S, stream);
}

}  // namespace cublade
