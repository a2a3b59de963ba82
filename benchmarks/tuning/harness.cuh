// Shared by the stand-alone tuning programs of benchmarks/tuning (CUDA runtime only, no torch): the CUDA error
// check, the median, and do_bench-like timing (triton's do_bench clears L2 before every call; these programs
// pass the flush they want).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define CK(call)                                                                                      \
  do {                                                                                                \
    cudaError_t e_ = (call);                                                                          \
    if (e_ != cudaSuccess) {                                                                          \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, \
                   #call);                                                                            \
      std::exit(2);                                                                                   \
    }                                                                                                 \
  } while (0)

namespace harness {

inline double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Median microseconds of `reps` launches of f() on stream s, each after flush() (3 warm-up launches first, also
// after a flush); CUDA events bracket each launch.
inline double time_us(const std::function<cudaError_t()>& f, const std::function<void()>& flush, int reps,
                      cudaStream_t s) {
  for (int i = 0; i < 3; ++i) {
    flush();
    CK(f());
  }
  std::vector<cudaEvent_t> e(2 * reps);
  for (auto& ev : e) CK(cudaEventCreate(&ev));
  for (int i = 0; i < reps; ++i) {
    flush();
    CK(cudaEventRecord(e[2 * i], s));
    CK(f());
    CK(cudaEventRecord(e[2 * i + 1], s));
  }
  CK(cudaStreamSynchronize(s));
  std::vector<float> ms(reps);
  for (int i = 0; i < reps; ++i) CK(cudaEventElapsedTime(&ms[i], e[2 * i], e[2 * i + 1]));
  for (auto& ev : e) CK(cudaEventDestroy(ev));
  return median(ms) * 1e3;
}

// A do_bench-style flush: cudaMemsetAsync of `bytes` at p on s (a new byte value each call).
inline std::function<void()> memset_flush(void* p, size_t bytes, cudaStream_t s) {
  return [p, bytes, s, i = 0]() mutable { CK(cudaMemsetAsync(p, ++i & 0xFF, bytes, s)); };
}

}  // namespace harness
