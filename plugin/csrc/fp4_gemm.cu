// FP4 (E2M1) weight GEMM for MoE experts on Hopper: FP4 storage, bf16 math.
//   y[M, N] = x[M, K] (bf16) @ dequant(W)[N, K]^T, per expert e over its rows of x (tokens sorted by expert,
//   expert_offsets [E+1]); dense = one expert. MXFP4: one E8M0 scale per 32 K; NVFP4: one E4M3 scale per
//   16 K and one fp32 factor per output row (the global scale, expanded at repack: w13 has two).
// Numerics: e2m1 * block scale is exact in bf16 (2 significant bits times a power of two, or times an e4m3
// with 4), so the kernel feeds the reference's weights (times a power of two the row factor undoes) to the
// tensor cores, sums in fp32 over all of K, multiplies by the row factor and rounds once to bf16.
// Dequant: a code's (e, m) bits are placed as the low exponent bits and first mantissa bit of a bf16, whose
// value is then code * 2^-126 (e = 0: a bf16 subnormal, which bf16 arithmetic keeps); one HMUL2 by the block
// scale times 2^126 gives the weight. Two shifts and a LOP3 per two codes (the PRMT table lookups this
// replaced took ~1.45x the time: benchmarks/tuning/fp4_moe_sweep.cu).
// Layout and the reasons: docs/kernels.md, "fp4_gemm"; the repacked tensors: w4a16_gemm.cuh (geometry) and
// plugin/ops/fp4_gemm.py (fp4_repack).
//   packed  int32 [E, ceil(N/64), ceil(K/512), 4 tiles, 1024 + 128]: per tile block, 8 packets x 32 lanes x 4
//           words, then 8 x 64 bytes of scale records. Word s of lane (g, t) holds the A fragment of one k-step:
//           register i (0..3) = rows g, g+8, g, g+8 at K0 + {0, 1} (i < 2) or K0 + {2, 3}; the code of its low
//           (h = 0) / high (h = 1) bf16 has its magnitude (3 bits) at bits 16h + 3i and its sign at 16h + 12 + i.
//   records per packet and g (8 bytes): MXFP4 bf16 [2 halves][2 rows], 2^(e-127) * 2^(126-k), a power of two;
//           NVFP4 e4m3 [2 blocks (t / 2)][2 halves][2 rows] (the kernel multiplies by 2^117 = 2^(126-9)).
//   row_scale fp32 [E, ceil(N/64) * 64]: NVFP4 the global scale of each row * 2^9; MXFP4 2^k per expert (k > 0
//           only for experts with a block scale above 2), or absent.
#define CUBLADE_KERNELS_ONLY  // framework-free (no torch header); the torch wrapper is fp4_gemm_torch.cpp
#include "gemm_plan.cuh"  // the FP4 experts' plan: wide_tokens, rows_spread
#include "w4a16_gemm.cuh"
#include "wide_gemm.cuh"
#include "w4a16_gemm.h"

#include <algorithm>
#include <cmath>

namespace cublade {
namespace {

using lowbit::kPacketK;
using lowbit::kTileN;

enum Fp4Format : int { kMXFP4 = 0, kNVFP4 = 1 };

// One word (8 codes) -> the k-step's A fragment, times the block scales (bf16 pairs for rows g and g+8, each the
// scale times 2^126). Register i: its two magnitudes shift from bits 3i / 16+3i to 6-8 / 22-24 (exponent bits 0-1
// and mantissa bit 6 of each bf16) and its two signs from 12+i / 28+i to 15 / 31.
__device__ __forceinline__ void dequant_fp4(uint32_t q, uint32_t s_lo, uint32_t s_hi, uint32_t (&a)[4]) {
  const uint32_t s[4] = {s_lo, s_hi, s_lo, s_hi};
  lowbit::static_for<4>([&](auto i_c) {
    constexpr int i = decltype(i_c)::value, up = 6 - 3 * i;
    const uint32_t mag = up >= 0 ? q << up : q >> -up;
    const uint32_t m = lowbit::and_or(mag, 0x01C001C0u, (q << (3 - i)) & 0x80008000u);
    const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&m),
                                     *reinterpret_cast<const __nv_bfloat162*>(&s[i]));
    a[i] = *reinterpret_cast<const uint32_t*>(&r);
  });
}

// Per-packet scale record of one lane and the bf16 pairs (s, s) of rows g and g+8 for half h.
template <int FMT> struct Fp4Rec;
template <> struct Fp4Rec<kMXFP4> {
  using type = uint2;  // .x = (half 0: s[g], s[g+8]) bf16, .y = half 1
  __device__ __forceinline__ static type load(const unsigned char* srec, int i, int lane) {
    return *reinterpret_cast<const uint2*>(srec + (i * 8 + (lane >> 2)) * 8);
  }
  __device__ __forceinline__ static void pairs(const uint2& r, int h, uint32_t& lo, uint32_t& hi) {
    const uint32_t v = h == 0 ? r.x : r.y;
    lo = lowbit::prmt(v, v, 0x1010u);
    hi = lowbit::prmt(v, v, 0x3232u);
  }
};
template <> struct Fp4Rec<kNVFP4> {
  using type = uint32_t;  // bytes: (half 0: s[g], s[g+8], half 1: s[g], s[g+8]) e4m3 of this lane's block
  __device__ __forceinline__ static type load(const unsigned char* srec, int i, int lane) {
    return *reinterpret_cast<const uint32_t*>(srec + (i * 8 + (lane >> 2)) * 8 + ((lane & 3) >> 1) * 4);
  }
  // s * 2^117: the codes' 2^126 less the 2^9 the row factor carries (448 * 2^126 would overflow bf16).
  __device__ __forceinline__ static void pairs(uint32_t r, int h, uint32_t& lo, uint32_t& hi) {
    float2 f = e4m3x2_to_f32x2(static_cast<uint16_t>(h == 0 ? r & 0xFFFFu : r >> 16));  // exact
    f.x *= 0x1p117f;
    f.y *= 0x1p117f;
    const __nv_bfloat162 l = __floats2bfloat162_rn(f.x, f.x), u = __floats2bfloat162_rn(f.y, f.y);  // exact
    lo = *reinterpret_cast<const uint32_t*>(&l);
    hi = *reinterpret_cast<const uint32_t*>(&u);
  }
};

// Packet j's 4 k-steps (its lane vector q) -> A fragments, block scales applied (srec: the tile's records of the
// packets' K slice or stage).
template <int FMT>
__device__ __forceinline__ void dequant_packet(const uint4 q, const unsigned char* srec, int j, int lane,
                                               uint32_t (&a)[4][4]) {
  const typename Fp4Rec<FMT>::type r = Fp4Rec<FMT>::load(srec, j, lane);
  uint32_t s0_lo, s0_hi, s1_lo, s1_hi;
  Fp4Rec<FMT>::pairs(r, 0, s0_lo, s0_hi);
  Fp4Rec<FMT>::pairs(r, 1, s1_lo, s1_hi);
  dequant_fp4(q.x, s0_lo, s0_hi, a[0]);
  dequant_fp4(q.y, s0_lo, s0_hi, a[1]);
  dequant_fp4(q.z, s1_lo, s1_hi, a[2]);
  dequant_fp4(q.w, s1_lo, s1_hi, a[3]);
}

// FP4 packets for the streaming kernel (w4a16_gemm.cuh): the block scale is applied to the weights in bf16
// (exact), the mma's sum all of K in fp32, the row factor (NVFP4 global scale) multiplies at the end.
template <int NT_, int FMT>
struct Fp4Policy {
  using T = __nv_bfloat16;
  static constexpr int NT = NT_;
  static constexpr int kPacketBytes = 512;
  static constexpr int kSBytes = kFp4RecordBytes;  // 64 bytes of records per packet per tile
  struct State {};
  template <int kSliceK>
  __device__ static const unsigned char* slice_records(const unsigned char* srec, int slice) {
    return srec + slice * (kSliceK / kPacketK) * 64;  // 64 bytes of records per packet
  }
  __device__ static const float* row_scale(const lowbit::GemmParams& p, int e) {
    return p.row_scale ? p.row_scale + static_cast<int64_t>(e) * p.groups * lowbit::kGroupTiles * kTileN : nullptr;
  }
  template <int j, int kSliceK>
  __device__ static void packet(State&, const uint4 (&q)[1], const unsigned char* srec, const uint4 (&xc)[2][NT],
                                float (&acc)[NT][4], int lane) {
    uint32_t a[4][4];
    dequant_packet<FMT>(q[0], srec, j, lane, a);
    lowbit::mma_packet<T>(acc, a, xc);
  }
};

// FP4 batches for the wide kernel (wide_gemm.cuh, prefill sizes): the same dequant; the A fragments are the exact
// weights times 2^126 (NVFP4: 2^117), so the mma's sum all of K into acc and the row factor multiplies at the store.
template <int FMT>
struct Fp4Batch {
  using T = __nv_bfloat16;
  static constexpr int kPacketBytes = 512;
  static constexpr int kBlobRecBytes = kFp4RecordBytes;
  static constexpr wide::Scaling kScaling = wide::Scaling::kNone;
  static constexpr bool kRowScale = true;
  __device__ static void batch(const unsigned char* packets, const unsigned char* recs, int b, int lane,
                               uint32_t (&a)[8][4], float&, float&) {
#pragma unroll
    for (int pk = 0; pk < 2; ++pk) {
      const int j = 2 * b + pk;  // packet of the stage
      dequant_packet<FMT>(lowbit::lds128(packets + j * 512 + lane * 16), recs, j, lane,
                          *reinterpret_cast<uint32_t(*)[4][4]>(a[4 * pk]));
    }
  }
};

// The FP4 configurations (the sweep of wide_tokens, gemm_plan.cuh): four warpgroups only at 32 tokens a pass (and
// only when their CTAs fill 3/4 of the SMs); from 48 tokens two, with whole-chunk stages at 48 / 64 (w13 at a mean of
// 32 rows: 275.9 us at 48 tokens on 2 warpgroups, 327.0 on 4).
template <int FMT>
cudaError_t launch_wide(lowbit::GemmParams sp, int E, int ntok, int64_t active, void* workspace,
                        cudaStream_t stream) {
  wide::Params prm = {};
  prm.w = sp.w;
  prm.offsets = sp.offsets;
  prm.experts = E;
  prm.row_scale = sp.row_scale;
  prm.M = sp.M; prm.N = sp.N;
  prm.out = sp.out; prm.out_stride = sp.out_stride;
  auto run = [&](auto cfg) {
    using C = decltype(cfg);
    return wide::launch_kernel<Fp4Batch<FMT>, C::kTokens, C::kWarpgroups, C::kStageK, true>(
        prm, sp.x, sp.x_stride, sp.K, 0, 0, true, workspace, sp.sms, stream);
  };
  switch (ntok) {
    case 32:
      return wide::four_warpgroups(ceil_div(sp.groups, 4) * active, sp.sms) ? run(wide::PassConfig<32, 4, 512>{})
                                                                             : run(wide::PassConfig<32, 2, 512>{});
    case 48: return run(wide::PassConfig<48, 2, 512>{});
    case 64: return run(wide::PassConfig<64, 2, 512>{});
    case 96: return run(wide::PassConfig<96, 2, 256>{});
    case 128: return run(wide::PassConfig<128, 2, 256>{});
    default: return cudaErrorInvalidValue;
  }
}

template <int FMT>
cudaError_t launch_fmt(lowbit::GemmParams prm, int E, int max_m, int S, cudaStream_t stream) {
  const int nt = lowbit::token_tiles(max_m);
  prm.xrows = std::min(8 * nt, max_m);
  prm.sbytes = Fp4Policy<1, FMT>::kSBytes;
  if (nt == 1) return lowbit::launch_tpw<Fp4Policy<1, FMT>>(prm, E, S, stream);
  if (nt == 2) return lowbit::launch_tpw<Fp4Policy<2, FMT>>(prm, E, S, stream);
  return lowbit::launch_tpw<Fp4Policy<4, FMT>>(prm, E, S, stream);
}

}  // namespace

size_t fp4_gemm_workspace_bytes(int64_t M, int64_t K, int64_t E, bool grouped, int split_k, int64_t routed_experts) {
  const int nt = M > 0 ? wide_tokens(M, rows_spread(grouped, E, routed_experts, M), grouped, split_k) : 0;
  return nt > 0 ? static_cast<size_t>(wide::workspace_bytes(M, K, nt, true, 0)) : 0;
}

// x: bf16 [M, K] (row stride x_stride, unit column stride, 16-byte aligned rows, K % 32 == 0); offsets: int32
// [E+1] on the device (null: one expert over all M rows); packed: the blob above; row_scale: [E, groups*64] or
// null; out: bf16 [M, N] (row stride out_stride). max_m: an upper bound on any expert's row count (picks the
// streaming kernel's tokens per pass; a wrong bound costs speed, not correctness). fmt: 0 = MXFP4, 1 = NVFP4.
// From kWideMinRows rows per expert (split_k = 0) the wide kernel runs, with fp4_gemm_workspace_bytes of workspace.
cudaError_t launch_fp4_gemm(const Fp4GemmArgs& a, cudaStream_t stream) {
  const int64_t M = a.M, K = a.K, N = a.N, E = a.E;
  const int* offsets = a.offsets;
  const int fmt = a.fmt, split_k = a.split_k, sms = a.sms;
  void* workspace = a.workspace;
  if (M == 0 || N == 0 || E == 0) return cudaSuccess;
  if (fmt != kMXFP4 && fmt != kNVFP4) return cudaErrorInvalidValue;
  lowbit::GemmParams prm = {};
  prm.x = a.x; prm.x_stride = a.x_stride; prm.M = static_cast<int>(M); prm.K = static_cast<int>(K);
  prm.offsets = offsets;
  prm.w = static_cast<const unsigned char*>(a.packed);
  prm.tiles = static_cast<int>(ceil_div(N, kTileN));
  prm.groups = static_cast<int>(ceil_div(N, kTileN * lowbit::kGroupTiles));
  prm.chunks = static_cast<int>(ceil_div(K, lowbit::kChunk * kPacketK));
  prm.row_scale = a.row_scale;
  prm.out = a.out; prm.out_stride = a.out_stride; prm.N = static_cast<int>(N);
  prm.sms = sms;
  const int64_t active = lowbit::expert_slices(offsets != nullptr, E, M);  // experts that can have rows
  const int64_t spread = rows_spread(offsets != nullptr, E, a.routed_experts, M);
  if (const int nt = wide_tokens(M, spread, offsets != nullptr, split_k); nt > 0) {
    if (workspace == nullptr) return cudaErrorInvalidValue;
    const int e = static_cast<int>(E);
    return fmt == kMXFP4 ? launch_wide<kMXFP4>(prm, e, nt, active, workspace, stream)
                         : launch_wide<kNVFP4>(prm, e, nt, active, workspace, stream);
  }
  const int S = split_k > 0 ? split_k : lowbit::pick_split(prm.groups * active, prm.chunks, sms);
  const int mm = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(a.max_m, M)));
  if (fmt == kMXFP4) return launch_fmt<kMXFP4>(prm, static_cast<int>(E), mm, S, stream);
  return launch_fmt<kNVFP4>(prm, static_cast<int>(E), mm, S, stream);
}

}  // namespace cublade
