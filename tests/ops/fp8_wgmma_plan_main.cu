// Host-only driver for tests/ops/test_fp8_gemm_wgmma.py: prints plan_fp8_wgmma(M, N, K, sms, batch_invariant) as
// "rows tokens split two" (two: two CTAs an SM; rows 128: the warpgroups split the weight rows; 64: they split the tokens) for each group of
// five integers on the command line, one per line. Runs without a GPU (no CUDA call).
#include "fp8_gemm_wgmma.cu"

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  for (int i = 1; i + 4 < argc; i += 5) {
    const cublade::Fp8WgmmaPlan p = cublade::plan_fp8_wgmma(std::atoll(argv[i]), std::atoll(argv[i + 1]),
                                                            std::atoll(argv[i + 2]), std::atoi(argv[i + 3]),
                                                            std::atoi(argv[i + 4]) != 0);
    std::printf("%d %d %d %d\n", p.rows_split ? 128 : 64, p.rows_split ? p.tokens_per_wg : 2 * p.tokens_per_wg,
                p.split_k, p.two_per_sm ? 2 : 1);
  }
  return 0;
}
