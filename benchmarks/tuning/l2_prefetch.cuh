// Bring a weight into L2 ahead of the GEMM that reads it, while the kernels before that GEMM (attention, a norm)
// leave HBM idle. Threads issue Hopper's bulk L2 prefetch (cp.async.bulk.prefetch.L2: no registers, no shared
// memory, nothing waits for the bytes) of `chunk` bytes each, over `ctas` one-warp CTAs, so the prefetch takes
// almost no SM time from the kernels it runs beside. The bytes come in at the normal eviction priority; the GEMM's
// own evict-first loads hit them there.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace cublade {

constexpr uint32_t kL2PrefetchChunk = 16 << 10;  // bytes per prefetch instruction
constexpr int kL2PrefetchCtas = 64;

// Prefetch the first `head` bytes of each of `segments` segments, `stride` bytes apart from p (one segment:
// [p, p + head)); p and stride 16-byte aligned, chunk a multiple of 16. A streaming GEMM's CTA walks its own segment
// of the weight from its start, so the heads of every segment shorten every CTA's walk alike.
__global__ void __launch_bounds__(32)
l2_prefetch_kernel(const char* p, size_t segments, size_t stride, size_t head, uint32_t chunk) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const size_t per_segment = (head + chunk - 1) / chunk, pieces = segments * per_segment;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < pieces; i += size_t(gridDim.x) * blockDim.x) {
    const size_t seg = i / per_segment, off = (i - seg * per_segment) * chunk;
    const uint32_t n = uint32_t(head - off < chunk ? head - off : chunk) & ~15u;
    if (n) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + seg * stride + off), "r"(n) : "memory");
  }
#endif
}

inline cudaError_t launch_l2_prefetch(const void* p, size_t segments, size_t stride, size_t head, cudaStream_t stream,
                                      uint32_t chunk = kL2PrefetchChunk, int ctas = kL2PrefetchCtas) {
  if (head < 16 || segments == 0) return cudaSuccess;
  const size_t pieces = segments * ((head + chunk - 1) / chunk), warps = (pieces + 31) / 32;
  const int grid = int(warps < size_t(ctas) ? warps : size_t(ctas));
  l2_prefetch_kernel<<<grid, 32, 0, stream>>>(static_cast<const char*>(p), segments, stride, head, chunk);
  return cudaGetLastError();
}

}  // namespace cublade
