// Host-only driver for tests/ops/test_sm80_tiles.py: prints sm80::sm80_tiles_per_cta(N, max_tiles, sms) for each group
// of three integers on the command line, one per line. Runs without a GPU (no CUDA call).
#include "sm80/lowbit_gemm_sm80.h"

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  for (int i = 1; i + 2 < argc; i += 3)
    std::printf("%d\n", cublade::sm80::sm80_tiles_per_cta(std::atoll(argv[i]), std::atoi(argv[i + 1]),
                                                          std::atoi(argv[i + 2])));
  return 0;
}
