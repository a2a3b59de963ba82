// Shared by the stand-alone tuning programs of benchmarks/tuning (CUDA runtime only, no torch): the CUDA error
// check, the median, and do_bench-like timing (triton's do_bench clears L2 before every call; these programs
// pass the flush they want).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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

// mean|got - ref| / mean|ref|: how the sweeps check a configuration's output against the production choice's, read
// back to the host (an all-zero ref gives 0 when got is all zero too, else infinity).
inline double rel_diff(const std::vector<__nv_bfloat16>& got, const std::vector<__nv_bfloat16>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += std::fabs(double(__bfloat162float(got[i])) - __bfloat162float(ref[i]));
    den += std::fabs(double(__bfloat162float(ref[i])));
  }
  return den > 0 ? num / den : num > 0 ? INFINITY : 0.0;
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

// Median microseconds of one replay of the graph that body() captures on stream s (3 replays first).
inline double graph_us(cudaStream_t s, int reps, const std::function<void()>& body) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  body();
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  std::vector<cudaEvent_t> e(reps + 1);
  for (auto& ev : e) CK(cudaEventCreate(&ev));
  for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, s));
  CK(cudaEventRecord(e[0], s));
  for (int i = 0; i < reps; ++i) {
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(e[i + 1], s));
  }
  CK(cudaStreamSynchronize(s));
  std::vector<float> ms(reps);
  for (int i = 0; i < reps; ++i) CK(cudaEventElapsedTime(&ms[i], e[i], e[i + 1]));
  for (auto& ev : e) CK(cudaEventDestroy(ev));
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  return median(ms) * 1e3;
}

// A sweep's launches per configuration: argv[1] if given (at least 20), else 50.
inline int reps_arg(int argc, char** argv) { return argc > 1 ? std::max(20, std::atoi(argv[1])) : 50; }

// A comma-separated list of sizes in argv[i] (e.g. 32,64,128; each at least 1), else `defaults`.
inline std::vector<int> sizes_arg(int argc, char** argv, int i, std::vector<int> defaults) {
  if (argc <= i) return defaults;
  std::vector<int> sizes;
  for (const char* p = argv[i]; *p;) {
    char* end;
    sizes.push_back(std::max(1, int(std::strtol(p, &end, 10))));
    p = *end ? end + 1 : end;
  }
  return sizes;
}

// The current device (its properties) and a non-blocking stream to time on; stdout is line-buffered, so a run
// that dies half-way still shows the rows it finished.
struct Device {
  cudaDeviceProp prop{};
  int sms = 0;
  cudaStream_t stream = nullptr;
  Device() {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    int dev = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaGetDeviceProperties(&prop, dev));
    sms = prop.multiProcessorCount;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }
};

// A do_bench-style flush: cudaMemsetAsync of `bytes` at p on s (a new byte value each call).
inline std::function<void()> memset_flush(void* p, size_t bytes, cudaStream_t s) {
  return [p, bytes, s, i = 0]() mutable { CK(cudaMemsetAsync(p, ++i & 0xFF, bytes, s)); };
}

// Grid-stride 16-byte reads of p[0..n): a read flush, and the plain-read ceiling of a buffer.
__global__ void plain_read(const uint4* p, size_t n, unsigned* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u) *sink = acc;  // keeps the loads; practically never stores
}

// The two L2 flushes the W4A16 sweeps time with, over a 256 MB scratch buffer: do_bench's memset (leaves L2
// full of dirty lines) and a read (leaves it full of clean ones, as after the previous layer's GEMM).
struct Flushes {
  static constexpr size_t kBytes = 256ull << 20;
  void* scratch = nullptr;
  unsigned* sink = nullptr;
  std::function<void()> memset, read;
  explicit Flushes(const Device& d) {
    CK(cudaMalloc(&scratch, kBytes));
    CK(cudaMalloc(&sink, sizeof(unsigned)));
    CK(cudaMemset(scratch, 1, kBytes));
    CK(cudaDeviceSynchronize());
    memset = memset_flush(scratch, kBytes, d.stream);
    read = [this, sms = d.sms, s = d.stream] {
      plain_read<<<4 * sms, 512, 0, s>>>(static_cast<const uint4*>(scratch), kBytes / 16, sink);
      CK(cudaGetLastError());
    };
  }
  Flushes(const Flushes&) = delete;
  Flushes& operator=(const Flushes&) = delete;
};

}  // namespace harness
