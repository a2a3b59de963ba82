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
#include "mxfp8_codes.cuh"
#include "gemm_plan.cuh"
#include "w4a16_gemm.h"

#include <algorithm>

namespace cublade {
namespace {

using lowbit::kPacketK;
using mxfp8::dequant_packet;
using mxfp8::dequant_step;
using mxfp8::factors;
using lowbit::kTileN;

using mxfp8::kCodePacketBytes;
using mxfp8::Mxfp8Policy;

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

// Passes of 256 tokens: one packet (4 k-steps) per issue, so 16 fragment registers are live under the mma's instead
// of 32 (the 128 accumulators a thread of m64n256 leave no room for a batch's 32), as int4's rounded passes do.
struct Mxfp8Steps : Mxfp8Batch {
  static constexpr int kSteps = 4;
  // k-steps 8b + 4h .. 8b + 4h + 3: packet 2b + h of the stage
  __device__ static void steps(const unsigned char* packets, const unsigned char* recs, int b, int h, int lane,
                               uint32_t (&a)[4][4]) {
    const int j = 2 * b + h;
    const unsigned char* q = packets + j * kPacketBytes + lane * 16;
    dequant_packet(lowbit::lds128(q), lowbit::lds128(q + 512), recs, j, lane, a);
  }
};

// The batches of a pass of NTOK tokens.
template <int NTOK>
using PassBatch = std::conditional_t<(NTOK > wide::kMaxPassRows), Mxfp8Steps, Mxfp8Batch>;

// run(PassConfig<...>{}) for a pass's plan (gemm_plan.cuh: mxfp8_plan_pass).
template <typename Run>
cudaError_t with_config(const wide::PassPlan& p, Run&& run) {
  switch (p.tokens) {
    case 256: return run(wide::PassConfig<256, 2, wide::stage_k(256)>{});
    case 128: return run(wide::PassConfig<128, 2, wide::kMxfp8StageK>{});
    case 96: return run(wide::PassConfig<96, 2, wide::kMxfp8StageK>{});
    case 64: return run(wide::PassConfig<64, 2, wide::kMxfp8StageK>{});
    case 48: return run(wide::PassConfig<48, 2, wide::kMxfp8StageK>{});
    case 32: return run(wide::PassConfig<32, 2, wide::kMxfp8StageK>{});
    default: return cudaErrorInvalidValue;
  }
}

// One wide pass over `rows` <= 256 rows of x.
cudaError_t launch_wide_pass(const void* x, int64_t x_stride, int rows, int K, const unsigned char* w, void* out,
                             int64_t out_stride, int N, void* workspace, int sms, cudaStream_t stream) {
  wide::Params prm = {};  // launch_kernel refuses rows > NTOK (one pass, no token windows)
  prm.w = w;
  prm.M = rows; prm.N = N;
  prm.out = out; prm.out_stride = out_stride;
  const wide::PassPlan plan = wide::mxfp8_plan_pass(rows, K, N, sms);
  return with_config(plan, [&](auto cfg) {
    using C = decltype(cfg);
    return wide::launch_kernel<PassBatch<C::kTokens>, C::kTokens, C::kWarpgroups, C::kStageK, false>(
        prm, x, x_stride, K, plan.schedule, 0, true, workspace, sms, stream);
  });
}

}  // namespace

size_t mxfp8_gemm_workspace_bytes(int64_t M, int64_t K, int split_k, int sms) {
  const int64_t m = wide::mxfp8_pass_rows(M);  // one pass at a time, the first the largest
  if (split_k != 0 || m == 0) return 0;
  return static_cast<size_t>(wide::workspace_bytes(m, K, wide::mxfp8_pass_tokens(m), false, sms));
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
    // passes of up to 128 rows, of up to 256 from 192 rows left; fewer than 17 left: the streaming kernel
    while (const int64_t rows = wide::mxfp8_pass_rows(M)) {
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
  const int nt = lowbit::token_tiles(prm.M);
  prm.xrows = std::min(8 * nt, prm.M);
  if (nt == 1) return lowbit::launch_byte_weights_few_rows<Mxfp8Policy<1>>(prm, split_k, stream);
  if (nt == 2) return lowbit::launch_byte_weights_few_rows<Mxfp8Policy<2>>(prm, split_k, stream);
  const int S = split_k > 0 ? split_k : lowbit::pick_split(prm.groups, prm.chunks, sms);
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
  mxfp8::dequant_packed_kernel<<<static_cast<unsigned>(blocks), mxfp8::kDequantThreads, 0, stream>>>(
      static_cast<const unsigned char*>(a.packed), chunks, static_cast<int>(N), static_cast<int>(K),
      static_cast<__nv_bfloat16*>(a.out));
  return cudaGetLastError();
}

}  // namespace cublade
