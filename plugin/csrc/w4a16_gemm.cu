// W4A16 GEMM for decode: y[M, N] = x[M, K] (bf16/fp16) @ dequant(W)[N, K]^T, W int4 with one bf16 scale
// (and, asymmetric, one zero point) per group of 32/64/128 K or per output channel. Numerics: the
// reference's w = (u - z) * s in fp32, summed in fp32 (cublade.ops.w4a16_gemm.w4a16_gemm_ref).
//
// Layout and the reasons: docs/kernels.md, "w4a16_gemm"; the repacked tensors: w4a16_gemm.cuh and
// plugin/ops/w4a16_gemm.py (w4a16_repack).
//   packed  int32 [ceil(N/64), ceil(K/512), 4 tiles, 1024 + sbytes/4]: per tile block, 8 packets x 32 lanes x 4
//           words, then the chunk's scale records. Nibble u of lane (g, t), k-step s, in word s at bits 4j:
//           j=0 (row g, K0), 4 (g, K0+1), 1 (g+8, K0), 5 (g+8, K0+1), 2 (g, K0+2), 6 (g, K0+3), 3 (g+8, K0+2),
//           7 (g+8, K0+3), so that one mask+OR per pair gives the fragment register order.
//           Scale records: [512/G groups][8 g] x (s[row g], s[row g+8]) bf16, asymmetric (s[g], s[g+8], z[g],
//           z[g+8]) (z exact in bf16); per channel: one group, repeated in every chunk.
#define CUBLADE_KERNELS_ONLY  // framework-free (no torch header); the torch wrapper is w4a16_gemm_torch.cpp
#include "w4a16_gemm.cuh"
#include "int4_codes.cuh"
#include "gemm_plan.cuh"
#include "w4a16_gemm.h"

static_assert(cublade::kLowbitGroupRows == cublade::lowbit::kGroupTiles * cublade::lowbit::kTileN &&
                  cublade::kLowbitChunkK == cublade::lowbit::kChunk * cublade::lowbit::kPacketK &&
                  cublade::kLowbitTileWords == cublade::lowbit::kChunk * 128 &&
                  cublade::kLowbitMaxSplit == cublade::lowbit::kMaxSplit,
              "w4a16_gemm.h and w4a16_gemm.cuh disagree on the blob geometry");

#include <algorithm>
#include <type_traits>

namespace cublade {
namespace {

using int4::Int4Policy;
using int4::bias_pair;
using int4::dequant_int4;
using int4::unpack_rec;
using lowbit::kPacketK;
using lowbit::kTileN;

}  // namespace

// ---- The wide kernel (from 17 tokens; 9 on large weights): wide_gemm.cuh with int4 batches ----------------------
// Group size 128: per batch of 2 packets (128 K, one scale group) the mma's accumulate from zero into `part` and the
// group's fp32 scales fold it into acc (Scaling::kFoldPerBatch), as the streaming kernel does, so the weights are
// never rounded; per-channel scales multiply the outputs once (kPerChannel).
//
// Measured on the H200 (benchmarks/tuning/w4a16_wide.cu, us after do_bench's flush, prep included, streaming kernel /
// wide): 8192x28672 M = 16 59.2 / 62.2, M = 24 80.4 / 66.5, M = 32 88.7 / 67.1, M = 64 168.2 / 84.2; 8192x10240 M = 16
// 27.1 / 34.3, M = 24 42.4 / 36.8. So it takes M > 16, and 9-16 rows in 16-token passes on large weights
// (kSmallPassMinWeights). Keeping batch i+1's mma's in flight while batch i is folded did not gain at 2 warpgroups
// (pairs of batches, M = 24-64: -0.8 to +2.5 us), and ptxas serializes the fully pipelined form at group size 128
// (C7514: it will not let acc be read while another batch's mma's run).
namespace wide {

// int4 batches for wide_gemm_kernel: GS 128 (a batch is one scale group) or 0 (per channel).
template <typename T_, int GS, bool ASYM>
struct Int4Batch {
  static_assert(GS == 128 || GS == 0, "the wide kernel takes group size 128 or per-channel scales");
  using T = T_;
  using Rec = typename Int4Policy<T, 1, GS, ASYM>::Rec;
  static constexpr int kPacketBytes = 512;
  static constexpr int kBlobRecBytes = Int4Policy<T, 1, GS, ASYM>::kSBytes;
  static constexpr Scaling kScaling = GS == 0 ? Scaling::kPerChannel : Scaling::kFoldPerBatch;
  static constexpr bool kRowScale = false;
  __device__ static void batch(const unsigned char* packets, const unsigned char* recs, int b, int lane,
                               uint32_t (&a)[8][4], float& s_lo, float& s_hi) {
    uint32_t b_lo = bias_pair<T>(8.0f), b_hi = b_lo;  // symmetric: z = 8
    unpack_rec<T, ASYM>(reinterpret_cast<const Rec*>(recs)[(GS == 0 ? 0 : b * 8) + (lane >> 2)], s_lo, s_hi, b_lo,
                        b_hi);
#pragma unroll
    for (int pk = 0; pk < 2; ++pk) {
      const uint4 q = lowbit::lds128(packets + (2 * b + pk) * 512 + lane * 16);
      dequant_int4<T>(q.x, b_lo, b_hi, a[4 * pk + 0]);
      dequant_int4<T>(q.y, b_lo, b_hi, a[4 * pk + 1]);
      dequant_int4<T>(q.z, b_lo, b_hi, a[4 * pk + 2]);
      dequant_int4<T>(q.w, b_lo, b_hi, a[4 * pk + 3]);
    }
  }
};

// int4 batches at group size 128 with the scales in the A fragments (Scaling::kNone): w = (u - z) * s rounded once
// to bf16, the weights the prefill path multiplies (w4a16_dequant: the product of a 4-bit integer and a bf16 scale is
// exact in fp32, so one HMUL2 rounds it as the fp32 dequant then the cast does), summed over all of K. It drops the
// fold's second set of accumulators (`part`, NTOK / 2 registers a thread), which is what lets a pass of 256 tokens
// run on 2 warpgroups (m64n256 mma's; the rounded passes, gemm_plan.cuh). bf16 only (a bf16 scale is not always
// exact in fp16). One packet (4 k-steps) per issue: 16 fragment registers live under the mma's instead of a batch's
// 32, which 256 tokens need.
template <bool ASYM>
struct Int4PrescaledBatch {
  using T = __nv_bfloat16;
  using Rec = typename Int4Policy<T, 1, 128, ASYM>::Rec;
  static constexpr int kPacketBytes = 512;
  static constexpr int kBlobRecBytes = Int4Policy<T, 1, 128, ASYM>::kSBytes;
  static constexpr Scaling kScaling = Scaling::kNone;
  static constexpr bool kRowScale = false;
  static constexpr int kSteps = 4;
  // k-steps 8b + 4h .. 8b + 4h + 3 (packet 2b + h) of the stage's packets of one tile
  __device__ static void steps(const unsigned char* packets, const unsigned char* recs, int b, int h, int lane,
                               uint32_t (&a)[4][4]) {
    const Rec r = reinterpret_cast<const Rec*>(recs)[b * 8 + (lane >> 2)];
    uint32_t s2, b_lo = bias_pair<T>(8.0f), b_hi = b_lo;  // symmetric: z = 8
    if constexpr (ASYM) {
      s2 = r.x;
      b_lo = bias_pair<T>(bf16_lo(r.y));
      b_hi = bias_pair<T>(bf16_hi(r.y));
    } else {
      s2 = r;
    }
    // (s[row g], s[row g]) and (s[row g + 8], s[row g + 8]): the record's halves, each repeated
    const uint32_t s_lo = __byte_perm(s2, 0u, 0x1010), s_hi = __byte_perm(s2, 0u, 0x3232);
    const uint4 q = lowbit::lds128(packets + (2 * b + h) * 512 + lane * 16);
    dequant_int4<T>(q.x, b_lo, b_hi, a[0]);
    dequant_int4<T>(q.y, b_lo, b_hi, a[1]);
    dequant_int4<T>(q.z, b_lo, b_hi, a[2]);
    dequant_int4<T>(q.w, b_lo, b_hi, a[3]);
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // a[k][0], a[k][2]: row g; a[k][1], a[k][3]: row g + 8
      a[k][0] = lowbit::hmul2_bf16(a[k][0], s_lo);
      a[k][1] = lowbit::hmul2_bf16(a[k][1], s_hi);
      a[k][2] = lowbit::hmul2_bf16(a[k][2], s_lo);
      a[k][3] = lowbit::hmul2_bf16(a[k][3], s_hi);
    }
  }
};

// run(PassConfig<...>{}) for a pass's plan (gemm_plan.cuh: plan_pass; tokens, warpgroups and stage K).
template <typename Run>
cudaError_t with_config(const PassPlan& p, Run&& run) {
  const bool four = p.warpgroups == 4;
  switch (p.tokens) {
    case 256: return run(PassConfig<256, 2, stage_k(256)>{});
    case 192: return run(PassConfig<192, 2, stage_k(192)>{});
    case 128: return run(PassConfig<128, 2, stage_k(128)>{});
    case 96: return run(PassConfig<96, 2, stage_k(96)>{});
    case 64: return run(PassConfig<64, 2, stage_k(64)>{});
    case 48: return run(PassConfig<48, 2, stage_k(48)>{});
    case 32: return four ? run(PassConfig<32, 4, stage_k(32)>{}) : run(PassConfig<32, 2, stage_k(32)>{});
    case 16: return four ? run(PassConfig<16, 4, stage_k(16)>{}) : run(PassConfig<16, 2, stage_k(16)>{});
    default: return cudaErrorInvalidValue;
  }
}

// The batches of a pass of NTOK tokens: the rounded passes' Int4PrescaledBatch (one packet per issue) above 128
// tokens, Int4Batch (the weights exact) otherwise.
template <typename T, int NTOK, int GS, bool ASYM>
using PassBatch = std::conditional_t<(NTOK > kMaxPassRows), Int4PrescaledBatch<ASYM>, Int4Batch<T, GS, ASYM>>;

// Whether a pass of NTOK tokens can run for T and GS (the rounded passes: bf16 at group size 128).
template <typename T, int NTOK, int GS>
constexpr bool pass_applies() {
  return NTOK <= kMaxPassRows || (GS == 128 && std::is_same<T, __nv_bfloat16>::value);
}

// One pass of at most NTOK rows of a dense int4 weight (S splits, 0: pick; stages = 0: as deep as fits).
template <typename T, int NTOK, int GS, bool ASYM, int WG, int KS>
cudaError_t launch(const void* x, int64_t x_stride, int M, int K, const unsigned char* w, void* out,
                   int64_t out_stride, int N, int S, int stages, bool pdl, void* workspace, int sms,
                   cudaStream_t stream) {
  if constexpr (!pass_applies<T, NTOK, GS>()) {
    return cudaErrorInvalidValue;
  } else {
    Params prm = {};  // launch_kernel refuses M > NTOK (one pass, no token windows)
    prm.w = w;
    prm.M = M; prm.N = N;
    prm.out = out; prm.out_stride = out_stride;
    return launch_kernel<PassBatch<T, NTOK, GS, ASYM>, NTOK, WG, KS, false>(prm, x, x_stride, K, S, stages, pdl,
                                                                           workspace, sms, stream);
  }
}

// One pass (group size 128 or -1; more than 128 rows: a rounded pass, bf16 at group size 128) as plan_pass plans
// it; the kernel is a programmatic dependent launch of its x prep.
template <typename T>
cudaError_t launch_pass(int group_size, bool asym, const void* x, int64_t x_stride, int M, int K,
                        const unsigned char* w, void* out, int64_t out_stride, int N, void* workspace, int sms,
                        cudaStream_t stream) {
  const PassPlan plan = plan_pass(M, K, N, sms);
  auto go = [&](auto gs_c, auto asym_c) {
    constexpr int GS = decltype(gs_c)::value;
    constexpr bool A = decltype(asym_c)::value;
    return with_config(plan, [&](auto cfg) {
      using C = decltype(cfg);
      return launch<T, C::kTokens, GS, A, C::kWarpgroups, C::kStageK>(x, x_stride, M, K, w, out, out_stride, N,
                                                                         plan.schedule, 0, true, workspace, sms,
                                                                         stream);
    });
  };
  using G128 = std::integral_constant<int, 128>;
  using GChannel = std::integral_constant<int, 0>;
  if (group_size == 128) return asym ? go(G128{}, std::true_type{}) : go(G128{}, std::false_type{});
  return asym ? go(GChannel{}, std::true_type{}) : go(GChannel{}, std::false_type{});
}

}  // namespace wide

namespace {

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
  if (nt == 1) {
    using P = Int4Policy<T, 1, GS, ASYM>;
    if constexpr (GS > 0)  // small grids (w4a16_small_grid)
      if (prm.tpw <= 1 && prm.ksl == 2) return lowbit::launch_stream<P, 1, 2>(prm, 1, S, stream);
    return lowbit::launch_tpw<P>(prm, 1, S, stream);
  }
  if (nt == 2) return lowbit::launch_tpw<Int4Policy<T, 2, GS, ASYM>>(prm, 1, S, stream);
  return lowbit::launch_tpw<Int4Policy<T, 4, GS, ASYM>>(prm, 1, S, stream);
}

template <typename T>
cudaError_t launch_dtype(const lowbit::GemmParams& prm, int group_size, bool asym, int S, cudaStream_t stream) {
  return with_int4_group(group_size, asym, [&](auto gs, auto asym_c) {
    return launch_nt<T, decltype(gs)::value, decltype(asym_c)::value>(prm, S, stream);
  });
}

}  // namespace

static_assert(w4a16_gemm_sbytes(32, false) == int4_sbytes<32, false>() &&
                  w4a16_gemm_sbytes(32, true) == int4_sbytes<32, true>() &&
                  w4a16_gemm_sbytes(64, false) == int4_sbytes<64, false>() &&
                  w4a16_gemm_sbytes(64, true) == int4_sbytes<64, true>() &&
                  w4a16_gemm_sbytes(128, false) == int4_sbytes<128, false>() &&
                  w4a16_gemm_sbytes(128, true) == int4_sbytes<128, true>() &&
                  w4a16_gemm_sbytes(-1, false) == int4_sbytes<0, false>() &&
                  w4a16_gemm_sbytes(-1, true) == int4_sbytes<0, true>(),
              "w4a16_gemm.h's w4a16_gemm_sbytes disagrees with Int4Policy's records");

// Workspace bytes launch_w4a16_gemm needs (0: none): the wide kernel's prepped x for its largest pass (the first),
// and stream-K's flags and slots.
size_t w4a16_gemm_workspace_bytes(int64_t M, int64_t K, int64_t N, int group_size, int split_k, int sms,
                                  bool rounded) {
  rounded = rounded && group_size == 128;
  const int64_t m = wide::pass_rows(M, N, K, rounded);  // one pass at a time, the first the largest
  if (split_k != 0 || m == 0 || !w4a16_gemm_wide_takes(group_size)) return 0;
  return static_cast<size_t>(wide::workspace_bytes(m, K, wide::plan_pass(m, K, N, sms).tokens, false, sms));
}

// Small grids: when the streaming kernel's grid (tile groups x splits) has at most 2 CTAs per SM, up to 16 rows, a ring
// of 3 stages instead of pick_stages' 2, and up to 8 rows two K slices per chunk (8 consumer warps instead of 4). At
// most 2 CTAs share an SM there, so the deeper ring costs no CTAs, and the consumers, not the copies, set the pace.
// Measured as a decode step runs the GEMMs (benchmarks/tuning/w4a16_layers.cu: 32 layers' weights replayed from one
// CUDA graph, each GEMM after a kernel that writes its x; us per GEMM, 2 stages and 1 slice / this): M = 1 Llama-3-8B o
// (4096x4096) 6.91 / 6.31, down (14336x4096) 16.15 / 13.25, qkv (4096x6144) 8.26 / 8.15; Llama-70B-like 28672x8192
// 37.04 / 35.62, 8192x8192 13.23 / 13.14. M = 16 (3 stages): down 19.81 / 19.40, o 8.49 / 8.36, qkv and 8192x8192
// within 0.2% (weights of 2^27 elements or more take the wide kernel there). Larger grids lost with them (8192x10240,
// 2.4 CTAs per SM at M = 1: 16.60 / 17.67; gate_up 4096x28672, 3.4: 20.97 / 23.48): pick_stages' choice. Per-channel
// scales keep one slice (their two-slice kernels spilled 4-8 bytes; not measured).
inline void w4a16_small_grid(lowbit::GemmParams& prm, int S, int group_size) {
  if (prm.M > 16 || static_cast<int64_t>(prm.groups) * S > 2 * static_cast<int64_t>(prm.sms)) return;
  prm.stages = 3;
  if (lowbit::token_tiles(prm.M) == 1 && group_size > 0) prm.ksl = 2;
}

// x: [M, K] (row stride x_stride elements, unit column stride, 16-byte aligned rows, K % 8 == 0); packed: the
// repacked blob above; out: [M, N] with row stride out_stride. split_k: K splits per cluster (0 = pick; >= 1
// forces the streaming kernel). workspace: w4a16_gemm_workspace_bytes(...) bytes, 16-byte aligned, or null when
// that is 0. sms: the multiprocessor count.
cudaError_t launch_w4a16_gemm(const W4a16GemmArgs& a, cudaStream_t stream) {
  const InDtype dtype = a.dtype;
  const int64_t K = a.K, N = a.N, x_stride = a.x_stride, out_stride = a.out_stride;
  const void* packed = a.packed;
  const int group_size = a.group_size, split_k = a.split_k, sms = a.sms;
  const bool asym = a.asym;
  void* workspace = a.workspace;
  const void* x = a.x;  // x, out and M move past the wide kernel's passes
  void* out = a.out;
  int64_t M = a.M;
  if (M == 0 || N == 0) return cudaSuccess;
  if (dtype != InDtype::kBF16 && dtype != InDtype::kF16) return cudaErrorInvalidValue;
  const int esize = 2;
  const bool rounded = a.rounded && dtype == InDtype::kBF16 && group_size == 128;
  if (w4a16_gemm_workspace_bytes(M, K, N, group_size, split_k, sms, rounded) > 0) {
    // The wide kernel, up to 128 rows per pass (256 in rounded passes); a last pass of at most 16 rows goes to the
    // streaming kernel unless wide::pass_rows gives it to the wide kernel too.
    if (workspace == nullptr) return cudaErrorInvalidValue;
    int64_t m0 = 0;  // rows done
    while (const int64_t pass = wide::pass_rows(M - m0, N, K, rounded)) {
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
  const int S = split_k > 0 ? split_k : w4a16_stream_split(prm.groups, prm.chunks, M, sms);
  w4a16_small_grid(prm, S, group_size);
  return dtype == InDtype::kBF16 ? launch_dtype<__nv_bfloat16>(prm, group_size, asym, S, stream)
                                 : launch_dtype<__half>(prm, group_size, asym, S, stream);
}

}  // namespace cublade
