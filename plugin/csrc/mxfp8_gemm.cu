// MXFP8 weight GEMM (W8A16) on Hopper: 1-byte storage, bf16 math, no MX tensor cores needed.
//   y[M, N] = x[M, K] (bf16) @ W[N, K]^T, W = e4m3 code * 2^(e - 127), one E8M0 exponent e per 32 K of a row.
// Numerics: an e4m3 value (a multiple of 2^-9 with 4 significant bits) times 2^(e - 127) is exact in bf16 for
// 3 <= e <= 134 (the repack refuses larger exponents, which only blocks with weights beyond 2^15 need; below 3 the
// product rounds once, as the dequantize path rounds it), so the tensor cores get exactly the weights that the
// dequantize path (mxfp8_dequant to bf16, then a dense GEMM) gives cuBLAS, sum them in fp32 over all of K, and round
// once to bf16.
// Dequant in registers, no conversion instruction: a code's 7 magnitude bits (eeee mmm) go to bits 4-10 of a bf16
// (the exponent field's low 4 bits and the top 3 mantissa bits) and its sign to bit 15, which makes the bf16
// code * 2^-120 (e4m3's bias is 7, bf16's 127; the e = 0 codes become bf16 subnormals, which bf16 arithmetic keeps);
// one HMUL2 by 2^(e - 7) per pair of weights gives the weight. Seven integer instructions (three shifts, two ANDs, two
// LOP3) per four weights.
// Kernels: the streaming kernel (w4a16_gemm.cuh) for 1-16 rows, the wide (wgmma) kernel (wide_gemm.cuh) for more,
// and a dequantize kernel for the prefill path (the torch wrapper then calls cuBLAS); all three read one blob.
//
// The blob (plugin/ops/mxfp8_gemm.py writes it: mxfp8_repack): the int4 blob's geometry (w4a16_gemm.cuh) with
// 1024-byte packets.
//   packed  int32 [ceil(N/64), ceil(K/512), 4 tiles, 2048 + 64]: per tile block 8 packets x 2 halves x 32 lanes x 4
//           words, then 8 x 32 bytes of exponent records. In half h of packet p, lane (g, t) holds k-steps s = 2h and
//           2h + 1 (K0(s) = 64p + 32h + 8t + 4(s % 2), as in w4a16_gemm.cuh) as words (row g, s = 2h), (g + 8, 2h),
//           (g, 2h + 1), (g + 8, 2h + 1), each the row's codes at K0 + 0, 2, 1, 3 in bytes 0..3 (so bytes 0, 2 are
//           the fragment register of K0, K0 + 1 and bytes 1, 3 that of K0 + 2, K0 + 3).
//   records per packet and g (4 bytes): e of (row g, half 0), (g + 8, 0), (g, 1), (g + 8, 1).
#define CUBLADE_KERNELS_ONLY  // framework-free (no torch header); the torch wrapper is mxfp8_gemm_torch.cpp
#include "w4a16_gemm.cuh"
#include "wide_gemm.cuh"
#include "w4a16_gemm.h"

#include <algorithm>

namespace cublade {
namespace {

using lowbit::kPacketK;
using lowbit::kTileN;

constexpr int kCodePacketBytes = 1024;  // 16 rows x 64 K of 1-byte codes
constexpr int kBlockBytes = lowbit::kChunk * kCodePacketBytes + kMxfp8RecordBytes;  // a tile block: 8448 bytes
static_assert(kBlockBytes == 4 * (2 * kLowbitTileWords + kMxfp8RecordBytes / 4), "w4a16_gemm.h's geometry");

__device__ __forceinline__ uint32_t hmul2_bf16(uint32_t a, uint32_t b) {
  const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                   *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// One word of a row's codes (K0, K0 + 2, K0 + 1, K0 + 3 in bytes 0..3) -> bf16 pairs (K0, K0 + 1) and (K0 + 2, K0 + 3),
// each code * 2^-120: magnitudes to bits 4-10 / 20-26, signs to 15 / 31.
__device__ __forceinline__ void e4m3_pairs(uint32_t w, uint32_t& lo, uint32_t& hi) {
  lo = lowbit::and_or(w << 4, 0x07F007F0u, (w << 8) & 0x80008000u);  // bytes 0, 2
  hi = lowbit::and_or(w >> 4, 0x07F007F0u, w & 0x80008000u);         // bytes 1, 3
}

// A packet's record word (e of rows g, g + 8 in half 0, then half 1) -> the bf16 pairs (f, f) of rows g and g + 8 for
// half h, f = 2^(e - 7): the codes' 2^-120 times the block scale 2^(e - 127). bf16 bits of f: (e + 120) << 7.
__device__ __forceinline__ void factors(uint32_t r, int h, uint32_t& f_lo, uint32_t& f_hi) {
  const uint32_t v = (lowbit::prmt(r, 0u, h == 0 ? 0x4140u : 0x4342u) + 0x00780078u) << 7;  // (f[g], f[g + 8])
  f_lo = lowbit::prmt(v, v, 0x1010u);
  f_hi = lowbit::prmt(v, v, 0x3232u);
}

// k-step's A fragment from the words of rows g and g + 8: registers (g, K0..), (g + 8, K0..), (g, K0 + 2..),
// (g + 8, K0 + 2..), times the block factors.
__device__ __forceinline__ void dequant_step(uint32_t wg, uint32_t wg8, uint32_t f_g, uint32_t f_g8, uint32_t (&a)[4]) {
  uint32_t lo, hi;
  e4m3_pairs(wg, lo, hi);
  a[0] = hmul2_bf16(lo, f_g);
  a[2] = hmul2_bf16(hi, f_g);
  e4m3_pairs(wg8, lo, hi);
  a[1] = hmul2_bf16(lo, f_g8);
  a[3] = hmul2_bf16(hi, f_g8);
}

// Packet j's 4 k-steps -> A fragments (the exact weights). v0, v1: this lane's two vectors of the packet (halves 0,
// 1); srec: the records of the packets' K slice or stage.
__device__ __forceinline__ void dequant_packet(const uint4 v0, const uint4 v1, const unsigned char* srec, int j,
                                               int lane, uint32_t (&a)[4][4]) {
  const uint32_t r = *reinterpret_cast<const uint32_t*>(srec + (j * 8 + (lane >> 2)) * 4);
  uint32_t f0_lo, f0_hi, f1_lo, f1_hi;
  factors(r, 0, f0_lo, f0_hi);
  factors(r, 1, f1_lo, f1_hi);
  dequant_step(v0.x, v0.y, f0_lo, f0_hi, a[0]);
  dequant_step(v0.z, v0.w, f0_lo, f0_hi, a[1]);
  dequant_step(v1.x, v1.y, f1_lo, f1_hi, a[2]);
  dequant_step(v1.z, v1.w, f1_lo, f1_hi, a[3]);
}

// MXFP8 packets for the streaming kernel: the weights are exact in bf16, the mma's sum all of K in fp32.
template <int NT_>
struct Mxfp8Policy {
  using T = __nv_bfloat16;
  static constexpr int NT = NT_;
  static constexpr int kPacketBytes = kCodePacketBytes;
  static constexpr int kSBytes = kMxfp8RecordBytes;  // 32 bytes of records per packet per tile
  struct State {};
  template <int kSliceK>
  __device__ static const unsigned char* slice_records(const unsigned char* srec, int slice) {
    return srec + slice * (kSliceK / kPacketK) * 32;
  }
  __device__ static const float* row_scale(const lowbit::GemmParams&, int) { return nullptr; }
  template <int j, int kSliceK>
  __device__ static void packet(State&, const uint4 (&q)[2], const unsigned char* srec, const uint4 (&xc)[2][NT],
                                float (&acc)[NT][4], int lane) {
    uint32_t a[4][4];
    dequant_packet(q[0], q[1], srec, j, lane, a);
    lowbit::mma_packet<T>(acc, a, xc);
  }
};

// MXFP8 batches for the wide kernel: the same dequant, the mma's sum all of K into acc.
struct Mxfp8Batch {
  using T = __nv_bfloat16;
  static constexpr int kPacketBytes = kCodePacketBytes;
  static constexpr int kBlobRecBytes = kMxfp8RecordBytes;
  static constexpr wide::Scaling kScaling = wide::Scaling::kNone;
  static constexpr bool kRowScale = false;
  __device__ static void batch(const unsigned char* packets, const unsigned char* recs, int b, int lane,
                               uint32_t (&a)[8][4], float&, float&) {
#pragma unroll
    for (int pk = 0; pk < 2; ++pk) {
      const int j = 2 * b + pk;  // packet of the stage
      const unsigned char* q = packets + j * kPacketBytes + lane * 16;
      dequant_packet(lowbit::lds128(q), lowbit::lds128(q + 512), recs, j, lane,
                     *reinterpret_cast<uint32_t(*)[4][4]>(a[4 * pk]));
    }
  }
};

// The wide kernel's configurations: half-chunk stages everywhere (a whole chunk of 1-byte codes is 33 KB a tile group),
// two warpgroups. Four (which int4 takes at 32 tokens where their CTAs fill 3/4 of the SMs) lose: on 8192x28672
// (benchmarks/tuning/mxfp8_sweep.cu) two warpgroups with stream-K run 78.4 / 85.8 us at 32 / 64 tokens against four's
// 81.7 / 92.6 with stream-K, 83.3 / 92.5 with split-K (the other shapes' CTAs of four do not fill 3/4 of the SMs).
template <typename Run>
cudaError_t with_config(int ntok, Run&& run) {
  switch (ntok) {
    case 128: return run(wide::PassConfig<128, 2, 256>{});
    case 96: return run(wide::PassConfig<96, 2, 256>{});
    case 64: return run(wide::PassConfig<64, 2, 256>{});
    case 48: return run(wide::PassConfig<48, 2, 256>{});
    case 32: return run(wide::PassConfig<32, 2, 256>{});
    default: return cudaErrorInvalidValue;
  }
}

// One wide pass over `rows` <= 128 rows of x.
cudaError_t launch_wide_pass(const void* x, int64_t x_stride, int rows, int K, const unsigned char* w, void* out,
                             int64_t out_stride, int N, void* workspace, int sms, cudaStream_t stream) {
  wide::Params prm = {};  // launch_kernel refuses rows > NTOK (one pass, no token windows)
  prm.w = w;
  prm.M = rows; prm.N = N;
  prm.out = out; prm.out_stride = out_stride;
  return with_config(wide::ntok(rows), [&](auto cfg) {
    using C = decltype(cfg);
    return wide::launch_kernel<Mxfp8Batch, C::kTokens, C::kWarpgroups, C::kStageK, false>(
        prm, x, x_stride, K, 0, 0, true, workspace, sms, stream);
  });
}

// Rows of the next wide pass when `left` rows remain (0: the streaming kernel takes them).
constexpr int64_t wide_pass_rows(int64_t left) {
  return left >= kMxfp8WideMinRows ? std::min<int64_t>(left, wide::kMaxPassRows) : 0;
}

// ---- dequantize (the prefill path) ----
// One CTA per (tile group, chunk), one warp per tile block (its ~8.4 KB of the blob contiguous), no shared memory:
// each lane loads its 16 vectors and 8 record words before any use, then writes rows g and g + 8 of its 8-K runs as
// 16-byte bf16 vectors (the 4 lanes of a row cover 64 contiguous bytes per store). The same dequant_step as the GEMMs,
// so the prefill weights are the decode weights bit for bit.
constexpr int kDequantThreads = 32 * lowbit::kGroupTiles;

__global__ void __launch_bounds__(kDequantThreads)
mxfp8_dequant_packed_kernel(const unsigned char* __restrict__ packed, int chunks, int N, int K,
                            __nv_bfloat16* __restrict__ out) {
  const int tile = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t row = static_cast<int64_t>(blockIdx.x / chunks) * kLowbitGroupRows + tile * kTileN + g;  // and +8
  if (row - g >= N) return;  // a padding tile (warp-uniform)
  const int64_t k_chunk = static_cast<int64_t>(blockIdx.x % chunks) * kLowbitChunkK;
  const unsigned char* blk = packed + (static_cast<int64_t>(blockIdx.x) * lowbit::kGroupTiles + tile) * kBlockBytes;

  uint4 q[lowbit::kChunk][2];
#pragma unroll
  for (int p = 0; p < lowbit::kChunk; ++p)
#pragma unroll
    for (int h = 0; h < 2; ++h) q[p][h] = ld_nc_v4(blk + p * kCodePacketBytes + h * 512 + lane * 16);
  uint32_t rec[lowbit::kChunk];
#pragma unroll
  for (int p = 0; p < lowbit::kChunk; ++p)
    rec[p] = __ldg(reinterpret_cast<const uint32_t*>(blk + lowbit::kChunk * kCodePacketBytes) + p * 8 + g);

  const bool lo_ok = row < N, hi_ok = row + 8 < N;
  __nv_bfloat16* out_lo = out + row * K + k_chunk + 8 * t;
  __nv_bfloat16* out_hi = out_lo + static_cast<int64_t>(8) * K;
#pragma unroll
  for (int p = 0; p < lowbit::kChunk; ++p) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k = kPacketK * p + 32 * h;  // chunk-relative K of this half; the lane's 8 start at k + 8t
      if (k_chunk + k + 8 * t >= K) continue;  // K % 32 == 0: the lane's 8 are all in or all out
      uint32_t f_lo, f_hi;
      factors(rec[p], h, f_lo, f_hi);
      uint32_t s0[4], s1[4];  // k-steps 2h, 2h + 1: K0 .. K0 + 3 and K0 + 4 .. K0 + 7 of rows g, g + 8
      dequant_step(q[p][h].x, q[p][h].y, f_lo, f_hi, s0);
      dequant_step(q[p][h].z, q[p][h].w, f_lo, f_hi, s1);
      if (lo_ok) __stwb(reinterpret_cast<uint4*>(out_lo + k), make_uint4(s0[0], s0[2], s1[0], s1[2]));
      if (hi_ok) __stwb(reinterpret_cast<uint4*>(out_hi + k), make_uint4(s0[1], s0[3], s1[1], s1[3]));
    }
  }
}

}  // namespace

size_t mxfp8_gemm_workspace_bytes(int64_t M, int64_t K, int split_k, int sms) {
  if (split_k != 0 || wide_pass_rows(M) == 0) return 0;
  const int64_t m = std::min<int64_t>(M, wide::kMaxPassRows);  // one pass at a time
  return static_cast<size_t>(wide::workspace_bytes(m, K, wide::ntok(m), false, sms));
}

cudaError_t launch_mxfp8_gemm(const Mxfp8GemmArgs& a, cudaStream_t stream) {
  const int64_t K = a.K, N = a.N, x_stride = a.x_stride, out_stride = a.out_stride;
  const int split_k = a.split_k, sms = a.sms;
  void* workspace = a.workspace;
  const void* x = a.x;  // x, out and M move past the wide kernel's passes
  void* out = a.out;
  int64_t M = a.M;
  if (M == 0 || N == 0) return cudaSuccess;
  if (K % 32 != 0) return cudaErrorInvalidValue;
  const auto* w = static_cast<const unsigned char*>(a.packed);
  if (mxfp8_gemm_workspace_bytes(M, K, split_k, sms) > 0) {
    if (workspace == nullptr) return cudaErrorInvalidValue;
    while (const int64_t rows = wide_pass_rows(M)) {  // passes of up to 128 rows; fewer than 17 left: streaming
      const cudaError_t e = launch_wide_pass(x, x_stride, static_cast<int>(rows), static_cast<int>(K), w, out,
                                             out_stride, static_cast<int>(N), workspace, sms, stream);
      if (e != cudaSuccess) return e;
      x = static_cast<const __nv_bfloat16*>(x) + rows * x_stride;
      out = static_cast<__nv_bfloat16*>(out) + rows * out_stride;
      M -= rows;
    }
    if (M == 0) return cudaSuccess;
  }
  lowbit::GemmParams prm = {};
  prm.x = x; prm.x_stride = x_stride; prm.M = static_cast<int>(M); prm.K = static_cast<int>(K);
  prm.w = w;
  prm.tiles = static_cast<int>(ceil_div(N, kTileN));
  prm.groups = static_cast<int>(ceil_div(N, kLowbitGroupRows));
  prm.chunks = static_cast<int>(ceil_div(K, kLowbitChunkK));
  prm.out = out; prm.out_stride = out_stride; prm.N = static_cast<int>(N);
  prm.sms = sms;
  prm.sbytes = kMxfp8RecordBytes;
  const int S = split_k > 0 ? split_k : lowbit::pick_split(prm.groups, prm.chunks, sms);
  const int nt = lowbit::token_tiles(prm.M);
  prm.xrows = std::min(8 * nt, prm.M);
  if (nt == 1) {
    // Two K slices per chunk (8 consumer warps) and a ring of 3 stages where that still fits 2 CTAs per SM (up to 2
    // rows) and leaves no short second wave (more CTAs than the GPU holds at once, at most 1.5 times as many). As a
    // decode step runs them (benchmarks/tuning/w4a16_layers.cu built with -DCUBLADE_LAYERS_MXFP8: weights of 32
    // layers replayed from one CUDA graph; us per GEMM at M = 1, 1 slice (pick_stages) / this):
    // Llama-3-8B qkv 12.80 / 10.60, o 12.18 / 10.18, gate_up 36.58 / 34.87, down 21.85 / 18.71; Llama-70B-like
    // 8192x57344 128.87 / 117.15, 28672x8192 61.57 / 61.09, 8192x8192 21.43 / 21.67; 8192x10240 (320 CTAs, 1.2
    // waves at 2 per SM) 27.78 / 32.59 keeps one slice.
    using P = Mxfp8Policy<1>;
    const lowbit::LayoutOf<P::kPacketBytes> L{prm.sbytes, prm.xrows, 3};
    const int per_sm = lowbit::ctas_per_sm<P, 1, 2>(L.total(1, 2));
    const int64_t slots = static_cast<int64_t>(per_sm) * sms, ctas = static_cast<int64_t>(prm.groups) * S;
    if (per_sm >= 2 && (ctas <= slots || 2 * ctas > 3 * slots)) {
      prm.stages = 3;
      return lowbit::launch_stream<P, 1, 2>(prm, 1, S, stream);
    }
    return lowbit::launch_tpw<P>(prm, 1, S, stream);
  }
  if (nt == 2) return lowbit::launch_tpw<Mxfp8Policy<2>>(prm, 1, S, stream);
  return lowbit::launch_tpw<Mxfp8Policy<4>>(prm, 1, S, stream);
}

cudaError_t launch_mxfp8_dequant_packed(const Mxfp8DequantPackedArgs& a, cudaStream_t stream) {
  const int64_t N = a.N, K = a.K;
  if (N == 0 || K == 0) return cudaSuccess;
  if (N < 0 || K < 0 || K % 32 != 0 || N > INT32_MAX || K > INT32_MAX - kLowbitChunkK || !is_aligned(a.packed, 16) ||
      ceil_div(N, kLowbitGroupRows) * ceil_div(K, kLowbitChunkK) > INT32_MAX)
    return cudaErrorInvalidValue;
  const int chunks = static_cast<int>(ceil_div(K, kLowbitChunkK));
  const int64_t blocks = ceil_div(N, kLowbitGroupRows) * chunks;
  mxfp8_dequant_packed_kernel<<<static_cast<unsigned>(blocks), kDequantThreads, 0, stream>>>(
      static_cast<const unsigned char*>(a.packed), chunks, static_cast<int>(N), static_cast<int>(K),
      static_cast<__nv_bfloat16*>(a.out));
  return cudaGetLastError();
}

}  // namespace cublade
