// W4A16 GEMM for decode: y[M, N] = x[M, K] (bf16/fp16) @ dequant(W)[N, K]^T, W int4 with one bf16 scale
// (and, asymmetric, one zero point) per group of 32/64/128 K or per output channel. Numerics: the
// reference's w = (u - z) * s in fp32, summed in fp32 (cublade.ops.w4a16_gemm.w4a16_gemm_ref).
//
// Layout and the reasons: docs/kernels.md, "w4a16_gemm"; the repacked tensors: w4a16_gemm.cuh and
// plugin/ops/w4a16_gemm.py (w4a16_repack).
//   packed  int32 [ceil(N/64), ceil(K/512), 4 tiles, 1024 + sbytes/4]: per tile block, 8 packets x 32 lanes x 4
//           words, then the chunk's scale records. Nibble u of lane (g, t), k-step s, in word s at bits 4j:
//           j=0 (row g, K0), 4 (g, K0+1), 1 (g+8, K0), 5 (g+8, K0+1), 2 (g, K0+2), 6 (g, K0+3), 3 (g+8, K0+2),
//           7 (g+8, K0+3), so that one mask+OR per pair gives the fragment register order.
//           Scale records: [512/G groups][8 g] x (s[row g], s[row g+8]) bf16, asymmetric (s[g], s[g+8], z[g],
//           z[g+8]) (z exact in bf16); per channel: one group, repeated in every chunk.
#define CUBLADE_KERNELS_ONLY  // framework-free (no torch header); the torch wrapper is w4a16_gemm_torch.cpp
#include "w4a16_gemm.cuh"
#include "int4_codes.cuh"
#include "gemm_plan.cuh"
#include "w4a16_gemm.h"
#include "w4a16_gemm_wide.cuh"

static_assert(cublade::kLowbitGroupRows == cublade::lowbit::kGroupTiles * cublade::lowbit::kTileN &&
                  cublade::kLowbitChunkK == cublade::lowbit::kChunk * cublade::lowbit::kPacketK &&
                  cublade::kLowbitTileWords == cublade::lowbit::kChunk * 128 &&
                  cublade::kLowbitMaxSplit == cublade::lowbit::kMaxSplit,
              "w4a16_gemm.h and w4a16_gemm.cuh disagree on the blob geometry");

#include <algorithm>
#include <type_traits>

namespace cublade {
namespace {

using int4::Int4Policy;
using int4::bias_pair;
using int4::dequant_int4;
using int4::unpack_rec;
using lowbit::kPacketK;
using lowbit::kTileN;

}  // namespace

// The wide kernel (from 17 tokens; 9 on large weights): w4a16_gemm_wide.cuh, its instantiations compiled in
// w4a16_gemm_wide_bf16.cu and w4a16_gemm_wide_f16.cu (CUBLADE_W4A16_ONE_TU: here).
#ifndef CUBLADE_W4A16_ONE_TU
namespace wide {
extern template cudaError_t launch_pass<__nv_bfloat16>(int, bool, const void*, int64_t, int, int, const unsigned char*,
                                                       void*, int64_t, int, void*, int, cudaStream_t);
extern template cudaError_t launch_pass<__half>(int, bool, const void*, int64_t, int, int, const unsigned char*, void*,
                                                int64_t, int, void*, int, cudaStream_t);
}  // namespace wide
#endif

namespace {

template <int GS, bool ASYM>
constexpr int int4_sbytes() { return Int4Policy<__nv_bfloat16, 1, GS, ASYM>::kSBytes; }

// Tokens per pass from M: 8 / 16 / 32 (lowbit::token_tiles); larger M makes several passes, each re-reading the
// weights (from L2 when they are still there). From 128 rows the torch op dequantizes and calls cuBLAS instead
// (w4a16_gemm_torch.cpp).
template <typename T, int GS, bool ASYM>
cudaError_t launch_nt(lowbit::GemmParams prm, int S, cudaStream_t stream) {
  const int nt = lowbit::token_tiles(prm.M);
  prm.xrows = std::min(8 * nt, prm.M);
  prm.sbytes = int4_sbytes<GS, ASYM>();
  if (nt == 1) {
    using P = Int4Policy<T, 1, GS, ASYM>;
    if constexpr (GS > 0)  // small grids (w4a16_small_grid)
      if (prm.tpw <= 1 && prm.ksl == 2) return lowbit::launch_stream<P, 1, 2>(prm, 1, S, stream);
    return lowbit::launch_tpw<P>(prm, 1, S, stream);
  }
  if (nt == 2) return lowbit::launch_tpw<Int4Policy<T, 2, GS, ASYM>>(prm, 1, S, stream);
  return lowbit::launch_tpw<Int4Policy<T, 4, GS, ASYM>>(prm, 1, S, stream);
}

template <typename T>
cudaError_t launch_dtype(const lowbit::GemmParams& prm, int group_size, bool asym, int S, cudaStream_t stream) {
  return with_int4_group(group_size, asym, [&](auto gs, auto asym_c) {
    return launch_nt<T, decltype(gs)::value, decltype(asym_c)::value>(prm, S, stream);
  });
}

}  // namespace

static_assert(w4a16_gemm_sbytes(32, false) == int4_sbytes<32, false>() &&
                  w4a16_gemm_sbytes(32, true) == int4_sbytes<32, true>() &&
                  w4a16_gemm_sbytes(64, false) == int4_sbytes<64, false>() &&
                  w4a16_gemm_sbytes(64, true) == int4_sbytes<64, true>() &&
                  w4a16_gemm_sbytes(128, false) == int4_sbytes<128, false>() &&
                  w4a16_gemm_sbytes(128, true) == int4_sbytes<128, true>() &&
                  w4a16_gemm_sbytes(-1, false) == int4_sbytes<0, false>() &&
                  w4a16_gemm_sbytes(-1, true) == int4_sbytes<0, true>(),
              "w4a16_gemm.h's w4a16_gemm_sbytes disagrees with Int4Policy's records");

// Workspace bytes launch_w4a16_gemm needs (0: none): the wide kernel's prepped x for its largest pass (the first),
// and stream-K's flags and slots.
size_t w4a16_gemm_workspace_bytes(int64_t M, int64_t K, int64_t N, int group_size, int split_k, int sms,
                                  bool rounded) {
  rounded = rounded && group_size == 128;
  const int64_t m = wide::pass_rows(M, N, K, rounded);  // one pass at a time, the first the largest
  if (split_k != 0 || m == 0 || !w4a16_gemm_wide_takes(group_size)) return 0;
  return static_cast<size_t>(wide::workspace_bytes(m, K, wide::plan_pass(m, K, N, sms).tokens, false, sms));
}

// Small grids: when the streaming kernel's grid (tile groups x splits) has at most 2 CTAs per SM, up to 16 rows, a ring
// of 3 stages instead of pick_stages' 2, and up to 8 rows two K slices per chunk (8 consumer warps instead of 4). At
// most 2 CTAs share an SM there, so the deeper ring costs no CTAs, and the consumers, not the copies, set the pace.
// Measured as a decode step runs the GEMMs (benchmarks/tuning/w4a16_layers.cu: 32 layers' weights replayed from one
// CUDA graph, each GEMM after a kernel that writes its x; us per GEMM, 2 stages and 1 slice / this): M = 1 Llama-3-8B o
// (4096x4096) 6.91 / 6.31, down (14336x4096) 16.15 / 13.25, qkv (4096x6144) 8.26 / 8.15; Llama-70B-like 28672x8192
// 37.04 / 35.62, 8192x8192 13.23 / 13.14. M = 16 (3 stages): down 19.81 / 19.40, o 8.49 / 8.36, qkv and 8192x8192
// within 0.2% (weights of 2^27 elements or more take the wide kernel there). Larger grids lost with them (8192x10240,
// 2.4 CTAs per SM at M = 1: 16.60 / 17.67; gate_up 4096x28672, 3.4: 20.97 / 23.48): pick_stages' choice. Per-channel
// scales keep one slice (their two-slice kernels spilled 4-8 bytes; not measured).
inline void w4a16_small_grid(lowbit::GemmParams& prm, int S, int group_size) {
  if (prm.M > 16 || static_cast<int64_t>(prm.groups) * S > 2 * static_cast<int64_t>(prm.sms)) return;
  prm.stages = 3;
  if (lowbit::token_tiles(prm.M) == 1 && group_size > 0) prm.ksl = 2;
}

// x: [M, K] (row stride x_stride elements, unit column stride, 16-byte aligned rows, K % 8 == 0); packed: the
// repacked blob above; out: [M, N] with row stride out_stride. split_k: K splits per cluster (0 = pick; >= 1
// forces the streaming kernel). workspace: w4a16_gemm_workspace_bytes(...) bytes, 16-byte aligned, or null when
// that is 0. sms: the multiprocessor count.
cudaError_t launch_w4a16_gemm(const W4a16GemmArgs& a, cudaStream_t stream) {
  const InDtype dtype = a.dtype;
  const int64_t K = a.K, N = a.N, x_stride = a.x_stride, out_stride = a.out_stride;
  const void* packed = a.packed;
  const int group_size = a.group_size, split_k = a.split_k, sms = a.sms;
  const bool asym = a.asym;
  void* workspace = a.workspace;
  const void* x = a.x;  // x, out and M move past the wide kernel's passes
  void* out = a.out;
  int64_t M = a.M;
  if (M == 0 || N == 0) return cudaSuccess;
  if (dtype != InDtype::kBF16 && dtype != InDtype::kF16) return cudaErrorInvalidValue;
  const int esize = 2;
  const bool rounded = a.rounded && dtype == InDtype::kBF16 && group_size == 128;
  if (w4a16_gemm_workspace_bytes(M, K, N, group_size, split_k, sms, rounded) > 0) {
    // The wide kernel, up to 128 rows per pass (256 in rounded passes); a last pass of at most 16 rows goes to the
    // streaming kernel unless wide::pass_rows gives it to the wide kernel too.
    if (workspace == nullptr) return cudaErrorInvalidValue;
    int64_t m0 = 0;  // rows done
    while (const int64_t pass = wide::pass_rows(M - m0, N, K, rounded)) {
      const int rows = static_cast<int>(pass);
      const auto* xr = static_cast<const unsigned char*>(x) + m0 * x_stride * esize;
      auto* outr = static_cast<unsigned char*>(out) + m0 * out_stride * esize;
      const auto* w = static_cast<const unsigned char*>(packed);
      const int k = static_cast<int>(K), n = static_cast<int>(N);
      const cudaError_t e =
          dtype == InDtype::kBF16
              ? wide::launch_pass<__nv_bfloat16>(group_size, asym, xr, x_stride, rows, k, w, outr, out_stride, n,
                                                 workspace, sms, stream)
              : wide::launch_pass<__half>(group_size, asym, xr, x_stride, rows, k, w, outr, out_stride, n, workspace,
                                          sms, stream);
      if (e != cudaSuccess) return e;
      m0 += rows;
    }
    if (m0 == M) return cudaSuccess;
    x = static_cast<const unsigned char*>(x) + m0 * x_stride * esize;
    out = static_cast<unsigned char*>(out) + m0 * out_stride * esize;
    M -= m0;
  }
  lowbit::GemmParams prm = {};
  prm.x = x; prm.x_stride = x_stride; prm.M = static_cast<int>(M); prm.K = static_cast<int>(K);
  prm.w = static_cast<const unsigned char*>(packed);
  prm.tiles = static_cast<int>(ceil_div(N, kTileN));
  prm.groups = static_cast<int>(ceil_div(N, kTileN * lowbit::kGroupTiles));
  prm.chunks = static_cast<int>(ceil_div(K, lowbit::kChunk * kPacketK));
  prm.out = out; prm.out_stride = out_stride; prm.N = static_cast<int>(N);
  prm.sms = sms;
  const int S = split_k > 0 ? split_k : w4a16_stream_split(prm.groups, prm.chunks, M, sms);
  w4a16_small_grid(prm, S, group_size);
  return dtype == InDtype::kBF16 ? launch_dtype<__nv_bfloat16>(prm, group_size, asym, S, stream)
                                 : launch_dtype<__half>(prm, group_size, asym, S, stream);
}

}  // namespace cublade
