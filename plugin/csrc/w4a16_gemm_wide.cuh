// The wide W4A16 kernel's int4 batches and pass launchers (namespace wide), the part of the w4a16_gemm op that
// instantiates the most kernels: compiled once per activation dtype in its own translation unit
// (w4a16_gemm_wide_bf16.cu, w4a16_gemm_wide_f16.cu), which w4a16_gemm.cu calls through wide::launch_pass<T>, so a
// parallel build compiles the op's three parts at once. A program that includes w4a16_gemm.cu whole (the tuning
// harnesses of benchmarks/tuning) defines CUBLADE_W4A16_ONE_TU first and instantiates them there instead.
// The blob and the numerics: w4a16_gemm.cu.
#pragma once

#include "w4a16_gemm.cuh"
#include "int4_codes.cuh"
#include "gemm_plan.cuh"
#include "w4a16_gemm.h"

#include <type_traits>

namespace cublade {
namespace wide_int4 {

using int4::Int4Policy;
using int4::bias_pair;
using int4::dequant_int4;
using int4::unpack_rec;

}  // namespace wide_int4

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

using namespace wide_int4;

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

}  // namespace cublade
