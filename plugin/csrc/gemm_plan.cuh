// The W4A16 and MXFP8 ops' choices for a call, as host functions: which rows the wide (wgmma) kernel takes and in what
// passes, each pass's configuration and schedule, and (int4) the streaming kernel's K splits for the rest; and the FP4
// experts' tokens per wide pass. w4a16_gemm.cu, mxfp8_gemm.cu and fp4_gemm.cu launch by them;
// tests/ops/test_gemm_plan.py holds them, on the host, to the shapes they were measured on (the torch ops' prefill
// switches, w4a16_gemm_prefill_rows and mxfp8_gemm_prefill_rows, are in w4a16_gemm.h).
#pragma once

#include "w4a16_gemm.h"  // kMxfp8WideMinRows
#include "wide_gemm.cuh"

#include <algorithm>
#include <cmath>

namespace cublade {
namespace wide {

constexpr int kMinRows = 17;       // from this many rows the wide kernel, on every shape
constexpr int kMinSmallRows = 9;   // from this many on large weights (kSmallPassMinWeights)

// Passes of 9-16 rows (16 tokens) run the wide kernel when the weight has at least this many elements (96 Mi: 48
// MiB of int4). Measured (w4a16_wide.cu, M = 16, us, prep included, streaming kernel / wide): 8192x28672 59.4 /
// 47.6, 28672x8192 53.6 / 50.5, but 8192x10240 26.8 / 29.5 and 4096x14336 20.2 / 21.4 (the wide kernel's fixed
// costs, the x prep and the pipeline's fill, weigh more on a shorter call). At 1-8 rows the streaming kernel was
// faster on all four (8192x28672 M = 8: 43.4 against 46.6 with 8 tokens per pass). The threshold sits below
// Llama-3-8B's gate_up (4096x28672, 1.17e8 elements; 2^27 would leave it on the streaming kernel), timed as a decode
// step runs it (benchmarks/tuning/w4a16_layers.cu, CUDA graph, us at M = 9 / 12 / 16): streaming 30.12 / 30.54 /
// 30.93, wide 24.68 / 24.79 / 24.95; the same run kept the smaller ones on the streaming kernel (M = 16: 8192x10240,
// 8.4e7 elements, 22.88 / 25.01; 4096x14336 16.61 / 17.05; Llama-3-8B qkv, o, down 10.77 / 14.09, 8.41 / 12.32,
// 19.63 / 22.34). On an H100 (benchmarks/bench_w4a16_gemm.py, one launch after an L2 clear, us at M = 9 / 12 / 16)
// gate_up's op took 34.9 / 35.2 / 35.3 against the streaming kernel's 36.4 / 35.6 / 35.6.
constexpr int64_t kSmallPassMinWeights = int64_t(96) << 20;

// Rounded passes (`rounded`: bf16 x at group size 128, and the op allowed to round the weights, as its prefill path
// does): from kRoundedMinRows rows left, passes of up to 256 rows on Int4PrescaledBatch (w4a16_gemm.cu: the weights
// rounded once to bf16 in the A fragments, so no fold's second accumulators, and 256 tokens fit 2 warpgroups with
// quarter-chunk stages), 192 tokens for up to 192 rows. Measured (w4a16_wide.cu, one H200, us, prep included; exact
// passes of 128 as the op ran them / one rounded pass): M = 256 on 8192x28672 / 4096x14336 / 28672x8192 / 8192x10240
// 210.5 / 72.3 / 225.5 / 97.6 against 177.5 / 60.3 / 179.7 / 76.2 (1.19-1.28x). At 160 / 192 rows one pass of 192
// tokens on the schedule plan_pass picks (stream-K; 2 splits on 28672x8192) took 144.5 / 147.0, 50.2 / 51.5,
// 151.8 / 154.5, 62.8 / 63.9, where the op ran exact passes at 160 (159.8, 57.6, 167.5, 79.3) and a 256-token pass at
// 192 (170.8, 58.9, 173.8, 73.7): 1.10-1.26x. Below 160 rows (the exact 128 and a short last pass) not measured
// against it.
constexpr int64_t kRoundedMinRows = 160;
constexpr int64_t kRoundedSmallPassRows = 192;  // a rounded pass of up to this many rows runs 192 tokens

// Rows of the next wide pass when `left` rows remain (0: the streaming kernel takes them).
constexpr int64_t pass_rows(int64_t left, int64_t N, int64_t K, bool rounded = false) {
  return rounded && left >= kRoundedMinRows ? std::min<int64_t>(left, kRoundedPassRows)
         : left >= kMinRows                 ? std::min<int64_t>(left, kMaxPassRows)
         : left >= kMinSmallRows && N * K >= kSmallPassMinWeights ? left
                                                                   : 0;
}

// K per ring stage for a pass of `tokens`: quarter-chunk stages above 128 tokens (the rounded passes), half-chunk
// stages from 96 (3 stages of 66 KB at 96, 2 of 82 KB at 128), whole chunks below.
constexpr int stage_k(int tokens) { return tokens > 128 ? 128 : tokens >= 96 ? 256 : 512; }

// A wide pass's plan: tokens per pass (wgmma N), consumer warpgroups per CTA, K per ring stage, and the schedule
// (K splits per cluster, >= 1, or kStreamKSplit).
struct PassPlan {
  int tokens, warpgroups, stage_k, schedule;
};

// The plan of a pass of `rows` rows (sms: the device's multiprocessor count). 96 and 128 tokens at 2 warpgroups
// with half-chunk stages. Measured (int4, w4a16_wide.cu, us with PDL):
// M = 128 on 8192x28672 / 4096x14336 / 28672x8192 / 8192x10240 125.8 / 38.4 / 114.9 / 65.3 in one pass of 128,
// against 162.8 / 55.1 / 146.8 / 86.9 in two of 64 (no PDL). Four warpgroups only up to 32 tokens: at 48-64
// they won only on 8192x28672 and only against split-K (77.9 against 79.8 us); two warpgroups with stream-K run there
// 64.4 / 69.7 us at 48 / 64 against four's 71.6 / 79.7. At 32 tokens four (split-K) still win, 53.8 against 58.3.
// A dense pass's plan from its configuration: the schedule launch_kernel would pick for it (CTAs of `wg` tile groups
// over N's 64-row tile groups, stream-K only where every CTA gets `wg` of them).
inline PassPlan dense_plan(int tokens, int wg, int ks, int64_t K, int64_t N, int sms) {
  const int64_t groups = ceil_div(N, 64);
  return {tokens, wg, ks,
          pick_schedule(ceil_div(groups, wg), groups % wg == 0, static_cast<int>(ceil_div(K, kBlobChunkK)),
                        static_cast<int>(ceil_div(K, ks)), sms)};
}

// Passes of more than 128 rows (rounded passes) run 192 tokens up to 192 rows, else 256, on 2 warpgroups; the
// schedule as for the others (on the four shapes above it picked stream-K, or 2 K splits on 28672x8192, each within
// 1% of the best of 1, 2, 4 splits and stream-K at 256 tokens but on 4096x14336: 60.3 us against one split's 57.1;
// at 192 tokens within 5%: 4096x14336 50.2 against 48.5, 28672x8192 154.5 against stream-K's 147.1).
inline PassPlan plan_pass(int64_t rows, int64_t K, int64_t N, int sms) {
  if (rows > kMaxPassRows) {
    const int tokens = rows <= kRoundedSmallPassRows ? static_cast<int>(kRoundedSmallPassRows) : kRoundedPassRows;
    return dense_plan(tokens, 2, stage_k(tokens), K, N, sms);
  }
  const int tokens = ntok(rows);
  const int wg = tokens <= 32 && four_warpgroups(ceil_div(ceil_div(N, 64), 4), sms) ? 4 : 2;
  return dense_plan(tokens, wg, stage_k(tokens), K, N, sms);
}

// MXFP8: passes of up to 128 rows from kMxfp8WideMinRows (fewer left: the streaming kernel), and from
// kMxfp8LargePassMinRows left passes of up to 256 (256 tokens on 2 warpgroups, quarter-chunk stages, one packet per
// issue: Mxfp8Steps in mxfp8_gemm.cu). MXFP8's weights are exact in bf16 either way (the passes differ only in fp32
// summation order). The rows from which the 256-token pass runs are those int4's rounded passes first had (the same
// kernel shape). Measured for MXFP8 (bench_mxfp8_gemm.py, H200): at 256 rows 215.3 / 63.8 / 225.2 us on 8192x28672 /
// 4096x14336 / 28672x8192 against 246.7 / 77.6 / 263.1 with the passes of 128 (1.15-1.22x; docs/decisions.md).
constexpr int64_t kMxfp8LargePassMinRows = 192;
constexpr int kMxfp8LargePassRows = 256;
// Rows of the next pass when `left` rows remain (0: the streaming kernel takes them).
constexpr int64_t mxfp8_pass_rows(int64_t left) {
  return left >= kMxfp8LargePassMinRows ? std::min<int64_t>(left, kMxfp8LargePassRows)
         : left >= kMxfp8WideMinRows    ? std::min<int64_t>(left, kMaxPassRows)
                                        : 0;
}

// The MXFP8 wide kernel's configuration: half-chunk stages everywhere (a whole chunk of 1-byte codes is 33 KB a tile
// group), two warpgroups. Four (which int4 takes at 32 tokens where their CTAs fill 3/4 of the SMs) lose: on
// 8192x28672 (benchmarks/tuning/mxfp8_sweep.cu) two warpgroups with stream-K run 78.4 / 85.8 us at 32 / 64 tokens
// against four's 81.7 / 92.6 with stream-K, 83.3 / 92.5 with split-K (the other shapes' CTAs of four do not fill 3/4
// of the SMs).
constexpr int kMxfp8StageK = 256;  // K per ring stage: half a chunk (a quarter at 256 tokens, as int4's)
constexpr int mxfp8_pass_tokens(int64_t rows) { return rows > kMaxPassRows ? kMxfp8LargePassRows : ntok(rows); }
inline PassPlan mxfp8_plan_pass(int64_t rows, int64_t K, int64_t N, int sms) {
  const int tokens = mxfp8_pass_tokens(rows);
  return dense_plan(tokens, 2, tokens > kMaxPassRows ? stage_k(tokens) : kMxfp8StageK, K, N, sms);
}

}  // namespace wide

// The streaming kernel's K splits for M rows: splits of 4 chunks on small grids, measured up to 16 rows (pick_split);
// more rows (group sizes the wide kernel does not take) keep 8.
inline int w4a16_stream_split(int64_t groups, int chunks, int64_t M, int sms) {
  return lowbit::pick_split(groups, chunks, sms, M <= 16 ? 4 : 8);
}

// ---- FP4 experts (fp4_gemm.cu)

// The wide kernel from this many rows per expert (the mean over the experts that can have rows). Measured
// (benchmarks/tuning/fp4_wide_sweep.cu, Mixtral w13 / w2, 8 experts, random top-2 routing, us): at a
// mean of 16 rows (64 tokens) the wide kernel at 32 tokens a pass took 220.8 / 106.6 against the streaming kernel's
// 274.7 / 138.1; at 8 rows (32 tokens) it lost, 218.3 / 105.1 against 175.7 / 97.5.
constexpr int64_t kWideMinRows = 16;

// Tokens per wide pass (0: the streaming kernel), from r, the mean rows per expert (grouped) or the rows (dense).
// Each candidate costs (passes an expert needs) x (time of a pass relative to 64 tokens); an expert needs r tokens,
// plus up to 7 (its window starts on a multiple of 8) plus the spread of the counts around r (about sqrt(r) for
// random routing), taken as 7 + 1.5 sqrt(r). The relative times are single-pass calls of the sweep (8 experts of 8
// rows): w13 218.3 / 273.3 / 299.0 / 403.7 / 469.5 us and w2 105.1 / 130.9 / 145.1 / 188.8 / 221.8 at 32 (4
// warpgroups) / 48 / 64 / 96 / 128 tokens. On the sweep's routings (64-4096 tokens) the rule picks the fastest
// configuration on both shapes except at 512 tokens: 96 tokens a pass, where 64 ran 7% (w13) / 9% (w2) faster.
inline int wide_tokens(int64_t M, int64_t active, bool grouped, int split_k) {
  if (split_k > 0) return 0;
  const int64_t r = ceil_div(M, active);
  if (r < kWideMinRows) return 0;
  const double need = grouped ? r + 7 + 1.5 * std::sqrt(static_cast<double>(r)) : static_cast<double>(r);
  constexpr int kTokens[] = {32, 48, 64, 96, 128};
  constexpr double kPassCost[] = {0.72, 0.90, 1.0, 1.33, 1.55};
  int best = 0;
  double best_cost = 0.0;
  for (int i = 0; i < 5; ++i) {
    const double cost = std::ceil(need / kTokens[i]) * kPassCost[i];
    if (best == 0 || cost < best_cost) best = kTokens[i], best_cost = cost;
  }
  return best;
}

// The experts M rows spread over (wide_tokens' mean rows per expert is M over these): those that can have rows, of
// the ones the rows were routed over (expert parallel: more than this rank holds).
inline int64_t rows_spread(bool grouped, int64_t E, int64_t routed_experts, int64_t M) {
  return lowbit::expert_slices(grouped, std::max(E, routed_experts), M);
}

}  // namespace cublade
