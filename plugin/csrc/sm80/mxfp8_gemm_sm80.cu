// 1-byte-weight GEMM for GPUs without Hopper's copy engine (sm_80 / 86 / 89, and any later GPU through the compute_80
// PTX): y[M, N] = (x[M, K] (bf16) @ W[N, K]^T) * row_scale[N], W = e4m3 code * 2^(e - 127), one E8M0 exponent e per
// 32 K of a row. It serves two schemes from mxfp8_repack's blob (plugin/ops/mxfp8_gemm.py):
//   * mxfp8 (W8A16): the checkpoint's codes and exponents, no row scale;
//   * fp8 weights as storage (W8A16): the e4m3 codes with every exponent 127 (2^0) and the per-channel (or
//     broadcast per-tensor) fp32 weight scale as row_scale: the weights enter the mma exactly, the scale multiplies
//     the fp32 sum once.
// Numerics: the weights are exact in bf16 (as in mxfp8_gemm.cu), the mma sums all of K in fp32 (the 4 K slices of a
// tile added in slice order), the row scale multiplies the fp32 sum, one rounding to bf16.
//
// Schedule: one CTA per tile of 16 weight rows (the blob's tile blocks of that tile, one per 512-K chunk), 4 warps
// over the K slices of each chunk (warp w: packets 2w and 2w + 1), the slices added through shared memory at the end
// of each token pass (8 or 16 tokens). A tile per CTA gives N / 16 CTAs (256 on a 4096-row weight): enough for every
// SM without splitting K across CTAs. The chunks stream through a ring of shared-memory stages filled by every
// thread with 16-byte cp.async (Ampere's asynchronous copy; no bulk-copy engine, no mbarrier transaction counts),
// cp.async.wait_group + one barrier per stage; x rows of the pass travel in the same stages (zero-filled past K).
// The dequantization is mxfp8_codes.cuh's, as on Hopper.
#define CUBLADE_KERNELS_ONLY  // framework-free; the torch wrapper is mxfp8_gemm_sm80_torch.cpp
#include "mxfp8_codes.cuh"
#include "sm80/mxfp8_gemm_sm80.h"

namespace cublade {
namespace sm80 {
namespace {

using lowbit::kChunk;
using lowbit::kPacketK;
using lowbit::kTileN;
using lowbit::kXRowBytes;
using mxfp8::kBlockBytes;
using mxfp8::kCodePacketBytes;

constexpr int kWarps = 4;                            // K slices per chunk
constexpr int kThreads = 32 * kWarps;
constexpr int kPacketsPerWarp = kChunk / kWarps;     // 2
constexpr int kChunkXBytes = kChunk * kPacketK * 2;  // one x row's bf16 of a chunk: 1024 bytes

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool fill) {
  // src_size 0 writes 16 zero bytes (the x columns past K).
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(lowbit::smem_u32(dst)), "l"(src),
               "r"(fill ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

template <int NT>
constexpr int stage_bytes() {
  return kBlockBytes + 8 * NT * kXRowBytes;
}
// Ring depth: as deep as fits under sm_86 / sm_89's 99 KB of shared memory per CTA (with the reduction buffer).
template <int NT>
constexpr int stages() {
  return NT == 1 ? 4 : 3;
}
template <int NT>
constexpr int red_bytes() {
  return (kWarps - 1) * NT * 4 * 32 * 4;
}
template <int NT>
constexpr int smem_bytes() {
  return stages<NT>() * stage_bytes<NT>() + red_bytes<NT>();
}
static_assert(smem_bytes<1>() <= 99 * 1024 && smem_bytes<2>() <= 99 * 1024, "sm_86 / sm_89 shared memory per CTA");

struct Params {
  const __nv_bfloat16* x;
  int64_t x_stride;
  int M, K;
  const unsigned char* w;  // the blob
  int chunks;
  const float* row_scale;  // [N] or null
  __nv_bfloat16* out;
  int64_t out_stride;
  int N;
};

template <int NT>
__global__ void __launch_bounds__(kThreads) gemm_kernel(const __grid_constant__ Params prm) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x;  // 16 rows: tile group tile / 4, tile tile % 4 of it
  const int rows_per_pass = 8 * NT;
  const int passes = (prm.M + rows_per_pass - 1) / rows_per_pass;
  const int total = passes * prm.chunks;  // (pass, chunk) steps, streamed through one ring
  const unsigned char* w_tile =
      prm.w + (static_cast<int64_t>(tile / lowbit::kGroupTiles) * prm.chunks * lowbit::kGroupTiles +
               tile % lowbit::kGroupTiles) * kBlockBytes;
  constexpr int S = stages<NT>();
  float* red = reinterpret_cast<float*>(smem + S * stage_bytes<NT>());

  auto load = [&](int step) {
    unsigned char* st = smem + (step % S) * stage_bytes<NT>();
    const int pass = step / prm.chunks, c = step % prm.chunks;
    const unsigned char* wsrc = w_tile + static_cast<int64_t>(c) * lowbit::kGroupTiles * kBlockBytes;
    for (int i = tid; i < kBlockBytes / 16; i += kThreads) cp_async16(st + 16 * i, wsrc + 16 * i, true);
    const int m0 = pass * rows_per_pass, rows = min(rows_per_pass, prm.M - m0);
    const int k0 = c * kChunk * kPacketK;
    for (int i = tid; i < rows * (kChunkXBytes / 16); i += kThreads) {
      const int r = i / (kChunkXBytes / 16), v = i % (kChunkXBytes / 16), k = k0 + 8 * v;
      const bool in = k < prm.K;  // K % 32 == 0: a vector of 8 is all in or all out
      cp_async16(st + kBlockBytes + r * kXRowBytes + 16 * v,
                 prm.x + static_cast<int64_t>(m0 + r) * prm.x_stride + (in ? k : 0), in);
    }
  };

#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < total) load(s);
    cp_async_commit();
  }
  float acc[NT][4];
  for (int step = 0; step < total; ++step) {
    cp_async_wait<S - 2>();
    __syncthreads();  // stage `step` landed for every thread's copies; stage step - 1 is free for all
    if (step + S - 1 < total) load(step + S - 1);
    cp_async_commit();

    const int pass = step / prm.chunks, c = step % prm.chunks;
    const int m0 = pass * rows_per_pass, rows = min(rows_per_pass, prm.M - m0);
    if (c == 0) {
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[n][j] = 0.0f;
    }
    const unsigned char* st = smem + (step % S) * stage_bytes<NT>();
    const unsigned char* xs = st + kBlockBytes;
#pragma unroll
    for (int jj = 0; jj < kPacketsPerWarp; ++jj) {
      const int p = warp * kPacketsPerWarp + jj;  // packet of the chunk
      uint4 xv[2][NT];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const int row = 8 * n + g;
          xv[h][n] = row < rows ? lowbit::lds128(xs + row * kXRowBytes + (p * kPacketK + 32 * h) * 2 + t * 16)
                                : make_uint4(0u, 0u, 0u, 0u);
        }
      const unsigned char* q = st + p * kCodePacketBytes + lane * 16;
      uint32_t a[4][4];
      mxfp8::dequant_packet(lowbit::lds128(q), lowbit::lds128(q + 512), st + kChunk * kCodePacketBytes, p, lane, a);
      lowbit::mma_packet<__nv_bfloat16, NT>(acc, a, xv);
    }

    if (c == prm.chunks - 1) {  // the pass's sums: slices 1..3 through shared memory, added in slice order
      auto red_at = [&](int slot, int n, int j) { return red + ((slot * NT + n) * 4 + j) * 32 + lane; };
      if (warp > 0)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int j = 0; j < 4; ++j) *red_at(warp - 1, n, j) = acc[n][j];
      __syncthreads();
      if (warp == 0) {
        const int r_lo = tile * kTileN + g, r_hi = r_lo + 8;
        const float f_lo = prm.row_scale && r_lo < prm.N ? prm.row_scale[r_lo] : 1.0f;
        const float f_hi = prm.row_scale && r_hi < prm.N ? prm.row_scale[r_hi] : 1.0f;
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            float v = acc[n][j];
            for (int slot = 0; slot < kWarps - 1; ++slot) v += *red_at(slot, n, j);
            const int row = j < 2 ? r_lo : r_hi;
            const int tok = 8 * n + 2 * t + (j & 1);
            if (row < prm.N && tok < rows)
              prm.out[static_cast<int64_t>(m0 + tok) * prm.out_stride + row] =
                  __float2bfloat16_rn(v * (j < 2 ? f_lo : f_hi));
          }
      }
      __syncthreads();  // red is read before the next pass's slices write it
    }
  }
  cp_async_wait<0>();
}

template <int NT>
cudaError_t launch(const Params& prm, int tiles, cudaStream_t stream) {
  constexpr auto kernel = gemm_kernel<NT>;
  static const cudaError_t attr =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<NT>());
  if (attr != cudaSuccess) return attr;
  kernel<<<static_cast<unsigned>(tiles), kThreads, smem_bytes<NT>(), stream>>>(prm);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_mxfp8_gemm_sm80(const Mxfp8GemmSm80Args& a, cudaStream_t stream) {
  if (a.M == 0 || a.N == 0) return cudaSuccess;
  if (a.M < 0 || a.N < 0 || a.K <= 0 || a.K % 32 != 0 || a.N > INT32_MAX || a.K > INT32_MAX - kLowbitChunkK ||
      a.M > INT32_MAX || !is_aligned(a.packed, 16) || !is_aligned(a.x, 16) || a.x_stride % 8 != 0)
    return cudaErrorInvalidValue;
  Params prm = {};
  prm.x = static_cast<const __nv_bfloat16*>(a.x);
  prm.x_stride = a.x_stride;
  prm.M = static_cast<int>(a.M);
  prm.K = static_cast<int>(a.K);
  prm.w = static_cast<const unsigned char*>(a.packed);
  prm.chunks = static_cast<int>(ceil_div(a.K, kLowbitChunkK));
  prm.row_scale = a.row_scale;
  prm.out = static_cast<__nv_bfloat16*>(a.out);
  prm.out_stride = a.out_stride;
  prm.N = static_cast<int>(a.N);
  const int64_t tiles = ceil_div(a.N, kTileN);
  return a.M <= 8 ? launch<1>(prm, static_cast<int>(tiles), stream) : launch<2>(prm, static_cast<int>(tiles), stream);
}

cudaError_t launch_mxfp8_dequant_packed_sm80(const void* packed, int64_t N, int64_t K, void* out,
                                             cudaStream_t stream) {
  if (N == 0 || K == 0) return cudaSuccess;
  if (N < 0 || K < 0 || K % 32 != 0 || N > INT32_MAX || K > INT32_MAX - kLowbitChunkK || !is_aligned(packed, 16) ||
      ceil_div(N, kLowbitGroupRows) * ceil_div(K, kLowbitChunkK) > INT32_MAX)
    return cudaErrorInvalidValue;
  const int chunks = static_cast<int>(ceil_div(K, kLowbitChunkK));
  const int64_t blocks = ceil_div(N, kLowbitGroupRows) * chunks;
  mxfp8::dequant_packed_kernel<<<static_cast<unsigned>(blocks), mxfp8::kDequantThreads, 0, stream>>>(
      static_cast<const unsigned char*>(packed), chunks, static_cast<int>(N), static_cast<int>(K),
      static_cast<__nv_bfloat16*>(out));
  return cudaGetLastError();
}

}  // namespace sm80
}  // namespace cublade
