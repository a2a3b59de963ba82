// Host-only driver for tests/ops/test_pick_split.py: prints lowbit::pick_split(ctas, chunks, sms, few_ctas_chunks)
// for each group of four integers on the command line, one per line. Runs without a GPU (no CUDA call).
#define CUBLADE_KERNELS_ONLY  // framework-free (no torch header)
#include "w4a16_gemm.cuh"

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  for (int i = 1; i + 3 < argc; i += 4)
    std::printf("%d\n", cublade::lowbit::pick_split(std::atoll(argv[i]), std::atoi(argv[i + 1]),
                                                    std::atoi(argv[i + 2]), std::atoi(argv[i + 3])));
  return 0;
}
