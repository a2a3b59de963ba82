// FP8 W8A8 decode GEMM on Hopper, reading the weight where it already is: the E4M3 [N, K] rows that checkpoints store
// and vLLM's CUTLASS scaled-mm reads (as its column-major B), so the layer keeps one copy of its weights and the
// batches above this kernel's range stay on CUTLASS's FP8 tensor cores.
//   out[m, n] = (sum_k x[m, k] * w[n, k]) * x_scale[m] * w_scale[n]
// Numerics (the `fp8` scheme's W8A8 reference, cublade.numerics.linear.fp8_linear_ref): x holds the E4M3 activation
// values as bf16 or fp16 (exact in both), each weight code is decoded to its exact value in the same type, so every
// product is exact in the mma's fp32 accumulators; the sums differ from the reference's only in fp32 summation order;
// then the two scales in the reference's order and one rounding to bf16.
// Kernel: the weight-streaming kernel of w4a16_gemm.cuh with plain rows (kPlainRows): each stage's 64 rows x 512 K
// arrive as four TMA boxes of 64 rows x 128 K with the 128-byte swizzle (the rows' 16-byte chunks rotated by row,
// which the consumers' loads undo, see the kernel), and the codes become bf16 as the MXFP8 kernels decode theirs
// (mxfp8_codes.cuh: bit placement, then one HMUL2 by 2^120) for bf16 x, or with one conversion instruction per two
// codes (cvt.rn.f16x2.e4m3x2) for fp16 x: 8 instructions per lane and packet half instead of about 32 (ptxas).
#define CUBLADE_KERNELS_ONLY  // framework-free (no torch header); the torch wrapper is fp8_gemm_torch.cpp
#include "w4a16_gemm.cuh"
#include "mxfp8_codes.cuh"
#include "w4a16_gemm.h"

#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <algorithm>
#include <cstdlib>
#include <string>

namespace cublade {
namespace {

using lowbit::kTileN;

// Plain E4M3 rows for the streaming kernel: a packet's lane words hold 4 consecutive K (bytes 0..3), reordered to the
// MXFP8 blob's byte order (K0, K0 + 2, K0 + 1, K0 + 3) for mxfp8::dequant_step, with every block factor 2^120 (the
// decode's 2^-120 taken back out: exact).
template <int NT_>
struct Fp8RowsPolicy {
  using T = __nv_bfloat16;
  static constexpr int NT = NT_;
  static constexpr int kPacketBytes = 1024;  // 16 rows x 64 K of 1-byte codes
  static constexpr bool kPlainRows = true;
  struct State {};
  template <int kSliceK>
  __device__ static const unsigned char* slice_records(const unsigned char*, int) { return nullptr; }
  __device__ static const float* row_scale(const lowbit::GemmParams& prm, int) { return prm.row_scale; }
  template <int j, int kSliceK>
  __device__ static void packet(State&, const uint4 (&q)[2], const unsigned char*, const uint4 (&xc)[2][NT],
                                float (&acc)[NT][4], int) {
    constexpr uint32_t kTwo120 = 0x7B807B80u;  // bf16 (2^120, 2^120)
    auto blob_order = [](uint32_t w) { return lowbit::prmt(w, 0u, 0x3120u); };
    uint32_t a[4][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mxfp8::dequant_step(blob_order(q[h].x), blob_order(q[h].y), kTwo120, kTwo120, a[2 * h]);
      mxfp8::dequant_step(blob_order(q[h].z), blob_order(q[h].w), kTwo120, kTwo120, a[2 * h + 1]);
    }
    lowbit::mma_packet<T>(acc, a, xc);
  }
};

// The same rows for fp16 x: each 16-bit half of a lane word (2 consecutive K) becomes an fp16 pair in one conversion
// instruction, already in the mma's pair order, and the mma's run on fp16 (the output is still bf16). Lane word .x
// (.y) holds row g's (g + 8's) K kc .. kc + 3, .z / .w their kc + 4 .. + 7; x's 16-byte load holds kc .. kc + 7
// as pairs (kc, kc + 1) .. (kc + 6, kc + 7), the B fragments of two k-steps.
template <int NT_>
struct Fp8RowsF16Policy : Fp8RowsPolicy<NT_> {
  template <int j, int kSliceK>
  __device__ static void packet(typename Fp8RowsPolicy<NT_>::State&, const uint4 (&q)[2], const unsigned char*,
                                const uint4 (&xc)[2][NT_], float (&acc)[NT_][4], int) {
    auto f16x2 = [](uint32_t w, bool high) {  // the two codes of w's low or high 16 bits as an fp16 pair (exact)
      uint32_t d;
      if (high)
        asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, h; }" : "=r"(d) : "r"(w));
      else
        asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, l; }" : "=r"(d) : "r"(w));
      return d;
    };
    uint32_t a[4][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // k-step 2h: K kc .. kc + 3 (rows g, g + 8: (kc, kc+1) then (kc+2, kc+3))
      const uint32_t w[4] = {q[h].x, q[h].y, q[h].z, q[h].w};
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        a[2 * h + s][0] = f16x2(w[2 * s], false);
        a[2 * h + s][1] = f16x2(w[2 * s + 1], false);
        a[2 * h + s][2] = f16x2(w[2 * s], true);
        a[2 * h + s][3] = f16x2(w[2 * s + 1], true);
      }
    }
    lowbit::mma_packet<__half>(acc, a, xc);
  }
};

// cuTensorMapEncodeTiled from the driver the runtime loaded (no libcuda link), looked up once.
PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// The weight [N, K] as boxes of 64 rows x 128 K, 128-byte swizzle, zeros past N and K.
bool weight_map(CUtensorMap* map, const void* w, int64_t N, int64_t K) {
  const auto encode = encode_tiled();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(N)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(K)};  // bytes between rows
  const cuuint32_t box[2] = {lowbit::kPlainBoxK, lowbit::kGroupTiles * kTileN};
  const cuuint32_t elem_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(w), dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

cudaError_t launch_fp8_gemm(const Fp8GemmArgs& a, cudaStream_t stream) {
  if (a.M == 0 || a.N == 0) return cudaSuccess;
  if (a.K <= 0 || a.K % 16 != 0 || a.M > INT32_MAX || a.N > INT32_MAX || a.K > INT32_MAX - kLowbitChunkK ||
      !is_aligned(a.w, 16) || a.x_scale == nullptr || a.w_scale == nullptr)
    return cudaErrorInvalidValue;
  lowbit::PlainRowsParams prm = {};
  if (!weight_map(&prm.wmap, a.w, a.N, a.K)) return cudaErrorInvalidValue;
  prm.x = a.x; prm.x_stride = a.x_stride; prm.M = static_cast<int>(a.M); prm.K = static_cast<int>(a.K);
  prm.tiles = static_cast<int>(ceil_div(a.N, kTileN));
  prm.groups = static_cast<int>(ceil_div(a.N, kLowbitGroupRows));
  prm.chunks = static_cast<int>(ceil_div(a.K, kLowbitChunkK));
  prm.row_scale = a.w_scale;
  prm.tok_scale = a.x_scale; prm.tok_scale_stride = a.x_scale_stride;
  // A programmatic dependent launch of the quantization before it (CUBLADE_FP8_GEMM_PDL=0: a plain launch, for A/B).
  static const bool pdl = [] {
    const char* v = std::getenv("CUBLADE_FP8_GEMM_PDL");
    return v == nullptr || std::string(v) != "0";
  }();
  prm.pdl = pdl;
  prm.out = a.out; prm.out_stride = a.out_stride; prm.N = static_cast<int>(a.N);
  prm.sms = a.sms;
  prm.sbytes = 0;
  const int nt = lowbit::token_tiles(prm.M);
  prm.xrows = std::min(8 * nt, prm.M);
  if (nt == 1) {
    return a.x_f16 ? lowbit::launch_byte_weights_few_rows<Fp8RowsF16Policy<1>>(prm, a.split_k, stream)
                   : lowbit::launch_byte_weights_few_rows<Fp8RowsPolicy<1>>(prm, a.split_k, stream);
  }
  const int S = a.split_k > 0 ? a.split_k : lowbit::pick_split(prm.groups, prm.chunks, a.sms);
  if (a.x_f16) {
    if (nt == 2) return lowbit::launch_tpw<Fp8RowsF16Policy<2>>(prm, 1, S, stream);
    return lowbit::launch_tpw<Fp8RowsF16Policy<4>>(prm, 1, S, stream);
  }
  if (nt == 2) return lowbit::launch_tpw<Fp8RowsPolicy<2>>(prm, 1, S, stream);
  return lowbit::launch_tpw<Fp8RowsPolicy<4>>(prm, 1, S, stream);
}

}  // namespace cublade
