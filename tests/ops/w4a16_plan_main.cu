// Host-only driver for tests/ops/test_w4a16_plan.py: for each group of four integers M K N SMS on the command line,
// one line with what the w4a16 op runs for a call of M rows at group size 128: "prefill" (w4a16_dequant + cuBLAS),
// else the wide passes as TOKENSwWARPGROUPS:SCHEDULE (sk: stream-K, else K splits), then "s:SPLITS" when the
// streaming kernel takes the rest. Runs without a GPU (no CUDA call).
#define CUBLADE_KERNELS_ONLY  // framework-free (no torch header)
#include "w4a16_plan.cuh"
#include "w4a16_gemm.h"

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  using namespace cublade;
  for (int i = 1; i + 3 < argc; i += 4) {
    const int64_t M = std::atoll(argv[i]), K = std::atoll(argv[i + 1]), N = std::atoll(argv[i + 2]);
    const int sms = std::atoi(argv[i + 3]);
    if (M >= w4a16_gemm_prefill_rows(128, N, K)) {
      std::printf("prefill\n");
      continue;
    }
    int64_t m0 = 0;
    for (int64_t p; (p = wide::pass_rows(M - m0, N, K)) > 0; m0 += p) {
      const wide::PassPlan plan = wide::plan_pass(p, K, N, sms);
      if (plan.schedule == wide::kStreamKSplit) std::printf("%dw%d:sk ", plan.tokens, plan.warpgroups);
      else std::printf("%dw%d:%d ", plan.tokens, plan.warpgroups, plan.schedule);
    }
    if (m0 < M) std::printf("s:%d", w4a16_stream_split(ceil_div(N, 64), static_cast<int>(ceil_div(K, 512)), M - m0, sms));
    std::printf("\n");
  }
  return 0;
}
