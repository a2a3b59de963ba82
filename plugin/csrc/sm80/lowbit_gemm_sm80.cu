// Weight-streaming GEMM for GPUs without Hopper's copy engine and wgmma (sm_80 / 86 / 89, and any later GPU through
// the compute_80 PTX): y[M, N] = x[M, K] @ W[N, K]^T for decode batches, on the Hopper kernels' blobs and register
// dequant (a policy per blob: int4_codes.cuh, mxfp8_codes.cuh). It serves:
//   * w4a16 (bf16 / fp16 x): w4a16_repack's int4 blob, each group's sum scaled in fp32 (Int4Policy);
//   * mxfp8 (W8A16, bf16 x): mxfp8_repack's blob (Mxfp8Policy);
//   * fp8 weights as storage (W8A16, bf16 x): the e4m3 codes in mxfp8_repack's blob with every exponent 127 (2^0),
//     the per-channel (or broadcast per-tensor) fp32 weight scale multiplying the fp32 sum once (row_scale).
// Numerics: as the Hopper streaming kernel's for the same blob (the same policies), the 4 K slices of a tile added
// in slice order; one rounding to x's dtype.
//
// Schedule: one CTA per 1, 2 or 4 tiles of 16 weight rows (the blob's tile blocks of those tiles, one per 512-K chunk,
// adjacent), 4 warps over the (tile, K slice) pairs of each chunk (a slice: 2 packets, 128 K, whole scale groups),
// each tile's slices added in slice order at the end of each token pass (8 or 16 tokens), through shared memory where
// another warp holds them. One tile per CTA gives N / 16 CTAs (256 on a 4096-row weight): enough for every SM
// without splitting K across CTAs; wide weights take more tiles per CTA, so that each x row loaded serves more weight
// rows (at 16 tokens a CTA's x rows are 4x its int4 weight bytes). The chunks stream through a
// ring of shared-memory stages filled by every thread with 16-byte cp.async (Ampere's asynchronous copy; no
// bulk-copy engine, no mbarrier transaction counts), cp.async.wait_group + one barrier per stage; the x rows of the
// pass travel in the same stages (zero-filled past K).
#define CUBLADE_KERNELS_ONLY  // framework-free; the torch wrapper is lowbit_gemm_sm80_torch.cpp
#define CUBLADE_MXFP8_SCALED_DEQUANT  // mxfp8_codes.cuh's dequant with a row scale (the fp8 W8A16 prefill)
#include "int4_codes.cuh"
#include "mxfp8_codes.cuh"
#include "sm80/lowbit_gemm_sm80.h"

#include <algorithm>

namespace cublade {
namespace sm80 {
namespace {

using lowbit::kChunk;
using lowbit::kPacketK;
using lowbit::kTileN;
using lowbit::kXRowBytes;

constexpr int kWarps = 4;                            // K slices per chunk
constexpr int kThreads = 32 * kWarps;
constexpr int kPacketsPerWarp = kChunk / kWarps;     // 2
constexpr int kSliceK = kPacketsPerWarp * kPacketK;  // 128 K per warp per chunk
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

// A tile block (one tile's 512 K of the blob: packets, then the chunk's scale records) and one stage: the CTA's
// TILES tile blocks of a chunk (adjacent in the blob: TILES divides a tile group) and the pass's x rows.
template <class P>
constexpr int block_bytes() {
  return kChunk * P::kPacketBytes + P::kSBytes;
}
template <class P, int TILES>
constexpr int stage_bytes() {
  return TILES * block_bytes<P>() + 8 * P::NT * kXRowBytes;
}
// The slices a tile's first warp does not hold, one per (tile, slice): 3 at one tile per CTA, 4 at two, none at four.
template <int TILES>
constexpr int red_slots() {
  return TILES * (kWarps - TILES);
}
template <class P, int TILES>
constexpr int red_bytes() {
  return red_slots<TILES>() * P::NT * 4 * 32 * 4;
}
// Ring depth: up to 4 stages, as many as fit sm_86 / sm_89's 99 KB of shared memory per CTA with the reduction
// buffer (one tile, MXFP8 at 16 tokens: 3; two or four tiles at 16 tokens: 2).
template <class P, int TILES>
constexpr int stages() {
  return std::min(4, (99 * 1024 - red_bytes<P, TILES>()) / stage_bytes<P, TILES>());
}
template <class P, int TILES>
constexpr int smem_bytes() {
  return stages<P, TILES>() * stage_bytes<P, TILES>() + red_bytes<P, TILES>();
}

struct Params {
  const void* x;
  int64_t x_stride;
  int M, K;
  const unsigned char* w;  // the blob
  int chunks;
  const float* row_scale;  // [N] or null
  void* out;
  int64_t out_stride;
  int N;
};

// TILES tiles of 16 weight rows per CTA (1, 2 or 4): each x row a stage holds serves TILES tiles. The 4 warps split
// the TILES x 4 (tile, K slice) pairs: warp w takes tile w / (4 / TILES) and TILES consecutive slices, one
// accumulator each, so every tile's sums are still added in slice order (the numerics do not depend on TILES).
template <class P, int TILES>
__global__ void __launch_bounds__(kThreads) gemm_kernel(const __grid_constant__ Params prm) {
  using T = typename P::T;
  constexpr int NT = P::NT, S = stages<P, TILES>(), kBlock = block_bytes<P>(), kStage = stage_bytes<P, TILES>();
  constexpr int kTilesBlock = TILES * kBlock;
  constexpr int kWarpsPerTile = kWarps / TILES;
  constexpr int V = P::kPacketBytes / 512;  // 16-byte vectors per lane per packet
  static_assert(S >= 2, "two stages must fit");
  static_assert(lowbit::kGroupTiles % TILES == 0 && kWarps % TILES == 0, "a CTA's tiles lie in one tile group");
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int tile0 = blockIdx.x * TILES;        // the CTA's first tile: tile group tile0 / 4, tile tile0 % 4 of it
  const int wt = warp / kWarpsPerTile;         // the warp's tile (of the CTA's)
  const int slice0 = (warp % kWarpsPerTile) * TILES;  // and its first K slice
  const int rows_per_pass = 8 * NT;
  const int passes = (prm.M + rows_per_pass - 1) / rows_per_pass;
  const int total = passes * prm.chunks;  // (pass, chunk) steps, streamed through one ring
  const unsigned char* w_tiles =
      prm.w + (static_cast<int64_t>(tile0 / lowbit::kGroupTiles) * prm.chunks * lowbit::kGroupTiles +
               tile0 % lowbit::kGroupTiles) * kBlock;
  const T* x = static_cast<const T*>(prm.x);
  float* red = reinterpret_cast<float*>(smem + S * kStage);

  auto load = [&](int step) {
    unsigned char* st = smem + (step % S) * kStage;
    const int pass = step / prm.chunks, c = step % prm.chunks;
    const unsigned char* wsrc = w_tiles + static_cast<int64_t>(c) * lowbit::kGroupTiles * kBlock;
    for (int i = tid; i < kTilesBlock / 16; i += kThreads) cp_async16(st + 16 * i, wsrc + 16 * i, true);
    const int m0 = pass * rows_per_pass, rows = min(rows_per_pass, prm.M - m0);
    const int k0 = c * kChunk * kPacketK;
    for (int i = tid; i < rows * (kChunkXBytes / 16); i += kThreads) {
      const int r = i / (kChunkXBytes / 16), v = i % (kChunkXBytes / 16), k = k0 + 8 * v;
      const bool in = k < prm.K;  // K % 8 == 0: a vector of 8 is all in or all out
      cp_async16(st + kTilesBlock + r * kXRowBytes + 16 * v,
                 x + static_cast<int64_t>(m0 + r) * prm.x_stride + (in ? k : 0), in);
    }
  };

#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < total) load(s);
    cp_async_commit();
  }
  float acc[TILES][NT][4];  // one per slice the warp holds
  typename P::State state;
  for (int step = 0; step < total; ++step) {
    cp_async_wait<S - 2>();
    __syncthreads();  // stage `step` landed for every thread's copies; stage step - 1 is free for all
    if (step + S - 1 < total) load(step + S - 1);
    cp_async_commit();

    const int pass = step / prm.chunks, c = step % prm.chunks;
    const int m0 = pass * rows_per_pass, rows = min(rows_per_pass, prm.M - m0);
    if (c == 0) {
#pragma unroll
      for (int si = 0; si < TILES; ++si)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[si][n][j] = 0.0f;
    }
    const unsigned char* st = smem + (step % S) * kStage;
    const unsigned char* xs = st + kTilesBlock;
    const unsigned char* blk = st + wt * kBlock;  // the warp's tile block
#pragma unroll
    for (int si = 0; si < TILES; ++si) {
      const int slice = slice0 + si;
      const unsigned char* srec = P::template slice_records<kSliceK>(blk + kChunk * P::kPacketBytes, slice);
      lowbit::static_for<kPacketsPerWarp>([&](auto j_c) {
        constexpr int j = decltype(j_c)::value;  // packet of the slice
        const int p = slice * kPacketsPerWarp + j;  // packet of the chunk
        uint4 xv[2][NT];
        lowbit::load_x_packet(xv, xs + p * kPacketK * 2 + t * 16, rows, g, [](int) { return true; });
        uint4 q[V];
#pragma unroll
        for (int v = 0; v < V; ++v) q[v] = lowbit::lds128(blk + p * P::kPacketBytes + v * 512 + lane * 16);
        P::template packet<j, kSliceK>(state, q, srec, xv, acc[si], lane);
      });
    }

    if (c == prm.chunks - 1) {  // the pass's sums: each tile's slices added in slice order
      // slices 0 .. TILES-1 of a tile are its first warp's; the others reach it through shared memory
      auto red_at = [&](int slot, int n, int j) { return red + ((slot * NT + n) * 4 + j) * 32 + lane; };
      auto slot_of = [&](int tile, int slice) { return tile * (kWarps - TILES) + slice - TILES; };
      if constexpr (kWarpsPerTile > 1) {
        if (slice0 > 0)
#pragma unroll
          for (int si = 0; si < TILES; ++si)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
              for (int j = 0; j < 4; ++j) *red_at(slot_of(wt, slice0 + si), n, j) = acc[si][n][j];
        __syncthreads();
      }
      if (slice0 == 0) {
        const int r_lo = (tile0 + wt) * kTileN + g, r_hi = r_lo + 8;
        const float f_lo = prm.row_scale && r_lo < prm.N ? prm.row_scale[r_lo] : 1.0f;
        const float f_hi = prm.row_scale && r_hi < prm.N ? prm.row_scale[r_hi] : 1.0f;
        T* out = static_cast<T*>(prm.out);
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            float v = acc[0][n][j];
#pragma unroll
            for (int si = 1; si < TILES; ++si) v += acc[si][n][j];
            for (int slice = TILES; slice < kWarps; ++slice) v += *red_at(slot_of(wt, slice), n, j);
            const int row = j < 2 ? r_lo : r_hi;
            const int tok = 8 * n + 2 * t + (j & 1);
            if (row < prm.N && tok < rows)
              out[static_cast<int64_t>(m0 + tok) * prm.out_stride + row] =
                  lowbit::from_float<T>(v * (j < 2 ? f_lo : f_hi));
          }
      }
      if constexpr (kWarpsPerTile > 1) __syncthreads();  // red is read before the next pass's slices write it
    }
  }
  cp_async_wait<0>();
}

template <class P, int TILES>
cudaError_t launch_tiles(const Params& prm, int64_t N, cudaStream_t stream) {
  constexpr auto kernel = gemm_kernel<P, TILES>;
  static const cudaError_t attr =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<P, TILES>());
  if (attr != cudaSuccess) return attr;
  kernel<<<static_cast<unsigned>(ceil_div(ceil_div(N, kTileN), TILES)), kThreads, smem_bytes<P, TILES>(), stream>>>(
      prm);
  return cudaGetLastError();
}

// The most tiles per CTA whose two stages fit (the ring needs two).
template <class P>
constexpr int max_tiles() {
  return stages<P, 4>() >= 2 ? 4 : stages<P, 2>() >= 2 ? 2 : 1;
}

// Tiles per CTA: `tiles` when given (1, 2 or 4; where two stages of it fit), else sm80_tiles_per_cta (the header):
// the most tiles that still leave 1.5 CTAs per SM (a CTA's x rows then serve more weight rows, and its chunks are
// longer copies), at every M.
// Measured through the compute_80 PTX on an H200 (132 SMs; benchmarks/bench_sm80.py --tiles-sweep, us, tiles 1 / 2 /
// 4): int4 4096x14336 (896 tiles) M = 1 21.4 / 22.9 / 19.1, M = 8 24.2 / 23.6 / 20.0, M = 32 82.1 / 50.1 / 43.3;
// 8192x28672 M = 8 75.8 / 62.1 / 60.4, M = 16 137.7 / 87.9 / 81.6; fp8 4096x14336 M = 1 31.6 / 29.4 / 27.6; on
// 14336x4096 (256 tiles) one tile wins but for int4 from 16 rows (M = 16 38.4 / 35.3 / 60.8; fp8 39.2 / 57.7 / -),
// and int4 8192x28672 at one row takes 2 (64.9 / 57.2 / 61.3). 8-bit weights at 16-token passes fit 2 tiles at
// most. Not measured on an sm_80-89 GPU.
template <class P>
cudaError_t launch(const Params& prm, int64_t N, int tiles, int sms, cudaStream_t stream) {
  constexpr bool kFits2 = max_tiles<P>() >= 2, kFits4 = max_tiles<P>() >= 4;
  if (tiles == 0) {
    if (sms <= 0) return cudaErrorInvalidValue;
    tiles = sm80_tiles_per_cta(N, max_tiles<P>(), sms);
  }
  if (tiles == 1) return launch_tiles<P, 1>(prm, N, stream);
  if constexpr (kFits2) {
    if (tiles == 2) return launch_tiles<P, 2>(prm, N, stream);
  }
  if constexpr (kFits4) {
    if (tiles == 4) return launch_tiles<P, 4>(prm, N, stream);
  }
  return cudaErrorInvalidValue;
}

// The checks and fields both ops share; false when the arguments cannot run.
bool make_params(const void* x, int64_t M, int64_t K, int64_t x_stride, const void* packed, const float* row_scale,
                 void* out, int64_t out_stride, int64_t N, Params& prm) {
  if (M < 0 || N < 0 || K <= 0 || K % 8 != 0 || N > INT32_MAX || K > INT32_MAX - kLowbitChunkK || M > INT32_MAX ||
      !is_aligned(packed, 16) || !is_aligned(x, 16) || x_stride % 8 != 0)
    return false;
  prm = {};
  prm.x = x; prm.x_stride = x_stride; prm.M = static_cast<int>(M); prm.K = static_cast<int>(K);
  prm.w = static_cast<const unsigned char*>(packed);
  prm.chunks = static_cast<int>(ceil_div(K, kLowbitChunkK));
  prm.row_scale = row_scale;
  prm.out = out; prm.out_stride = out_stride; prm.N = static_cast<int>(N);
  return true;
}

template <typename T, int GS, bool ASYM>
cudaError_t launch_int4(const Params& prm, int64_t N, int tiles, int sms, cudaStream_t stream) {
  return prm.M <= 8 ? launch<int4::Int4Policy<T, 1, GS, ASYM>>(prm, N, tiles, sms, stream)
                    : launch<int4::Int4Policy<T, 2, GS, ASYM>>(prm, N, tiles, sms, stream);
}

template <typename T>
cudaError_t launch_int4_dtype(const W4a16GemmSm80Args& a, const Params& prm, cudaStream_t stream) {
  return with_int4_group(a.group_size, a.asym, [&](auto gs, auto asym_c) {
    return launch_int4<T, decltype(gs)::value, decltype(asym_c)::value>(prm, a.N, a.tiles, a.sms, stream);
  });
}

}  // namespace

int mxfp8_gemm_sm80_max_tiles(int64_t M) {
  return M <= 8 ? max_tiles<mxfp8::Mxfp8Policy<1>>() : max_tiles<mxfp8::Mxfp8Policy<2>>();
}

cudaError_t launch_mxfp8_gemm_sm80(const Mxfp8GemmSm80Args& a, cudaStream_t stream) {
  if (a.M == 0 || a.N == 0) return cudaSuccess;
  Params prm;
  if (a.K % 32 != 0 || !make_params(a.x, a.M, a.K, a.x_stride, a.packed, a.row_scale, a.out, a.out_stride, a.N, prm))
    return cudaErrorInvalidValue;
  return a.M <= 8 ? launch<mxfp8::Mxfp8Policy<1>>(prm, a.N, a.tiles, a.sms, stream)
                  : launch<mxfp8::Mxfp8Policy<2>>(prm, a.N, a.tiles, a.sms, stream);
}

cudaError_t launch_w4a16_gemm_sm80(const W4a16GemmSm80Args& a, cudaStream_t stream) {
  if (a.M == 0 || a.N == 0) return cudaSuccess;
  Params prm;
  if (!make_params(a.x, a.M, a.K, a.x_stride, a.packed, nullptr, a.out, a.out_stride, a.N, prm))
    return cudaErrorInvalidValue;
  switch (a.dtype) {
    case InDtype::kBF16: return launch_int4_dtype<__nv_bfloat16>(a, prm, stream);
    case InDtype::kF16: return launch_int4_dtype<__half>(a, prm, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_mxfp8_dequant_packed_sm80(const void* packed, int64_t N, int64_t K, void* out, cudaStream_t stream,
                                             const float* row_scale) {
  if (N == 0 || K == 0) return cudaSuccess;
  if (N < 0 || K < 0 || K % 32 != 0 || N > INT32_MAX || K > INT32_MAX - kLowbitChunkK || !is_aligned(packed, 16) ||
      ceil_div(N, kLowbitGroupRows) * ceil_div(K, kLowbitChunkK) > INT32_MAX)
    return cudaErrorInvalidValue;
  const int chunks = static_cast<int>(ceil_div(K, kLowbitChunkK));
  const int64_t blocks = ceil_div(N, kLowbitGroupRows) * chunks;
  const auto* w = static_cast<const unsigned char*>(packed);
  auto* o = static_cast<__nv_bfloat16*>(out);
  if (row_scale)
    mxfp8::dequant_packed_scaled_kernel<<<static_cast<unsigned>(blocks), mxfp8::kDequantThreads, 0, stream>>>(
        w, chunks, static_cast<int>(N), static_cast<int>(K), o, row_scale);
  else
    mxfp8::dequant_packed_kernel<<<static_cast<unsigned>(blocks), mxfp8::kDequantThreads, 0, stream>>>(
        w, chunks, static_cast<int>(N), static_cast<int>(K), o);
  return cudaGetLastError();
}

}  // namespace sm80
}  // namespace cublade
