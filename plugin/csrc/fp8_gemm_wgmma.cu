// FP8 W8A8 GEMM on Hopper's FP8 tensor cores for a busy server's token counts (16 to a few thousand tokens):
//   out[m, n] = bf16(x_scale[m] * (w_scale[n] * sum_k x[m, k] * w[n, k]))
// x: E4M3 activations [M, K] (cublade's per-token or per-tensor quantization), w: the E4M3 weight [N, K] as
// checkpoints store it and vLLM's CUTLASS scaled-mm reads it, so the layer keeps one copy of its weights. Every
// product is exact in fp32; the sums differ from the `fp8` scheme's reference (cublade.numerics.linear.fp8_linear_ref)
// only in fp32 summation order, then the two scales in the reference's order and one rounding to bf16.
//
// Kernel: weights are wgmma's A (64 weight rows a warpgroup), tokens its N (16 to 256 a warpgroup), both operands
// staged in shared memory by TMA in boxes of 128 K bytes with the 128-byte swizzle (wgmma_fp8.cuh). A CTA is two
// consumer warpgroups and one producer warp; its tile is either 128 weight rows x BN tokens (the warpgroups split
// the rows and share the staged x) or 64 weight rows x BN tokens (they split the tokens and share the staged
// weights: twice the CTAs for the small weights). K can be split over a cluster of up to 8 CTAs, whose fp32 partial
// sums meet in distributed shared memory, added in rank order (the same order at every call: outputs are
// reproducible). The producer's lane 0 issues one TMA copy per operand per stage into a ring of stages. Launched as a
// programmatic dependent launch of the quantization before it (Fp8WgmmaArgs::pdl), it fills the ring with weights
// while that kernel runs (cublade's quantization kernels let their dependents start at once).
#define CUBLADE_KERNELS_ONLY  // framework-free (no torch header); the torch wrapper is fp8_gemm_wgmma_torch.cpp
#include "fp8_gemm_wgmma.h"
#include "w4a16_gemm.cuh"  // the mbarrier / TMA wrappers
#include "wgmma.cuh"
#include "wgmma_fp8.cuh"

#include <cooperative_groups.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <algorithm>

namespace cublade {
namespace fp8_wgmma {
namespace {

namespace cg = cooperative_groups;
using lowbit::mbar_arrive;
using lowbit::mbar_expect_tx;
using lowbit::mbar_init;
using lowbit::mbar_wait;
using lowbit::smem_u32;
using lowbit::tma_g2s_2d;

constexpr int kBK = 128;                     // K bytes a stage: one swizzled row
constexpr int kConsumers = 256;              // two consumer warpgroups
constexpr int kThreads = kConsumers + 32;    // and the producer warp
constexpr int kSmemBytes = 220 * 1024;       // the ring's budget (227 KB a CTA at most)
constexpr int kSmemBytesTwo = 108 * 1024;    // the same with two CTAs an SM (228 KB an SM)
constexpr int kMaxStages = 8;

struct Params {
  CUtensorMap wmap, xmap;  // boxes of (64 or 128) weight rows / BN tokens x 128 K
  const float* x_scale;
  int x_scale_stride;
  const float* w_scale;
  __nv_bfloat16* out;
  int64_t out_stride;
  int M, N, K;
  int ksteps_per_split;  // stages of 128 K a CTA of the cluster runs
};

// kRowsSplit: the two warpgroups take 64 weight rows each of a 128-row tile and share the tokens (BN = TW);
// else they share 64 weight rows and take TW tokens each (BN = 2 TW). TW: tokens a warpgroup (wgmma N).
// kTwo: a ring half as deep, so that two CTAs fit an SM (TW <= 128: their registers fit too).
template <int TW, bool kRowsSplit, bool kTwo = false>
struct Tile {
  static constexpr int kRows = kRowsSplit ? 128 : 64;
  static constexpr int kTokens = kRowsSplit ? TW : 2 * TW;
  static constexpr int kStageBytes = (kRows + kTokens) * kBK;
  static constexpr int kBudget = (kTwo ? kSmemBytesTwo : kSmemBytes) - 1024 - 2 * kMaxStages * 8;
  static constexpr int kStages = kBudget / kStageBytes < kMaxStages ? kBudget / kStageBytes : kMaxStages;
  static constexpr int kAccBytes = kConsumers * (TW / 2) * 4;  // the partial sums, for the split-K epilogue
  static constexpr int kRingBytes = kStages * kStageBytes > kAccBytes ? kStages * kStageBytes : kAccBytes;
  static constexpr int kSmem = kRingBytes + 1024 + 2 * kMaxStages * 8;
  static_assert(kStages >= 2, "a ring of at least two stages");
  static_assert(!kTwo || TW <= 128, "two CTAs an SM hold at most 64 accumulators a thread");
};

template <int TW, bool kRowsSplit, bool kCluster, bool kTwo>
__global__ void __launch_bounds__(kThreads, kTwo ? 2 : 1) fp8_wgmma_kernel(const __grid_constant__ Params p) {
  using L = Tile<TW, kRowsSplit, kTwo>;
  constexpr int S = L::kStages;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Stage s: weights at ring + s * kStageBytes (kRows x 128), then x (kTokens x 128); both 1024-aligned.
  unsigned char* ring = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + L::kRingBytes);
  uint64_t* empty = full + kMaxStages;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = blockIdx.x * L::kRows, tok0 = blockIdx.y * L::kTokens;
  const int split = kCluster ? static_cast<int>(cg::this_cluster().block_rank()) : 0;
  const int k_total = (p.K + kBK - 1) / kBK;
  const int it0 = split * p.ksteps_per_split, it1 = min(k_total, it0 + p.ksteps_per_split);
  const int n_it = max(0, it1 - it0);

  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, kConsumers / 32);  // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  float acc[TW / 2];
#pragma unroll
  for (int i = 0; i < TW / 2; ++i) acc[i] = 0.f;

  if (warp == kConsumers / 32) {  // the producer warp
    if (lane == 0) {
      const uint64_t wpol = lowbit::policy_evict_first(), xpol = lowbit::policy_evict_last();
      // The first stages' weights go out before the previous kernel (the activations' quantization) has finished,
      // when this is its programmatic dependent launch; x only after pdl_wait (at once without PDL).
      const int ahead = min(S, n_it);
      for (int it = 0; it < ahead; ++it) {
        mbar_expect_tx(full + it, L::kStageBytes);
        tma_g2s_2d(ring + it * L::kStageBytes, &p.wmap, (it0 + it) * kBK, row0, full + it, wpol);
      }
      lowbit::pdl_wait();
      for (int it = 0; it < n_it; ++it) {
        const int s = it % S;
        unsigned char* st = ring + s * L::kStageBytes;
        const int k0 = (it0 + it) * kBK;
        if (it >= ahead) {
          mbar_wait(empty + s, ((it / S) - 1) & 1);
          mbar_expect_tx(full + s, L::kStageBytes);
          tma_g2s_2d(st, &p.wmap, k0, row0, full + s, wpol);
        }
        tma_g2s_2d(st + L::kRows * kBK, &p.xmap, k0, tok0, full + s, xpol);
      }
    }
  } else {
    const int wg = warp / 4;
    const int a_off = kRowsSplit ? wg * 64 * kBK : 0;
    const int b_off = L::kRows * kBK + (kRowsSplit ? 0 : wg * TW * kBK);
    for (int it = 0; it < n_it; ++it) {
      const int s = it % S;
      mbar_wait(full + s, (it / S) & 1);
      const uint32_t st = smem_u32(ring + s * L::kStageBytes);
      wgmma::fence();
#pragma unroll
      for (int k = 0; k < kBK / 32; ++k)
        wgmma::MmaSSFp8<TW>::run(acc, wgmma::desc_sw128(st + a_off + 32 * k), wgmma::desc_sw128(st + b_off + 32 * k),
                                 (it > 0 || k > 0) ? 1 : 0);
      wgmma::commit();
      wgmma::wait<1>();  // the previous stage's mma's are done: give its buffers back
      if (it > 0 && lane == 0) mbar_arrive(empty + (it - 1) % S);
    }
    wgmma::wait<0>();
    wgmma::fence_regs(acc);
  }

  lowbit::pdl_wait();  // the epilogue reads the quantization's scales and writes what the previous kernel may read

  // Epilogue. Thread (warp w of its warpgroup, g = lane / 4, t = lane % 4) holds acc[4i + j]: weight row
  // 16 w + g + 8 (j / 2), token 8 i + 2 t + j % 2 of its warpgroup's 64 rows x TW tokens.
  const int ct = threadIdx.x;  // consumer thread index (producer threads skip the math)
  const int wg = ct / 128, w = (ct / 32) % 4, g = (ct % 32) / 4, t = ct % 4;
  const int row_base = row0 + (kRowsSplit ? wg * 64 : 0) + 16 * w + g;
  const int tok_base = tok0 + (kRowsSplit ? 0 : wg * TW) + 2 * t;
  auto store = [&](int i, float v) {
    const int j = i % 4;
    const int row = row_base + 8 * (j / 2), tok = tok_base + 8 * (i / 4) + j % 2;
    if (row < p.N && tok < p.M)
      p.out[static_cast<int64_t>(tok) * p.out_stride + row] = __float2bfloat16_rn(
          __fmul_rn(p.x_scale[static_cast<int64_t>(tok) * p.x_scale_stride], __fmul_rn(p.w_scale[row], v)));
  };
  if constexpr (!kCluster) {
    if (ct < kConsumers) {
#pragma unroll
      for (int i = 0; i < TW / 2; ++i) store(i, acc[i]);
    }
  } else {
    // Each CTA's partial sums to its shared memory (register i of consumer thread ct at [i][ct]: the ring is free,
    // every stage consumed), then CTA r of the C adds up registers [r n / C, (r + 1) n / C) over the C CTAs in rank
    // order and stores them.
    const cg::cluster_group cluster = cg::this_cluster();
    const int C = static_cast<int>(cluster.num_blocks());
    float* part = reinterpret_cast<float*>(ring);
    if (ct < kConsumers) {
      // The partial sums overwrite the ring: both consumer warpgroups must be done reading its last stages first (a
      // warpgroup that finished early would overwrite the operands the other's last mma's still read).
      asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory");
#pragma unroll
      for (int i = 0; i < TW / 2; ++i) part[i * kConsumers + ct] = acc[i];
    }
    cluster.sync();
    if (ct < kConsumers) {
      const int per = (TW / 2) / C;
      for (int i = split * per; i < (split + 1) * per; ++i) {
        float v = 0.f;
        for (int r = 0; r < C; ++r) v += cluster.map_shared_rank(part, r)[i * kConsumers + ct];
        store(i, v);
      }
    }
    cluster.sync();  // no CTA leaves while another still reads its partial sums
  }
}

// cuTensorMapEncodeTiled from the driver the runtime loaded (no libcuda link), looked up once.
PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      ptr = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// rows x K bytes (row stride `stride` bytes) as boxes of box_rows x 128 K, 128-byte swizzle, zeros past the edges.
bool rows_map(CUtensorMap* map, const void* base, int64_t rows, int64_t K, int64_t stride, int box_rows) {
  const auto encode = encode_tiled();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(stride)};
  const cuuint32_t box[2] = {kBK, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int TW, bool kRowsSplit, bool kTwo>
cudaError_t launch_tile(const Fp8WgmmaArgs& a, const Fp8WgmmaPlan& plan, cudaStream_t stream) {
  using L = Tile<TW, kRowsSplit, kTwo>;
  Params p = {};
  if (!rows_map(&p.wmap, a.w, a.N, a.K, a.K, L::kRows) ||
      !rows_map(&p.xmap, a.x, a.M, a.K, a.x_stride, L::kTokens))
    return cudaErrorInvalidValue;
  p.x_scale = a.x_scale; p.x_scale_stride = a.x_scale_stride; p.w_scale = a.w_scale;
  p.out = static_cast<__nv_bfloat16*>(a.out); p.out_stride = a.out_stride;
  p.M = static_cast<int>(a.M); p.N = static_cast<int>(a.N); p.K = static_cast<int>(a.K);
  const int k_total = static_cast<int>(ceil_div(a.K, kBK));
  p.ksteps_per_split = static_cast<int>(ceil_div(k_total, plan.split_k));

  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(ceil_div(a.N, L::kRows)), static_cast<unsigned>(ceil_div(a.M, L::kTokens)),
                     static_cast<unsigned>(plan.split_k));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = L::kSmem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (plan.split_k > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = 1;
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = static_cast<unsigned>(plan.split_k);
    ++n;
  }
  if (a.pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  constexpr auto unsplit = fp8_wgmma_kernel<TW, kRowsSplit, false, kTwo>;
  constexpr auto split = fp8_wgmma_kernel<TW, kRowsSplit, true, kTwo>;
  const cudaError_t e = plan.split_k == 1 ? lowbit::allow_max_smem<unsplit>() : lowbit::allow_max_smem<split>();
  if (e != cudaSuccess) return e;
  return cudaLaunchKernelEx(&cfg, plan.split_k == 1 ? unsplit : split, p);
}

template <bool kRowsSplit, bool kTwo>
cudaError_t launch_split(const Fp8WgmmaArgs& a, const Fp8WgmmaPlan& plan, cudaStream_t stream) {
  switch (plan.tokens_per_wg) {
    case 16: return launch_tile<16, kRowsSplit, kTwo>(a, plan, stream);
    case 32: return launch_tile<32, kRowsSplit, kTwo>(a, plan, stream);
    case 48: return launch_tile<48, kRowsSplit, kTwo>(a, plan, stream);
    case 64: return launch_tile<64, kRowsSplit, kTwo>(a, plan, stream);
    case 96: return launch_tile<96, kRowsSplit, kTwo>(a, plan, stream);
    case 128: return launch_tile<128, kRowsSplit, kTwo>(a, plan, stream);
    default: break;
  }
  if constexpr (kRowsSplit && !kTwo) {  // split tokens: at most 2 x 128 (a TMA box has at most 256 rows)
    if (plan.tokens_per_wg == 192) return launch_tile<192, true, false>(a, plan, stream);
    if (plan.tokens_per_wg == 256) return launch_tile<256, true, false>(a, plan, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace
}  // namespace fp8_wgmma

// The tile for M tokens. Passes of at most 256 tokens, evenly sized; a warpgroup's tokens the smallest of 16 / 32 /
// 48 / 64 / 96 / 128 / 192 / 256 that covers its share. Of the two tile forms, the one whose grid fills the SMs' last
// wave best, the 128-row form's count multiplied by kRowsSplitRate: per CTA it moves half the activations a flop of
// the 64-row form (K 4096 x N 28672 at 1024 tokens, both grids 6-14 full waves: 253 against 282 us on the H200). K
// is split in two over a cluster where K >= 8192 and the grid fills at most half the SMs: K 14336 x N 4096 at 16-256
// tokens 24.6-42.4 us against 29.8-51.3 unsplit (benchmarks/tuning/fp8_wgmma.cu), nowhere else faster. Where split,
// the sums are fp32 additions of two halves: other bits than an unsplit call's (batch_invariant: never split).
constexpr double kRowsSplitRate = 1.12;

Fp8WgmmaPlan plan_fp8_wgmma(int64_t M, int64_t N, int64_t K, int sms, bool batch_invariant) {
  const int64_t passes = ceil_div(M, int64_t{256});
  const int64_t per_pass = ceil_div(M, passes);
  auto fit = [](int64_t tokens) {
    for (int tw : {16, 32, 48, 64, 96, 128, 192})
      if (tw >= tokens) return tw;
    return 256;
  };
  auto fill = [sms](int64_t ctas) {  // the share of the CTA slots of the last wave the grid fills
    return static_cast<double>(ctas) / static_cast<double>(ceil_div(ctas, int64_t{sms}) * sms);
  };
  const int64_t rows_ctas = ceil_div(N, int64_t{128}) * passes, tok_ctas = ceil_div(N, int64_t{64}) * passes;
  Fp8WgmmaPlan plan;
  plan.rows_split = per_pass <= 16 || kRowsSplitRate * fill(rows_ctas) >= fill(tok_ctas);
  plan.tokens_per_wg = fit(plan.rows_split ? per_pass : ceil_div(per_pass, int64_t{2}));
  const int64_t ctas = plan.rows_split ? rows_ctas : tok_ctas;
  plan.split_k = !batch_invariant && K >= 8192 && 2 * ctas <= sms && plan.tokens_per_wg >= 16 ? 2 : 1;
  // One pass of up to 128 tokens over more 128-row tiles than SMs (gate_up-sized weights at decode batches): two CTAs
  // an SM, with rings half as deep, so that the last wave's tail is spread over every SM (K 4096 x N 28672 at 1 / 16
  // / 64 / 128 tokens: 34.7 / 35.3 / 38.2 / 42.7 us against 37.9 / 36.9 / 41.3 / 48.4; on the grids of at most one
  // wave it lost everywhere measured).
  plan.two_per_sm = plan.rows_split && passes == 1 && plan.tokens_per_wg <= 128 && ctas > sms && plan.split_k == 1;
  return plan;
}

cudaError_t launch_fp8_gemm_wgmma(const Fp8WgmmaArgs& a, const Fp8WgmmaPlan* forced, cudaStream_t stream) {
  if (a.M == 0 || a.N == 0) return cudaSuccess;
  if (a.K <= 0 || a.K % 16 != 0 || a.M > INT32_MAX || a.N > INT32_MAX || a.K > INT32_MAX || a.x_stride % 16 != 0 ||
      !is_aligned(a.w, 16) || !is_aligned(a.x, 16) || a.x_scale == nullptr || a.w_scale == nullptr)
    return cudaErrorInvalidValue;
  const Fp8WgmmaPlan plan = forced != nullptr ? *forced : plan_fp8_wgmma(a.M, a.N, a.K, a.sms, false);
  if (plan.split_k < 1 || plan.split_k > 8 || (plan.split_k & (plan.split_k - 1)) != 0 ||
      (plan.tokens_per_wg / 2) % plan.split_k != 0 || (plan.two_per_sm && plan.tokens_per_wg > 128))
    return cudaErrorInvalidValue;
  if (plan.two_per_sm)
    return plan.rows_split ? fp8_wgmma::launch_split<true, true>(a, plan, stream)
                           : fp8_wgmma::launch_split<false, true>(a, plan, stream);
  return plan.rows_split ? fp8_wgmma::launch_split<true, false>(a, plan, stream)
                         : fp8_wgmma::launch_split<false, false>(a, plan, stream);
}

}  // namespace cublade
