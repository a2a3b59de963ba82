// Framework-free declarations of the launchers of w4a16_gemm.cu, w4a16_dequant.cu, fp4_gemm.cu and mxfp8_gemm.cu,
// shared by the kernels (nvcc) and their torch wrappers (w4a16_gemm_torch.cpp, fp4_gemm_torch.cpp,
// mxfp8_gemm_torch.cpp; host C++ compiler). The repacked layouts: plugin/ops/w4a16_gemm.py, fp4_gemm.py and
// mxfp8_gemm.py; the kernels and their schedules: w4a16_gemm.cuh and wide_gemm.cuh.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>
#include <type_traits>

#include "launchers.h"  // InDtype

namespace cublade {

// Geometry of the repacked blobs: tile groups of 64 rows (4 tiles of 16), chunks of 512 K (8 packets of 64);
// a tile block is 1024 int32 words of weights plus the chunk's scale records.
constexpr int kLowbitGroupRows = 64;
constexpr int kLowbitChunkK = 512;
constexpr int kLowbitTileWords = 1024;
constexpr int kLowbitMaxSplit = 8;  // K splits per thread-block cluster

// Scale-record bytes per int4 tile block for a group size (32, 64, 128, -1: per channel) and symmetry; -1 for others
// (the repacked layout's last dim is 1024 + this / 4 int32 words). Per group of the chunk's 512 K (one per channel),
// 8 records of bf16 (s[g], s[g+8]), asymmetric (s[g], s[g+8], z[g], z[g+8]); w4a16_gemm.cu checks it against the
// kernels' Int4Policy.
constexpr int w4a16_gemm_sbytes(int group_size, bool asym) {
  return group_size == 32 || group_size == 64 || group_size == 128 || group_size == -1
             ? kLowbitChunkK / (group_size == -1 ? kLowbitChunkK : group_size) * 8 * (asym ? 8 : 4)
             : -1;
}

// f(std::integral_constant<int, GS>{}, std::integral_constant<bool, ASYM>{}) for a group size (32, 64, 128, or -1 per
// channel as GS 0) and symmetry: the one switch from an int4 op's arguments to its kernels' template arguments
// (w4a16_gemm.cu, w4a16_dequant.cu, sm80/lowbit_gemm_sm80.cu). Other group sizes: cudaErrorInvalidValue.
template <class F>
cudaError_t with_int4_group(int group_size, bool asym, F&& f) {
  auto by_symmetry = [&](auto gs) { return asym ? f(gs, std::true_type{}) : f(gs, std::false_type{}); };
  switch (group_size) {
    case 32: return by_symmetry(std::integral_constant<int, 32>{});
    case 64: return by_symmetry(std::integral_constant<int, 64>{});
    case 128: return by_symmetry(std::integral_constant<int, 128>{});
    case -1: return by_symmetry(std::integral_constant<int, 0>{});
    default: return cudaErrorInvalidValue;
  }
}

// Group sizes the wide (wgmma) kernel takes: 128 and -1 (per channel).
constexpr bool w4a16_gemm_wide_takes(int64_t group_size) { return group_size == 128 || group_size == -1; }

// Weights of this many elements or more (8192 x 16384) are "large" to the ops' rules below and in w4a16_gemm.cu.
constexpr int64_t kLargeWeightElements = int64_t(1) << 27;

// The rounded passes' prefill switch by the weight's elements: under 2^25 (Llama-3-8B's qkv and o), under 2^26
// (its down, 4096x14336), more.
constexpr int64_t kSmallWeightElements = int64_t(1) << 25;
constexpr int64_t kMidWeightElements = int64_t(1) << 26;

// Rows from which the torch ops run their prefill path (the weight dequantized to x's dtype, then one cuBLAS GEMM)
// instead of their kernels, which take any rows. The prefill path pays for the dequant once; the kernels' passes each
// re-read the weight. rounded: the call may take the rounded passes (bf16 x at group size 128, W4a16GemmArgs::rounded),
// passes of up to 256 rows, which round the weights to bf16 as the prefill path does; otherwise passes of 128 with the
// weights exact. Measured (benchmarks/tuning/prefill_switch.py, kernels' time / the prefill path's; docs/decisions.md,
// "Prefill switch"): rounded, on 4096x4096 and 4096x6144 0.94-1.15 at 256 rows (one pass) but 1.11-1.70 from 320 (a
// second pass costs about as much as the first there: their grids are small); on 4096x14336 0.87 at 512, 1.00 at 640,
// 1.04 at 768; on 8192x10240 and 4096x28672 0.89-0.98 up to 768, 1.05-1.06 at 1024; on 8192x28672 and 28672x8192
// 0.82-0.89 up to 768, 0.95-0.97 at 1024.
// Exact passes of 128, on the first four: 0.77-0.84 at 320-384 rows, 0.95 at 512, 0.97-1.04 at 640 (large), 0.74-0.90
// at 320, 0.89-1.03 at 448, 1.03-1.10 at 512 (the other two). (cuBLAS is uneven between sizes: the prefill path took
// 700-762 us at 448 rows on 8192x28672 against 485-513 at 512.)
// MXFP8's passes of 256 (from 192 rows) take the same tiers: kernels / prefill path 0.55-0.93 up to 512 rows on
// 8192x28672, 28672x8192 and 4096x28672, 0.93-1.09 at 640-1024; 0.61-0.93 up to 512 and 1.01-1.13 from 640 on
// 8192x10240; 0.65-1.07 up to 512 and 1.05-1.31 from 640 on 4096x14336 / 14336x4096 (14336x4096 1.06-1.07 at 448-512);
// on 4096x4096 / 4096x6144 1.09 / 0.83 at 256, 1.06-2.25 from 320. The worst call against the faster path, over the 72
// measured (7 shapes x 192-1024 rows): 1.09x (4096x4096 at 256 rows), 1.65x under the tiers of the passes of 128 (384
// rows; 512 from 2^27 elements). The op timed with these tiers (same 72 calls, another run): at worst 1.13x (4096x4096
// at 256 rows), 1.007x on average.
constexpr int64_t rounded_prefill_rows(int64_t N, int64_t K) {
  return N * K < kSmallWeightElements ? 257 : N * K < kMidWeightElements ? 640 : 1024;
}
constexpr int64_t w4a16_gemm_prefill_rows(int64_t group_size, int64_t N, int64_t K, bool rounded = false) {
  if (!w4a16_gemm_wide_takes(group_size)) return 128;
  if (rounded && group_size == 128) return rounded_prefill_rows(N, K);
  return N * K >= kLargeWeightElements ? 640 : 448;
}
constexpr int64_t mxfp8_gemm_prefill_rows(int64_t N, int64_t K) { return rounded_prefill_rows(N, K); }

// Device workspace bytes launch_w4a16_gemm needs for these arguments (0: none). From 17 rows (9 on weights of
// 2^27 elements or more), at group size 128 or per channel, the automatic choice (split_k = 0) runs the wide
// (wgmma) kernel, which reads x re-laid out, and whose stream-K schedule keeps a flag and a slot of partial sums per
// SM (64 KB each: 8.5 MB on 132 SMs; 128 KB in rounded passes). sms: the device's multiprocessor count. rounded:
// the call may take the rounded passes (W4a16GemmArgs::rounded, with bf16 x).
size_t w4a16_gemm_workspace_bytes(int64_t M, int64_t K, int64_t N, int group_size, int split_k, int sms,
                                  bool rounded = false);

// x: [M, K] (row stride x_stride elements, unit column stride, 16-byte aligned rows, K % 8 == 0); packed: the
// int4 blob [ceil(N/64), ceil(K/512), 4, 1024 + sbytes/4]; out: [M, N] (row stride out_stride), x's dtype
// (bf16 or fp16). split_k: K splits per cluster of the streaming kernel (>= 1 forces it), 0 = pick the kernel and
// splits. workspace: w4a16_gemm_workspace_bytes(M, K, N, group_size, split_k, sms, rounded with bf16 x) bytes,
// 16-byte aligned (null if 0). sms: the device's multiprocessor count. rounded: with bf16 x at group size 128, from
// 160 rows the wide kernel may run passes of up to 256 rows that multiply the weights rounded once to bf16, as the
// torch op's prefill path does (gemm_plan.cuh, wide::pass_rows); false keeps the weights exact at every M. As every
// launcher (launchers.h): an argument struct and the stream.
struct W4a16GemmArgs {
  const void* x = nullptr;
  InDtype dtype = InDtype::kBF16;
  int64_t M = 0, K = 0, x_stride = 0;
  const void* packed = nullptr;
  int group_size = 0;  // 32, 64, 128 or -1 (per channel)
  bool asym = false;
  void* out = nullptr;
  int64_t out_stride = 0, N = 0;
  int split_k = 0;
  void* workspace = nullptr;
  int sms = 0;
  bool rounded = false;
};
cudaError_t launch_w4a16_gemm(const W4a16GemmArgs& a, cudaStream_t stream);

// w4a16_dequant.cu (the prefill path: dequantize once, then a dense GEMM). packed: the int4 blob as above, 16-byte
// aligned; out: contiguous [N, K] of out_dtype (bf16 or fp16), w = (u - z) * s in fp32 rounded once. K % 8 == 0.
struct W4a16DequantArgs {
  const void* packed = nullptr;
  int group_size = 0;
  bool asym = false;
  int64_t N = 0, K = 0;
  InDtype out_dtype = InDtype::kBF16;
  void* out = nullptr;
};
cudaError_t launch_w4a16_dequant(const W4a16DequantArgs& a, cudaStream_t stream);

// w4a16_dequant.cu, FP8 form (the FP8 tensor-core prefill path): codes [N, K] E4M3 = u - z (exact), scale_t
// [K/128, N] fp32 = the group's scale (per channel: repeated per 128 K). Group size 128 or -1; K % 128 == 0.
struct W4a16DequantFp8Args {
  const void* packed = nullptr;
  int group_size = 0;
  bool asym = false;
  int64_t N = 0, K = 0;
  void* codes = nullptr;
  float* scale_t = nullptr;
};
cudaError_t launch_w4a16_dequant_fp8(const W4a16DequantFp8Args& a, cudaStream_t stream);

// Scale-record bytes per FP4 tile block (64 per packet, both formats).
constexpr int kFp4RecordBytes = 8 * 64;

// Device workspace bytes launch_fp4_gemm needs (0: none): from 16 rows per expert (the mean over the experts that
// can have rows: M over min(max(E, routed_experts), M)) the automatic choice (split_k = 0) runs the wide (wgmma)
// kernel, which reads x re-laid out.
size_t fp4_gemm_workspace_bytes(int64_t M, int64_t K, int64_t E, bool grouped, int split_k, int64_t routed_experts);

// x: bf16 [M, K] (as above, K % 32 == 0); offsets: int32 [E+1] on the device (null: one expert over all M
// rows); packed: the FP4 blob [E, ceil(N/64), ceil(K/512), 4, 1152]; row_scale: [E, ceil(N/64)*64] or null;
// out: bf16 [M, N]. max_m: an upper bound on any expert's rows (the streaming kernel's tokens per pass; a wrong
// bound costs passes, not correctness). fmt: 0 = MXFP4, 1 = NVFP4. split_k: K splits of the streaming kernel (>= 1
// forces it), 0 = pick the kernel. routed_experts: the experts the M rows were routed over, when more than the E
// here (expert parallel: rows of other ranks' experts sit in x, sorted last, and are not computed; 0 = E): the mean
// rows per expert, which picks the wide kernel and its tokens per pass, is M over those. workspace:
// fp4_gemm_workspace_bytes(M, K, E, offsets != null, split_k, routed_experts) bytes, 16-byte aligned (null if 0).
struct Fp4GemmArgs {
  const void* x = nullptr;
  int64_t M = 0, K = 0, x_stride = 0;
  const int* offsets = nullptr;
  int64_t E = 1;  // experts
  int64_t routed_experts = 0;  // the experts x's rows were routed over (0: E)
  int64_t max_m = 0;
  const void* packed = nullptr;
  const float* row_scale = nullptr;
  int fmt = 0;
  void* out = nullptr;
  int64_t out_stride = 0, N = 0;
  int split_k = 0;
  void* workspace = nullptr;
  int sms = 0;
};
cudaError_t launch_fp4_gemm(const Fp4GemmArgs& a, cudaStream_t stream);

// MXFP8 (mxfp8_gemm.cu): the same blob geometry with 1-byte codes, a tile block is 2048 int32 words of codes plus
// 8 x 32 bytes of E8M0 exponent records.
constexpr int kMxfp8RecordBytes = 8 * 32;
constexpr int kMxfp8WideMinRows = 17;  // from this many rows the wide kernel (gemm_plan.cuh), below streaming

// Device workspace bytes launch_mxfp8_gemm needs (0: none): the wide kernel's re-laid-out x, one pass at a time, and
// its stream-K flags and slots (as w4a16_gemm_workspace_bytes).
size_t mxfp8_gemm_workspace_bytes(int64_t M, int64_t K, int split_k, int sms);

// x: bf16 [M, K] (row stride x_stride, unit column stride, 16-byte aligned rows, K % 32 == 0); packed: the MXFP8 blob
// [ceil(N/64), ceil(K/512), 4, 2048 + 64] (16-byte aligned); out: bf16 [M, N] (row stride out_stride). split_k: K
// splits of the streaming kernel (>= 1 forces it at any M), 0 = pick. workspace: mxfp8_gemm_workspace_bytes(M, K,
// split_k, sms) bytes, 16-byte aligned (null if 0).
struct Mxfp8GemmArgs {
  const void* x = nullptr;
  int64_t M = 0, K = 0, x_stride = 0;
  const void* packed = nullptr;
  void* out = nullptr;
  int64_t out_stride = 0, N = 0;
  int split_k = 0;
  void* workspace = nullptr;
  int sms = 0;
};
cudaError_t launch_mxfp8_gemm(const Mxfp8GemmArgs& a, cudaStream_t stream);

// FP8 W8A8 decode GEMM (fp8_gemm.cu), on the weight as checkpoints and vLLM's CUTLASS hold it (no repack):
//   out[M, N] = (sum_k x[m, k] * w[n, k]) * x_scale[m or 0] * w_scale[n], fp32 sums, rounded once to bf16.
// x: bf16 [M, K] holding E4M3 values (the quantized activations, exact in bf16; row stride x_stride, unit column
// stride, 16-byte aligned rows); x_scale: fp32, one per row (x_scale_stride 1) or one (0); w: E4M3 [N, K] contiguous,
// 16-byte aligned, K % 16 == 0; w_scale: fp32 [N]; out: bf16 [M, N] (row stride out_stride). split_k: K splits per
// cluster (0 = pick). Every M runs the streaming kernel (passes of up to 32 rows, each re-reading the weight): the
// callers keep larger batches on an FP8 tensor-core GEMM.
struct Fp8GemmArgs {
  const void* x = nullptr;  // bf16, or fp16 with x_f16, holding E4M3 values
  bool x_f16 = false;
  int64_t M = 0, K = 0, x_stride = 0;
  const float* x_scale = nullptr;
  int x_scale_stride = 0;
  const void* w = nullptr;
  const float* w_scale = nullptr;
  void* out = nullptr;
  int64_t out_stride = 0, N = 0;
  int split_k = 0;
  int sms = 0;
};
cudaError_t launch_fp8_gemm(const Fp8GemmArgs& a, cudaStream_t stream);

// The dense bf16 weight [N, K] (contiguous) from the MXFP8 blob: the prefill path. K % 32 == 0.
struct Mxfp8DequantPackedArgs {
  const void* packed = nullptr;
  int64_t N = 0, K = 0;
  void* out = nullptr;
};
cudaError_t launch_mxfp8_dequant_packed(const Mxfp8DequantPackedArgs& a, cudaStream_t stream);

}  // namespace cublade
