// Host-only driver for tests/ops/test_gemm_plan.py: for each group of five integers FORMAT M K N SMS on the command
// line (FORMAT 0: int4 at group size 128, 1: MXFP8, 2: int4 at group size 128 with the rounded passes: bf16 x), one
// line with what the op runs for a call of M rows: "prefill"
// (dequantize + cuBLAS), else the wide passes as TOKENSwWARPGROUPS:SCHEDULE (sk: stream-K, else K splits), then
// "s:SPLITS" (int4) or "s" (MXFP8) when the streaming kernel takes the rest. FORMAT 3, FP4 experts, reads the group as
// 3 M E ROUTED_EXPERTS 0 (M rows routed over max(E, ROUTED_EXPERTS) experts, E of them here) and prints the wide
// kernel's tokens per pass as TOKENSw, or "s" for the streaming kernel. Runs without a GPU (no CUDA call).
#define CUBLADE_KERNELS_ONLY  // framework-free (no torch header)
#include "gemm_plan.cuh"

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  using namespace cublade;
  for (int i = 1; i + 4 < argc; i += 5) {
    if (std::atoi(argv[i]) == 3) {  // FP4 experts: 3 M E ROUTED_EXPERTS 0 -> the wide pass's tokens, or "s"
      const int64_t M = std::atoll(argv[i + 1]), E = std::atoll(argv[i + 2]), routed = std::atoll(argv[i + 3]);
      const int nt = wide_tokens(M, rows_spread(true, E, routed, M), true, 0);
      if (nt > 0) std::printf("%dw\n", nt);
      else std::printf("s\n");
      continue;
    }
    const bool mxfp8 = std::atoi(argv[i]) == 1, rounded = std::atoi(argv[i]) == 2;
    const int64_t M = std::atoll(argv[i + 1]), K = std::atoll(argv[i + 2]), N = std::atoll(argv[i + 3]);
    const int sms = std::atoi(argv[i + 4]);
    if (M >= (mxfp8 ? mxfp8_gemm_prefill_rows(N, K) : w4a16_gemm_prefill_rows(128, N, K, rounded))) {
      std::printf("prefill\n");
      continue;
    }
    int64_t m0 = 0;
    for (int64_t p; (p = mxfp8 ? wide::mxfp8_pass_rows(M - m0) : wide::pass_rows(M - m0, N, K, rounded)) > 0;
         m0 += p) {
      const wide::PassPlan plan = mxfp8 ? wide::mxfp8_plan_pass(p, K, N, sms) : wide::plan_pass(p, K, N, sms);
      if (plan.schedule == wide::kStreamKSplit) std::printf("%dw%d:sk ", plan.tokens, plan.warpgroups);
      else std::printf("%dw%d:%d ", plan.tokens, plan.warpgroups, plan.schedule);
    }
    if (m0 < M && mxfp8) std::printf("s");
    else if (m0 < M)
      std::printf("s:%d", w4a16_stream_split(ceil_div(N, 64), static_cast<int>(ceil_div(K, 512)), M - m0, sms));
    std::printf("\n");
  }
  return 0;
}
