// L2 prefetch: one cp.async.bulk.prefetch.L2 per 16 KB chunk of a byte range, one chunk per thread, spread over
// enough CTAs that the requests leave many SMs at once. The instruction only asks the memory system for the lines
// and completes at once (no barrier, no data returned to the SM), so the kernel ends in the time it takes to issue
// the requests while the bytes keep streaming from HBM into L2 behind the kernels that follow.
// Why and where it runs: docs/kernels.md, "l2_prefetch".
#define CUBLADE_KERNELS_ONLY  // framework-free (no torch header); the torch wrapper is l2_prefetch_torch.cpp
#include "common.cuh"

namespace cublade {
namespace {

constexpr int64_t kChunkBytes = 16 * 1024;  // one bulk prefetch
constexpr int kThreads = 128;               // 2 MB of requests per CTA

__global__ void __launch_bounds__(kThreads) l2_prefetch_kernel(const uint8_t* __restrict__ p, int64_t bytes) {
  const int64_t off = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kChunkBytes;
  if (off >= bytes) return;
  const uint32_t n = static_cast<uint32_t>(bytes - off < kChunkBytes ? bytes - off : kChunkBytes);  // 16 | n
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(n) : "memory");
}

}  // namespace

cudaError_t launch_l2_prefetch(const L2PrefetchArgs& a, cudaStream_t stream) {
  const uintptr_t first = (reinterpret_cast<uintptr_t>(a.p) + 15) & ~uintptr_t{15};
  const int64_t bytes = (a.bytes - static_cast<int64_t>(first - reinterpret_cast<uintptr_t>(a.p))) & ~int64_t{15};
  if (a.p == nullptr || bytes <= 0) return cudaSuccess;
  const int64_t grid = ceil_div(ceil_div(bytes, kChunkBytes), kThreads);
  l2_prefetch_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(reinterpret_cast<const uint8_t*>(first),
                                                                          bytes);
  return cudaGetLastError();
}

}  // namespace cublade
