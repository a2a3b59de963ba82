/*
 * quant_sweep.cu: tuning sweep for cublade's three memory-bound quant kernels on the H200.
 *
 * What it found is production's load (common.cuh ld_nc_v4): without L1::no_allocate on the 16-byte loads every
 * kernel runs at 98-100 % of the copy of its bytes (docs/decisions.md, "Streaming loads", with the raw output).
 * Production's load is the variant spelled ld=nc. `bash scripts/device_e2e.sh tuning` builds and runs this file.
 *
 * WHAT IT MEASURES
 *   For fp8_quant_per_token, mxfp8_quant (rceil and floor) and fp8_quant_per_tensor (dynamic; amax pass, cast
 *   pass and both together), bf16 input:
 *   - the PRODUCTION code: the production .cu files are #included (each inside its own wrapper namespace,
 *     prod_tok / prod_mx / prod_pt, so their file-local names do not collide) and their launch_* functions
 *     (or, for the per-tensor passes timed alone, their own kernels) are called as they are;
 *   - VARIANTS written here from the production device helpers (common.cuh: vec_to_float, absmax_vec,
 *     fp8_dynamic_scale, div_fast_ok / div_rn_fast, f32x4_to_e4m3x4, ...; mxfp8_quant.cu: e8m0_code;
 *     fp8_quant_per_tensor.cu: cast_scale, block_max_nan), so the numerics are the production ones; what differs
 *     is only the memory layout / launch shape / cache hints, encoded in the variant's name (legend below);
 *   - a plain device-to-device cudaMemcpyAsync moving the same number of bytes as the op (copy of bytes/2:
 *     bytes/2 read + bytes/2 written) as the ceiling.
 *   Timing is like triton's do_bench: before EVERY timed launch a 256 MB scratch buffer is written with
 *   cudaMemsetAsync (cold L2), each launch is bracketed by cudaEvents, the median of --reps runs (default 60,
 *   minimum 50) is reported, with TB/s = op bytes / median and "%copy" = copy time / op time (the copy measured
 *   in the same run, same bytes). Op bytes (as the benches count them): per-token 2 B read + 1 B written per
 *   element + 4 B per row; mxfp8 2 + 1 per element + 1 per 32 elements; per-tensor (dynamic total and cast
 *   pass) 2 + 1 per element, amax pass 2 per element.
 *   Every variant is first run at 16384x8192; the production kernel and the 5 fastest passing variants are then
 *   also timed at 16384x14336 and 4096x8192.
 *
 * CORRECTNESS (before any timing)
 *   Every variant's output (fp8 bytes AND the per-row scales / E8M0 codes / the per-tensor scale) is compared
 *   BYTE FOR BYTE with the production launcher's output on the same input, on the timed shapes plus small odd
 *   shapes (partial blocks, tails). Inputs (generated on the GPU): N(0,1) with ~1/1024 elements x100; row 0 all
 *   zero; rows 1-4 with NaN / +Inf / -Inf / all three; row 5 whose 32-element blocks span 2^-140 .. 2^9 (bf16
 *   subnormals, MX codes near 0); row 6 all tiny (2^-130: per-token scale floor); row 7 huge (x 2^118); rows 8-9
 *   at the MX rceil boundary (mantissas 1.75 / 1.7578125 / 1.0 / 1.9921875, exponents also near 2^-118).
 *   Per-tensor uses separate inputs (a NaN anywhere makes the whole tensor NaN): plain (+zero row, subnormal
 *   rows), + one +Inf, + one NaN and one -Inf, + the huge row; and the static path with a given scale.
 *   Each variant gets PASS or FAIL (with the first mismatch); a FAIL is printed in the tables as "FAIL" and is
 *   never named fastest. Unsupported shapes for a variant are skipped (not a failure).
 *
 * BUILD AND RUN (from the repository root; sm_90a only)
 *   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I plugin/csrc benchmarks/tuning/quant_sweep.cu \
 *        -o /tmp/quant_sweep
 *   /tmp/quant_sweep                 # all three ops, 60 reps; ~10-30 s on an H200, needs ~3 GB of GPU memory
 *   /tmp/quant_sweep --reps 100 --ops tok,mx,pt      # options: --reps N (>= 50), --ops any of tok,mx,pt
 *   Exit code: 0 when every variant passed, 1 when any FAIL, 2 on a CUDA error.
 *
 * READING THE OUTPUT
 *   One table per op (and per shape), sorted by median time. Columns: us, TB/s, %copy, regs (registers per
 *   thread from cudaFuncGetAttributes), occ (resident blocks per SM from the occupancy API), thr (threads per
 *   block at that shape), check (PASS / FAIL). The production row is marked "<== PRODUCTION"; "copy" is the
 *   ceiling row. The last lines ("BEST ...") name, per op, the fastest PASSING variant at 16384x8192 and its
 *   speedup over production (production / variant time). For per-tensor there are three tables: the amax pass
 *   alone, the cast pass alone (dynamic mode: it reduces the amax partials of the production amax pass), and
 *   the dynamic total (production launcher vs. amax variant + cast variant pairs; the fastest amax variant is
 *   combined with every cast variant, plus production amax + the 5 best casts).
 *
 * VARIANT NAME LEGEND
 *   per-token  "tok vV rR wW ld=L st=S lb=T/B [pf=P]": V 16-byte vectors per thread held across the row's
 *              reduction; R rows per block (threads per row = ceil(vectors / V) rounded up to a warp; a block
 *              has R x that many threads); w8 = 8-byte fp8 stores (one vector per store), w16 = each thread owns
 *              2 ADJACENT 16-byte vectors and writes 16 fp8 bytes at once; lb = __launch_bounds__(T, B);
 *              pf = thread 0 of each row issues cp.async.bulk.prefetch.L2 for the row P rows ahead.
 *   mxfp8      "mx tT uU wW ld st lb pf": T threads, U units (16 B, or 32 B for w16) per thread in flight,
 *              one-shot grid; pf = thread 0 prefetches (bulk, to L2) the block P blocks ahead.
 *   per-tensor "cast tT uU wW ld st lb pf" (one-shot grid of contiguous blocks, as production), "row ..."
 *              (vLLM's static-kernel layout: one block of 256 threads per row, a loop over 32-byte units, load
 *              -> convert -> 16-byte store per iteration), "amax tT uU ld bpsB [chunk]" (persistent grid of
 *              B blocks per SM, grid-stride, or one contiguous chunk per block).
 *   ld: nc_na = ld.global.nc.L1::no_allocate, nc_na_L2_256 = same + .L2::256B prefetch,
 *       nc_L2_128 = ld.global.nc.L2::128B, nc = ld.global.nc (production's), plain = ld.global, cs = ld.global.cs,
 *       nc_na_ef = nc_na with an L2 evict_first cache policy, cxx = a plain C++ dereference (compiler's choice).
 *   st: cs = st.global.cs (production), wb = st.global (default write-back), ef = st.global with an L2
 *       evict_first cache policy, cxx = plain C++ store.
 */
#define CUBLADE_KERNELS_ONLY
#include "common.cuh"
#include "harness.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

// ---- the production code, each file in its own namespace (file-local names such as kThreads collide) ------------
// common.cuh is already included (#pragma once), so these see ::cublade's helpers through the using-directive.
namespace prod_tok {
using namespace ::cublade;
#include "fp8_quant_per_token.cu"
}  // namespace prod_tok
namespace prod_mx {
using namespace ::cublade;
#include "mxfp8_quant.cu"
}  // namespace prod_mx
namespace prod_pt {
using namespace ::cublade;
#include "fp8_quant_per_tensor.cu"
}  // namespace prod_pt


namespace sweep {
using namespace ::cublade;
constexpr InDtype BF = InDtype::kBF16;
using E = __nv_bfloat16;
constexpr int N = Elem<BF>::kPerVec;  // 8 bf16 per 16-byte vector

// ---- load / store flavours -----------------------------------------------------------------------------------------
enum class LH : int { NcNa, NcNaL2_256, NcL2_128, Nc, Plain, Cs, NcNaEF, Cxx };
enum class SH : int { Cs, Wb, EF, Cxx };
inline const char* lh_name(LH l) {
  switch (l) {
    case LH::NcNa: return "nc_na";
    case LH::NcNaL2_256: return "nc_na_L2_256";
    case LH::NcL2_128: return "nc_L2_128";
    case LH::Nc: return "nc";
    case LH::Plain: return "plain";
    case LH::Cs: return "cs";
    case LH::NcNaEF: return "nc_na_ef";
    case LH::Cxx: return "cxx";
  }
  return "?";
}
inline const char* sh_name(SH s) {
  switch (s) {
    case SH::Cs: return "cs";
    case SH::Wb: return "wb";
    case SH::EF: return "ef";
    case SH::Cxx: return "cxx";
  }
  return "?";
}

template <LH L>
__device__ __forceinline__ uint4 ld16(const void* p) {
  uint4 v;
  if constexpr (L == LH::NcNa) {
    // with the L1::no_allocate hint (production's ld_nc_v4 is LH::Nc: the hint cost 6-10 %)
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else if constexpr (L == LH::NcNaL2_256) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else if constexpr (L == LH::NcL2_128) {
    asm volatile("ld.global.nc.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else if constexpr (L == LH::Nc) {
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else if constexpr (L == LH::Plain) {
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else if constexpr (L == LH::Cs) {
    v = ld_cs_v4(p);
  } else if constexpr (L == LH::NcNaEF) {
    asm volatile(
        "{ .reg .b64 pol;\n"
        "  createpolicy.fractional.L2::evict_first.b64 pol, 1.0;\n"
        "  ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], pol; }"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else {
    v = *static_cast<const uint4*>(p);
  }
  return v;
}

template <SH S>
__device__ __forceinline__ void st16(void* p, uint4 v) {
  if constexpr (S == SH::Cs) {
    st_cs_v4(p, v);
  } else if constexpr (S == SH::Wb) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
  } else if constexpr (S == SH::EF) {
    asm volatile(
        "{ .reg .b64 pol;\n"
        "  createpolicy.fractional.L2::evict_first.b64 pol, 1.0;\n"
        "  st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, pol; }" ::"l"(p),
        "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
  } else {
    *static_cast<uint4*>(p) = v;
  }
}
template <SH S>
__device__ __forceinline__ void st8(void* p, uint2 v) {
  if constexpr (S == SH::Cs) {
    st_cs_v2(p, v);
  } else if constexpr (S == SH::Wb) {
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
  } else if constexpr (S == SH::EF) {
    asm volatile(
        "{ .reg .b64 pol;\n"
        "  createpolicy.fractional.L2::evict_first.b64 pol, 1.0;\n"
        "  st.global.L2::cache_hint.v2.u32 [%0], {%1, %2}, pol; }" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
  } else {
    *static_cast<uint2*>(p) = v;
  }
}

// Bulk prefetch of `bytes` (multiple of 16, 16-byte aligned) into L2 (sm_90).
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// Thread 0 has the bulk engine prefetch into L2 what block (blockIdx.x + pf_blocks) will read: units_per_block
// units of unit_elems contiguous elements each (clipped at nunit).
__device__ __forceinline__ void prefetch_block_ahead(const E* x, int64_t nunit, int units_per_block, int unit_elems,
                                                     int pf_blocks) {
  if (threadIdx.x != 0) return;
  const int64_t start = (static_cast<int64_t>(blockIdx.x) + pf_blocks) * units_per_block;
  if (start < nunit) {
    const int64_t units = min(static_cast<int64_t>(units_per_block), nunit - start);
    prefetch_l2(x + start * unit_elems, static_cast<uint32_t>(units * unit_elems * sizeof(E)));
  }
}

// W adjacent 16-byte bf16 vectors -> W*8 fp8 bytes at dst (one 8- or 16-byte store), op applied per element (fp32).
template <int W, SH S, typename Op>
__device__ __forceinline__ void cvt_store(const uint4* v, uint8_t* dst, Op op) {
  float f[W * N];
#pragma unroll
  for (int w = 0; w < W; ++w) vec_to_float<BF>(v[w], *reinterpret_cast<float(*)[N]>(&f[w * N]));
#pragma unroll
  for (int i = 0; i < W * N; ++i) f[i] = op(f[i]);
  if constexpr (W == 1) {
    st8<S>(dst, make_uint2(f32x4_to_e4m3x4(f[0], f[1], f[2], f[3]), f32x4_to_e4m3x4(f[4], f[5], f[6], f[7])));
  } else {
    static_assert(W == 2, "W is 1 or 2");
    st16<S>(dst, make_uint4(f32x4_to_e4m3x4(f[0], f[1], f[2], f[3]), f32x4_to_e4m3x4(f[4], f[5], f[6], f[7]),
                            f32x4_to_e4m3x4(f[8], f[9], f[10], f[11]), f32x4_to_e4m3x4(f[12], f[13], f[14], f[15])));
  }
}

inline int rup32(int64_t v) { return static_cast<int>((v + 31) / 32 * 32); }

// =====================================================================================================================
// fp8_quant_per_token variants. Numerics = production's per_token_vec_kernel (fp8_dynamic_scale; per element
// div_rn_fast when div_fast_ok(s), else __fdiv_rn; satfinite e4m3).
// =====================================================================================================================
template <int VPT, int RPB, int W, LH L, SH S, int MAXT, int MINB, bool PF>
__global__ void __launch_bounds__(MAXT, MINB)
tok_kernel(const E* __restrict__ x, int64_t M, int nvec, int64_t row_stride, uint8_t* __restrict__ q, int64_t K,
           float* __restrict__ scale, int tpr, int pf_rows) {
  constexpr int U = VPT / W;  // units (W adjacent vectors) per thread
  static_assert(U * W == VPT, "VPT % W");
  const int grp = static_cast<int>(threadIdx.x) / tpr;
  const int t = static_cast<int>(threadIdx.x) - grp * tpr;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * RPB + grp;
  const bool live = row < M;
  const int nunit = nvec / W;
  const E* xr = x + (live ? row : 0) * row_stride;
  if constexpr (PF) {
    if (t == 0 && live && row + pf_rows < M) prefetch_l2(x + (row + pf_rows) * row_stride, static_cast<uint32_t>(nvec) * 16u);
  }
  uint4 v[VPT];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int idx = t + u * tpr;
#pragma unroll
    for (int w = 0; w < W; ++w)
      v[u * W + w] = (live && idx < nunit) ? ld16<L>(xr + static_cast<int64_t>(idx * W + w) * N) : make_uint4(0, 0, 0, 0);
  }
  uint32_t acc = 0;
#pragma unroll
  for (int i = 0; i < VPT; ++i) acc = absmax_vec<BF>(acc, v[i]);
  float amax = warp_max_nan(absmax_finish<BF>(acc));
  if (tpr > 32) {
    __shared__ float wm[MAXT / 32];
    if ((threadIdx.x & 31) == 0) wm[threadIdx.x >> 5] = amax;
    __syncthreads();
    const int wpr = tpr >> 5;
    amax = wm[grp * wpr];
    for (int w = 1; w < wpr; ++w) amax = max_nan(amax, wm[grp * wpr + w]);
  }
  if (!live) return;
  const float s = fp8_dynamic_scale(amax);
  if (t == 0) scale[row] = s;
  uint8_t* qr = q + row * K;
  if (div_fast_ok(s)) {
    const float y = __frcp_rn(s);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int idx = t + u * tpr;
      if (idx < nunit)
        cvt_store<W, S>(&v[u * W], qr + static_cast<int64_t>(idx) * W * N, [s, y](float a) { return div_rn_fast(a, s, y); });
    }
  } else {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int idx = t + u * tpr;
      if (idx < nunit) cvt_store<W, S>(&v[u * W], qr + static_cast<int64_t>(idx) * W * N, [s](float a) { return __fdiv_rn(a, s); });
    }
  }
}

// =====================================================================================================================
// mxfp8_quant variants. Numerics = production's mx_quant_kernel (NaN-propagating block max, prod_mx e8m0_code,
// x * 2^-e exact, satfinite e4m3). A unit = W adjacent 16-byte vectors; G = lanes per 32-element MX block.
// =====================================================================================================================
template <bool R, int THR, int UNR, int W, LH L, SH S, int MINB, bool PF>
__global__ void __launch_bounds__(THR, MINB)
mx_kernel(const E* __restrict__ x, int64_t nunit, uint8_t* __restrict__ q, uint8_t* __restrict__ codes, int pf_blocks) {
  constexpr int EU = N * W;       // elements per unit
  constexpr int G = 32 / EU;      // lanes per MX block
  const int64_t base = static_cast<int64_t>(blockIdx.x) * (THR * UNR) + threadIdx.x;
  if constexpr (PF) prefetch_block_ahead(x, nunit, THR * UNR, EU, pf_blocks);
  uint4 v[UNR * W];
#pragma unroll
  for (int u = 0; u < UNR; ++u) {
    const int64_t i = base + u * THR;
#pragma unroll
    for (int w = 0; w < W; ++w) v[u * W + w] = i < nunit ? ld16<L>(x + i * EU + w * N) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int u = 0; u < UNR; ++u) {
    const int64_t i = base + u * THR;
    uint32_t acc = 0;
#pragma unroll
    for (int w = 0; w < W; ++w) acc = absmax_vec<BF>(acc, v[u * W + w]);
    float amax = absmax_finish<BF>(acc);
#pragma unroll
    for (int o = 1; o < G; o <<= 1) amax = max_nan(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    if (i < nunit) {
      float inv;
      const uint8_t code = prod_mx::cublade::e8m0_code<R>(amax, inv);
      if ((threadIdx.x & (G - 1)) == 0) codes[i / G] = code;
      cvt_store<W, S>(&v[u * W], q + i * EU, [inv](float a) { return __fmul_rn(a, inv); });
    }
  }
}

// =====================================================================================================================
// fp8_quant_per_tensor variants. Cast numerics = production's (prod_pt cast_scale: reduce the partials,
// fp8_dynamic_scale, or the static scale; inv = __frcp_rn(s); q = e4m3(x * inv)).
// =====================================================================================================================
template <int THR, int UPT, int W, LH L, SH S, int MINB, bool PF>
__global__ void __launch_bounds__(THR, MINB)
cast_kernel(const E* __restrict__ x, int64_t nvec, int64_t n, uint8_t* __restrict__ q, const float* __restrict__ partials,
            int nparts, const float* __restrict__ static_scale, float* __restrict__ scale_out, int pf_blocks) {
  __shared__ float smem[THR / 32];
  const int64_t nunit = nvec / W;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * (THR * UPT) + threadIdx.x;
  if constexpr (PF) prefetch_block_ahead(x, nunit, THR * UPT, W * N, pf_blocks);
  uint4 v[UPT * W];  // as production: left unset past the end (never used there)
#pragma unroll
  for (int u = 0; u < UPT; ++u) {
    const int64_t p = base + u * THR;
    if (p < nunit) {
#pragma unroll
      for (int w = 0; w < W; ++w) v[u * W + w] = ld16<L>(x + (p * W + w) * N);
    }
  }
  const float inv = __frcp_rn(prod_pt::cublade::cast_scale(partials, nparts, static_scale, scale_out, smem));
#pragma unroll
  for (int u = 0; u < UPT; ++u) {
    const int64_t p = base + u * THR;
    if (p < nunit) cvt_store<W, S>(&v[u * W], q + p * W * N, [inv](float a) { return __fmul_rn(a, inv); });
  }
  if (blockIdx.x == gridDim.x - 1)  // as production: the vectors past the last whole unit and the scalar tail
    for (int64_t e = nunit * W * N + threadIdx.x; e < n; e += blockDim.x)
      q[e] = f32_to_e4m3(__fmul_rn(Elem<BF>::to_float(x[e]), inv));
}

// vLLM's static-kernel layout: one 256-thread block per row, loop over 32-byte units (load, convert, 16-byte store).
template <LH L, SH S>
__global__ void __launch_bounds__(256)
cast_row_kernel(const E* __restrict__ x, int64_t K, uint8_t* __restrict__ q, const float* __restrict__ partials, int nparts,
                const float* __restrict__ static_scale, float* __restrict__ scale_out) {
  __shared__ float smem[256 / 32];
  const float inv = __frcp_rn(prod_pt::cublade::cast_scale(partials, nparts, static_scale, scale_out, smem));
  const E* xr = x + static_cast<int64_t>(blockIdx.x) * K;
  uint8_t* qr = q + static_cast<int64_t>(blockIdx.x) * K;
  const int nunit = static_cast<int>(K / (2 * N));
  for (int i = threadIdx.x; i < nunit; i += blockDim.x) {
    uint4 v[2];
    v[0] = ld16<L>(xr + static_cast<int64_t>(i) * 2 * N);
    v[1] = ld16<L>(xr + static_cast<int64_t>(i) * 2 * N + N);
    cvt_store<2, S>(v, qr + static_cast<int64_t>(i) * 2 * N, [inv](float a) { return __fmul_rn(a, inv); });
  }
}

// amax pass: grid-stride (as production) or one contiguous chunk per block; one partial per block.
template <int THR, int UNR, LH L, bool CHUNK>
__global__ void __launch_bounds__(THR)
amax_kernel(const E* __restrict__ x, int64_t nvec, int64_t n, float* __restrict__ partials) {
  __shared__ float smem[THR / 32];
  uint32_t acc = 0;
  int64_t i, end, stride;
  if constexpr (CHUNK) {
    const int64_t chunk = (nvec + gridDim.x - 1) / gridDim.x;
    i = static_cast<int64_t>(blockIdx.x) * chunk + threadIdx.x;
    end = min(nvec, static_cast<int64_t>(blockIdx.x + 1) * chunk);
    stride = THR;
  } else {
    i = static_cast<int64_t>(blockIdx.x) * THR + threadIdx.x;
    end = nvec;
    stride = static_cast<int64_t>(gridDim.x) * THR;
  }
  for (; i + (UNR - 1) * stride < end; i += UNR * stride) {
    uint4 v[UNR];
#pragma unroll
    for (int u = 0; u < UNR; ++u) v[u] = ld16<L>(x + (i + u * stride) * N);
#pragma unroll
    for (int u = 0; u < UNR; ++u) acc = absmax_vec<BF>(acc, v[u]);
  }
  for (; i < end; i += stride) acc = absmax_vec<BF>(acc, ld16<L>(x + i * N));
  float m = absmax_finish<BF>(acc);
  if (blockIdx.x == 0)
    for (int64_t e = nvec * N + threadIdx.x; e < n; e += blockDim.x) m = max_nan(m, fabsf(Elem<BF>::to_float(x[e])));
  m = prod_pt::cublade::block_max_nan(m, smem);
  if (threadIdx.x == 0) partials[blockIdx.x] = m;
}

// =====================================================================================================================
// Test data and comparison
// =====================================================================================================================
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
enum : int {
  kZeroRow = 1,       // row 0 all zero
  kNanInfRows = 2,    // rows 1-4: NaN / +Inf / -Inf / all three
  kTinyRows = 4,      // row 5 spans 2^-140..2^9 per 32-block, row 6 tiny, rows 8-9 MX rceil boundary mantissas
  kHugeRow = 8,       // row 7 x 2^118
  kOnePosInf = 16,    // one +Inf at (M/2, 3)
  kOneNanNegInf = 32  // NaN at (M-1, K-1), -Inf at (M/3, 1)
};
__global__ void gen_kernel(E* x, int64_t M, int64_t K, uint64_t seed, int flags) {
  const int64_t n = M * K;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = e / K, k = e % K;
    const uint64_t h = mix64(seed ^ (static_cast<uint64_t>(e) * 0x100000001B3ull));
    const float u1 = (static_cast<float>(h >> 40) + 1.0f) * 0x1p-24f;               // (0, 1]
    const float u2 = static_cast<float>((h >> 16) & 0xFFFFFF) * 0x1p-24f;           // [0, 1)
    float v = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    if ((h & 1023) == 0) v *= 100.0f;
    const float sgn = (h & 0x8000) ? -1.0f : 1.0f;
    if ((flags & kZeroRow) && row == 0) v = 0.0f;
    if ((flags & kNanInfRows) && M > 4) {
      if (row == 1 && k == 17 % K) v = __int_as_float(0x7FC00000);
      if (row == 2 && k == K - 1) v = INFINITY;
      if (row == 3 && k == 5 % K) v = -INFINITY;
      if (row == 4 && k == 0) v = __int_as_float(0x7FC00000);
      if (row == 4 && k == K / 2) v = INFINITY;
      if (row == 4 && k == K / 3 && K / 3 != K / 2 && K / 3 != 0) v = -INFINITY;
    }
    if ((flags & kTinyRows) && M > 9) {
      const int blk = static_cast<int>(k / 32);
      if (row == 5) v = sgn * (1.0f + u2) * exp2f(static_cast<float>(-140 + (blk % 150)));
      if (row == 6) v = v * 0x1p-130f;
      if (row == 8 || row == 9) {
        const float m4[5] = {1.75f, 1.7578125f, 1.0f, 1.9921875f, 1.5f};
        const int ex = row == 8 ? (blk % 40) - 20 : -126 + (blk % 17);
        v = sgn * m4[(h >> 20) % 5] * exp2f(static_cast<float>(ex));
      }
    }
    if ((flags & kHugeRow) && M > 7 && row == 7) v = v * 0x1p118f;
    if ((flags & kOnePosInf) && row == M / 2 && k == 3 % K) v = INFINITY;
    if ((flags & kOneNanNegInf) && row == M - 1 && k == K - 1) v = __int_as_float(0x7FC00000);
    if ((flags & kOneNanNegInf) && row == M / 3 && k == 1 % K && !(row == M - 1 && k == K - 1)) v = -INFINITY;
    x[e] = __float2bfloat16_rn(v);
  }
}

__global__ void cmp_kernel(const uint8_t* a, const uint8_t* b, int64_t n, unsigned long long* nbad, unsigned long long* first) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    if (a[i] != b[i]) {
      atomicAdd(nbad, 1ull);
      atomicMin(first, static_cast<unsigned long long>(i));
    }
}

// =====================================================================================================================
// Host side
// =====================================================================================================================
struct Bufs {
  E* x = nullptr;
  uint8_t* q = nullptr;
  uint8_t* q_ref = nullptr;
  float* scale = nullptr;      // per-token scales / per-tensor scale_out; mx codes use `codes`
  float* scale_ref = nullptr;
  uint8_t* codes = nullptr;
  uint8_t* codes_ref = nullptr;
  float* ws = nullptr;         // amax partials (variant amax)
  float* ws_prod = nullptr;    // production workspace
  float* static_scale = nullptr;
  void* flush = nullptr;
  void* cp_src = nullptr;
  void* cp_dst = nullptr;
  unsigned long long* cmp = nullptr;  // [nbad, first]
  int num_sms = 0;
  cudaStream_t st = nullptr;
};
Bufs B;
int g_reps = 60;
int g_prod_amax_grid = 0;  // set per shape
constexpr size_t kFlushBytes = 256ull << 20;

// The production launchers' arguments on B's buffers, x a contiguous bf16 [M, K].
cublade::Fp8QuantPerTokenArgs tok_args(int64_t M, int64_t K) {
  cublade::Fp8QuantPerTokenArgs a;
  a.x = B.x; a.dtype = BF; a.M = M; a.K = K; a.row_stride = K; a.col_stride = 1;
  a.q = B.q; a.scale = B.scale;
  return a;
}
cublade::Mxfp8QuantArgs mx_args(int64_t M, int64_t K, bool rceil) {
  cublade::Mxfp8QuantArgs a;
  a.x = B.x; a.dtype = BF; a.M = M; a.K = K; a.row_stride = K; a.col_stride = 1; a.rceil = rceil;
  a.q = B.q; a.codes = B.codes;
  return a;
}
cublade::Fp8QuantPerTensorArgs pt_args(int64_t M, int64_t K, const float* static_scale) {
  cublade::Fp8QuantPerTensorArgs a;
  a.x = B.x; a.dtype = BF; a.M = M; a.K = K; a.row_stride = K; a.col_stride = 1;
  a.q = B.q; a.static_scale = static_scale; a.scale_out = B.scale; a.workspace = B.ws_prod; a.num_sms = B.num_sms;
  return a;
}

// A variant's name: "<head> w<bits> ld=<load> st=<store> lb=<launch bounds: max threads>/<min blocks>[ pf=<n>]".
inline std::string variant_name(const std::string& head, int W, LH l, SH s, int max_threads, int min_blocks, bool pf,
                                int pf_n) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s w%d ld=%s st=%s lb=%d/%d%s", head.c_str(), W * 8, lh_name(l), sh_name(s),
                max_threads, min_blocks, pf ? (" pf=" + std::to_string(pf_n)).c_str() : "");
  return buf;
}

struct Variant {
  std::string name;
  bool prod = false;
  std::function<bool(int64_t, int64_t)> ok;              // supports [M, K]
  std::function<int(int64_t, int64_t)> threads;          // threads per block at [M, K]
  std::function<const void*(int64_t, int64_t)> fn;       // kernel (for regs / occupancy), may be null
  std::function<cudaError_t(int64_t, int64_t)> run;      // launches on B.st
  bool pass = true;
  std::string why;
};

struct Row {
  std::string name;
  double us;
  bool prod, pass, is_copy;
  int regs, occ, thr;
};

// do_bench-like: L2 flush (256 MB memset) before every launch, events around the launch, median in us.
double time_us(const std::function<cudaError_t()>& f) {
  return harness::time_us(f, harness::memset_flush(B.flush, kFlushBytes, B.st), g_reps, B.st);
}

double time_copy_us(size_t bytes) {  // copy of bytes/2: bytes/2 read + bytes/2 written
  const size_t half = (bytes / 2 + 255) / 256 * 256;
  return time_us([half]() { return cudaMemcpyAsync(B.cp_dst, B.cp_src, half, cudaMemcpyDeviceToDevice, B.st); });
}

void gen(int64_t M, int64_t K, int flags, uint64_t seed = 1234) {
  gen_kernel<<<B.num_sms * 16, 256, 0, B.st>>>(B.x, M, K, seed, flags);
  CK(cudaGetLastError());
}

// Returns the number of mismatching bytes (first mismatch index in *first).
unsigned long long compare(const void* a, const void* b, int64_t n, unsigned long long* first) {
  unsigned long long h[2] = {0ull, ~0ull};
  CK(cudaMemcpyAsync(B.cmp, h, sizeof(h), cudaMemcpyHostToDevice, B.st));
  if (n > 0) {
    cmp_kernel<<<B.num_sms * 8, 256, 0, B.st>>>(static_cast<const uint8_t*>(a), static_cast<const uint8_t*>(b), n, B.cmp,
                                                B.cmp + 1);
    CK(cudaGetLastError());
  }
  CK(cudaMemcpyAsync(h, B.cmp, sizeof(h), cudaMemcpyDeviceToHost, B.st));
  CK(cudaStreamSynchronize(B.st));
  *first = h[1];
  return h[0];
}

void kernel_info(const void* fn, int threads, int* regs, int* occ) {
  *regs = -1;
  *occ = -1;
  if (fn == nullptr) return;
  cudaFuncAttributes a;
  if (cudaFuncGetAttributes(&a, fn) == cudaSuccess) *regs = a.numRegs;
  int nb = 0;
  if (threads > 0 && cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, fn, threads, 0) == cudaSuccess) *occ = nb;
  cudaGetLastError();
}

void print_table(const std::string& title, std::vector<Row> rows, size_t bytes, double copy_us) {
  rows.push_back(Row{"copy (cudaMemcpyAsync D2D, same bytes)", copy_us, false, true, true, -1, -1, 0});
  std::stable_sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) { return a.us < b.us; });
  std::printf("\n== %s | bytes %.1f MB | copy %.1f us = %.2f TB/s ==\n", title.c_str(), bytes / 1e6, copy_us,
              bytes / copy_us * 1e-6);
  std::printf("%-4s %-62s %9s %6s %6s %5s %4s %5s %-5s\n", "#", "variant", "us", "TB/s", "%copy", "regs", "occ", "thr",
              "check");
  int rank = 0;
  for (const Row& r : rows) {
    char regs[16], occ[16], thr[16];
    std::snprintf(regs, sizeof regs, r.regs >= 0 ? "%d" : "-", r.regs);
    std::snprintf(occ, sizeof occ, r.occ >= 0 ? "%d" : "-", r.occ);
    std::snprintf(thr, sizeof thr, r.thr > 0 ? "%d" : "-", r.thr);
    std::printf("%-4d %-62s %9.1f %6.2f %5.1f%% %5s %4s %5s %-5s%s\n", ++rank, r.name.c_str(), r.us, bytes / r.us * 1e-6,
                100.0 * copy_us / r.us, regs, occ, thr, r.is_copy ? "" : (r.pass ? "PASS" : "FAIL"),
                r.prod ? "  <== PRODUCTION" : (r.pass ? "" : "  !!! FAILED BYTE CHECK"));
  }
}

Row time_variant(const Variant& v, int64_t M, int64_t K) {
  Row r{v.name, 0.0, v.prod, v.pass, false, -1, -1, 0};
  r.thr = v.threads ? v.threads(M, K) : 0;
  kernel_info(v.fn ? v.fn(M, K) : nullptr, r.thr, &r.regs, &r.occ);
  r.us = time_us([&]() { return v.run(M, K); });
  return r;
}

void fail(Variant& v, const char* what, int64_t M, int64_t K, const char* data, unsigned long long nbad,
          unsigned long long first) {
  if (!v.pass) return;  // keep the first reason
  v.pass = false;
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s differs at %lldx%lld (%s): %llu bytes, first at %llu", what,
                static_cast<long long>(M), static_cast<long long>(K), data, nbad, first);
  v.why = buf;
}

// Which variants go on to the other shapes: production + the `n` fastest passing ones.
std::vector<int> pick_top(const std::vector<Variant>& vs, const std::vector<double>& us, int n) {
  std::vector<int> idx;
  for (int i = 0; i < static_cast<int>(vs.size()); ++i)
    if (!vs[i].prod && vs[i].pass && us[i] > 0) idx.push_back(i);
  std::sort(idx.begin(), idx.end(), [&](int a, int b) { return us[a] < us[b]; });
  if (static_cast<int>(idx.size()) > n) idx.resize(n);
  for (int i = 0; i < static_cast<int>(vs.size()); ++i)
    if (vs[i].prod) idx.insert(idx.begin(), i);
  return idx;
}

std::vector<std::string> g_best_lines;
bool g_any_fail = false;

void report_checks(const char* op, const std::vector<Variant>& vs) {
  int nf = 0;
  for (const Variant& v : vs)
    if (!v.pass) ++nf;
  std::printf("\n-- %s: byte checks of %zu variants vs production: %d FAIL --\n", op, vs.size() - 1, nf);
  for (const Variant& v : vs)
    if (!v.prod) std::printf("   %s  %s%s%s\n", v.pass ? "PASS" : "FAIL", v.name.c_str(), v.pass ? "" : "  : ", v.why.c_str());
  if (nf) g_any_fail = true;
}

void best_line(const char* op, const std::vector<Variant>& vs, const std::vector<double>& us) {
  int best = -1, prod = -1;
  for (int i = 0; i < static_cast<int>(vs.size()); ++i) {
    if (vs[i].prod) prod = i;
    else if (vs[i].pass && us[i] > 0 && (best < 0 || us[i] < us[best])) best = i;
  }
  char buf[512];
  if (best < 0 || prod < 0) {
    std::snprintf(buf, sizeof buf, "BEST %s: no passing variant", op);
  } else {
    std::snprintf(buf, sizeof buf, "BEST %s @16384x8192: %s  %.1f us vs production %.1f us  (speedup %.3fx)%s", op,
                  vs[best].name.c_str(), us[best], us[prod], us[prod] / us[best],
                  us[best] < us[prod] ? "" : "  [production is fastest]");
  }
  g_best_lines.push_back(buf);
}

const int64_t kMainM = 16384, kMainK = 8192;
const int64_t kOtherShapes[2][2] = {{16384, 14336}, {4096, 8192}};

// Times every variant that supports the main shape, prints its table, then times production and the 5 fastest
// passing variants at kOtherShapes (tables too), and prints the op's BEST line. bytes_of: the op's bytes for [M, K].
void time_op(const std::string& op, const std::vector<Variant>& vs, size_t (*bytes_of)(int64_t, int64_t)) {
  gen(kMainM, kMainK, kZeroRow | kNanInfRows | kTinyRows | kHugeRow);
  std::vector<double> us(vs.size(), -1.0);
  std::vector<Row> rows;
  const double cu = time_copy_us(bytes_of(kMainM, kMainK));
  for (size_t i = 0; i < vs.size(); ++i) {
    if (!vs[i].ok(kMainM, kMainK)) continue;
    Row r = time_variant(vs[i], kMainM, kMainK);
    us[i] = r.us;
    rows.push_back(r);
  }
  print_table(op + " bf16 16384x8192", rows, bytes_of(kMainM, kMainK), cu);
  const std::vector<int> top = pick_top(vs, us, 5);
  for (const auto& s : kOtherShapes) {
    const int64_t M = s[0], K = s[1];
    gen(M, K, kZeroRow | kNanInfRows | kTinyRows | kHugeRow);
    std::vector<Row> rs;
    const double c = time_copy_us(bytes_of(M, K));
    for (int i : top)
      if (vs[i].ok(M, K)) rs.push_back(time_variant(vs[i], M, K));
    print_table(op + " bf16 " + std::to_string(M) + "x" + std::to_string(K), rs, bytes_of(M, K), c);
  }
  best_line(op.c_str(), vs, us);
}

// ---------------------------------------------------------------------------------------------------------------------
// per-token
// ---------------------------------------------------------------------------------------------------------------------
template <int VPT, int RPB, int W, LH L, SH S, int MAXT = 1024, int MINB = 1, bool PF = false>
Variant make_tok(int pf_rows = 0) {
  Variant v;
  v.name = variant_name("tok v" + std::to_string(VPT) + " r" + std::to_string(RPB), W, L, S, MAXT, MINB, PF, pf_rows);
  auto tpr_of = [](int64_t K) { return rup32((K / N / W + VPT / W - 1) / (VPT / W)); };
  v.threads = [tpr_of](int64_t, int64_t K) { return tpr_of(K) * RPB; };
  v.ok = [tpr_of](int64_t, int64_t K) { return K % (N * W) == 0 && tpr_of(K) * RPB <= MAXT; };
  v.fn = [](int64_t, int64_t) { return reinterpret_cast<const void*>(&tok_kernel<VPT, RPB, W, L, S, MAXT, MINB, PF>); };
  v.run = [tpr_of, pf_rows](int64_t M, int64_t K) {
    const int tpr = tpr_of(K);
    tok_kernel<VPT, RPB, W, L, S, MAXT, MINB, PF><<<static_cast<unsigned>((M + RPB - 1) / RPB), tpr * RPB, 0, B.st>>>(
        B.x, M, static_cast<int>(K / N), K, B.q, K, B.scale, tpr, pf_rows);
    return cudaGetLastError();
  };
  return v;
}

std::vector<Variant> tok_variants() {
  std::vector<Variant> vs;
  Variant p;
  p.name = "production launch_fp8_quant_per_token";
  p.prod = true;
  p.ok = [](int64_t, int64_t) { return true; };
  p.threads = [](int64_t, int64_t K) {
    const int64_t nvec = K / N;
    if (nvec <= 256) return 256;
    return (nvec + 3) / 4 <= 256 ? rup32((nvec + 3) / 4) : rup32((nvec + 7) / 8);
  };
  p.fn = [](int64_t, int64_t K) -> const void* {
    const int64_t nvec = K / N;
    if (nvec <= 256 || K % N) return nullptr;
    if ((nvec + 3) / 4 <= 256) return reinterpret_cast<const void*>(&prod_tok::cublade::per_token_vec_kernel<BF, 4, false>);
    return reinterpret_cast<const void*>(&prod_tok::cublade::per_token_vec_kernel<BF, 8, false>);
  };
  p.run = [](int64_t M, int64_t K) {
    return prod_tok::cublade::launch_fp8_quant_per_token(tok_args(M, K), B.st);
  };
  vs.push_back(p);
  // production's layout re-built from the variant template (sanity: should time like production at K = 4096 / 8192);
  // lb=512/3 caps registers at 42 (production's VPT=4 kernel uses 42: 6 blocks of 256 per SM; lb=1024/1 gives 46: 5)
  vs.push_back(make_tok<4, 1, 1, LH::NcNa, SH::Cs>());
  vs.push_back(make_tok<4, 1, 1, LH::NcNa, SH::Cs, 512, 3>());
  // load hints
  vs.push_back(make_tok<4, 1, 1, LH::NcNaL2_256, SH::Cs, 512, 3>());
  vs.push_back(make_tok<4, 1, 1, LH::NcL2_128, SH::Cs, 512, 3>());
  vs.push_back(make_tok<4, 1, 1, LH::Nc, SH::Cs, 512, 3>());
  vs.push_back(make_tok<4, 1, 1, LH::Plain, SH::Cs, 512, 3>());
  vs.push_back(make_tok<4, 1, 1, LH::Cs, SH::Cs, 512, 3>());
  vs.push_back(make_tok<4, 1, 1, LH::NcNaEF, SH::Cs, 512, 3>());
  // store hints
  vs.push_back(make_tok<4, 1, 1, LH::NcNa, SH::Wb, 512, 3>());
  vs.push_back(make_tok<4, 1, 1, LH::NcNa, SH::EF, 512, 3>());
  vs.push_back(make_tok<4, 1, 1, LH::Plain, SH::Wb, 512, 3>());
  vs.push_back(make_tok<4, 1, 1, LH::Nc, SH::Wb, 512, 3>());
  vs.push_back(make_tok<4, 1, 1, LH::NcNaL2_256, SH::Wb, 512, 3>());
  // 16-byte stores (each thread 2 adjacent vectors)
  vs.push_back(make_tok<4, 1, 2, LH::NcNa, SH::Cs, 512, 3>());
  vs.push_back(make_tok<4, 1, 2, LH::NcNa, SH::Wb, 512, 3>());
  vs.push_back(make_tok<4, 1, 2, LH::NcNaL2_256, SH::Wb, 512, 3>());
  vs.push_back(make_tok<8, 1, 2, LH::NcNa, SH::Cs>());
  vs.push_back(make_tok<8, 1, 2, LH::NcNa, SH::Wb>());
  vs.push_back(make_tok<2, 1, 2, LH::NcNa, SH::Cs>());
  // threads per row / vectors per thread
  vs.push_back(make_tok<2, 1, 1, LH::NcNa, SH::Cs>());
  vs.push_back(make_tok<8, 1, 1, LH::NcNa, SH::Cs>());
  vs.push_back(make_tok<8, 1, 1, LH::NcNa, SH::Wb>());
  // rows per block
  vs.push_back(make_tok<4, 2, 1, LH::NcNa, SH::Cs>());
  vs.push_back(make_tok<8, 2, 1, LH::NcNa, SH::Cs>());
  vs.push_back(make_tok<8, 4, 1, LH::NcNa, SH::Cs>());
  vs.push_back(make_tok<4, 2, 1, LH::NcNa, SH::Wb>());
  vs.push_back(make_tok<8, 2, 2, LH::NcNa, SH::Wb>());
  vs.push_back(make_tok<4, 2, 2, LH::NcNa, SH::Wb>());
  // launch bounds (register cap -> more resident blocks)
  vs.push_back(make_tok<4, 1, 1, LH::NcNa, SH::Cs, 256, 6>());
  vs.push_back(make_tok<4, 1, 1, LH::NcNa, SH::Wb, 256, 6>());
  vs.push_back(make_tok<4, 1, 1, LH::NcNa, SH::Cs, 256, 8>());  // 32 registers: spills a little
  vs.push_back(make_tok<4, 1, 2, LH::NcNa, SH::Wb, 256, 6>());
  vs.push_back(make_tok<8, 2, 1, LH::NcNa, SH::Cs, 512, 2>());
  // bulk L2 prefetch of the row P rows ahead
  vs.push_back(make_tok<4, 1, 1, LH::NcNa, SH::Cs, 1024, 1, true>(256));
  vs.push_back(make_tok<4, 1, 1, LH::NcNa, SH::Cs, 1024, 1, true>(1024));
  vs.push_back(make_tok<4, 1, 1, LH::NcNa, SH::Wb, 1024, 1, true>(512));
  vs.push_back(make_tok<4, 1, 2, LH::NcNa, SH::Wb, 1024, 1, true>(512));
  return vs;
}

void run_tok() {
  std::printf("\n######## fp8_quant_per_token (bf16) ########\n");
  std::vector<Variant> vs = tok_variants();
  const int64_t shapes[][2] = {{16384, 8192}, {16384, 14336}, {4096, 8192}, {37, 8192}, {37, 14336}, {37, 4096},
                               {11, 4104}, {10, 2048}, {12, 96}};
  for (const auto& s : shapes) {
    const int64_t M = s[0], K = s[1];
    gen(M, K, kZeroRow | kNanInfRows | kTinyRows | kHugeRow);
    CK(vs[0].run(M, K));
    CK(cudaMemcpyAsync(B.q_ref, B.q, M * K, cudaMemcpyDeviceToDevice, B.st));
    CK(cudaMemcpyAsync(B.scale_ref, B.scale, M * 4, cudaMemcpyDeviceToDevice, B.st));
    for (size_t i = 1; i < vs.size(); ++i) {
      Variant& v = vs[i];
      if (!v.ok(M, K)) continue;
      CK(cudaMemsetAsync(B.q, 0xCD, M * K, B.st));
      CK(cudaMemsetAsync(B.scale, 0xCD, M * 4, B.st));
      CK(v.run(M, K));
      unsigned long long first, nb;
      if ((nb = compare(B.q, B.q_ref, M * K, &first))) fail(v, "q", M, K, "normal+outliers+zero/NaN/Inf/tiny/huge rows", nb, first);
      if ((nb = compare(B.scale, B.scale_ref, M * 4, &first))) fail(v, "scale", M, K, "normal+outliers+zero/NaN/Inf/tiny/huge rows", nb, first);
    }
  }
  CK(cudaGetLastError());
  report_checks("fp8_quant_per_token", vs);

  time_op("fp8_quant_per_token", vs, [](int64_t M, int64_t K) { return static_cast<size_t>(3 * M * K + 4 * M); });
}

// ---------------------------------------------------------------------------------------------------------------------
// mxfp8
// ---------------------------------------------------------------------------------------------------------------------
template <bool R, int THR, int UNR, int W, LH L, SH S, int MINB = 1, bool PF = false>
Variant make_mx(int pf_blocks = 0) {
  Variant v;
  v.name = variant_name("mx t" + std::to_string(THR) + " u" + std::to_string(UNR), W, L, S, THR, MINB, PF, pf_blocks);
  v.threads = [](int64_t, int64_t) { return THR; };
  v.ok = [](int64_t, int64_t K) { return K % 32 == 0; };
  v.fn = [](int64_t, int64_t) { return reinterpret_cast<const void*>(&mx_kernel<R, THR, UNR, W, L, S, MINB, PF>); };
  v.run = [pf_blocks](int64_t M, int64_t K) {
    const int64_t nunit = M * K / (N * W);
    const int64_t grid = (nunit + THR * UNR - 1) / (THR * UNR);
    mx_kernel<R, THR, UNR, W, L, S, MINB, PF><<<static_cast<unsigned>(grid), THR, 0, B.st>>>(B.x, nunit, B.q, B.codes, pf_blocks);
    return cudaGetLastError();
  };
  return v;
}

template <bool R>
std::vector<Variant> mx_variants() {
  std::vector<Variant> vs;
  Variant p;
  p.name = std::string("production launch_mxfp8_quant ") + (R ? "rceil" : "floor");
  p.prod = true;
  p.ok = [](int64_t, int64_t) { return true; };
  p.threads = [](int64_t, int64_t) { return 256; };
  p.fn = [](int64_t, int64_t) { return reinterpret_cast<const void*>(&prod_mx::cublade::mx_quant_kernel<BF, R>); };
  p.run = [](int64_t M, int64_t K) { return prod_mx::cublade::launch_mxfp8_quant(mx_args(M, K, R), B.st); };
  vs.push_back(p);
  vs.push_back(make_mx<R, 256, 4, 1, LH::NcNa, SH::Cs>());  // production's layout re-built (sanity)
  // hints
  vs.push_back(make_mx<R, 256, 4, 1, LH::NcNaL2_256, SH::Cs>());
  vs.push_back(make_mx<R, 256, 4, 1, LH::NcL2_128, SH::Cs>());
  vs.push_back(make_mx<R, 256, 4, 1, LH::Nc, SH::Cs>());
  vs.push_back(make_mx<R, 256, 4, 1, LH::Plain, SH::Cs>());
  vs.push_back(make_mx<R, 256, 4, 1, LH::Cs, SH::Cs>());
  vs.push_back(make_mx<R, 256, 4, 1, LH::NcNaEF, SH::Cs>());
  vs.push_back(make_mx<R, 256, 4, 1, LH::NcNa, SH::Wb>());
  vs.push_back(make_mx<R, 256, 4, 1, LH::NcNa, SH::EF>());
  vs.push_back(make_mx<R, 256, 4, 1, LH::Plain, SH::Wb>());
  vs.push_back(make_mx<R, 256, 4, 1, LH::NcNaL2_256, SH::Wb>());
  // 16-byte stores: a thread owns 2 adjacent vectors (2 lanes per MX block)
  vs.push_back(make_mx<R, 256, 2, 2, LH::NcNa, SH::Cs>());
  vs.push_back(make_mx<R, 256, 2, 2, LH::NcNa, SH::Wb>());
  vs.push_back(make_mx<R, 256, 4, 2, LH::NcNa, SH::Cs>());
  vs.push_back(make_mx<R, 256, 4, 2, LH::NcNa, SH::Wb>());
  vs.push_back(make_mx<R, 256, 1, 2, LH::NcNa, SH::Wb>());
  vs.push_back(make_mx<R, 512, 2, 2, LH::NcNa, SH::Wb>());
  vs.push_back(make_mx<R, 256, 2, 2, LH::NcNaL2_256, SH::Wb>());
  // block shape / vectors in flight
  vs.push_back(make_mx<R, 128, 4, 1, LH::NcNa, SH::Cs>());
  vs.push_back(make_mx<R, 512, 4, 1, LH::NcNa, SH::Cs>());
  vs.push_back(make_mx<R, 1024, 4, 1, LH::NcNa, SH::Cs>());
  vs.push_back(make_mx<R, 256, 2, 1, LH::NcNa, SH::Cs>());
  vs.push_back(make_mx<R, 256, 8, 1, LH::NcNa, SH::Cs>());
  vs.push_back(make_mx<R, 512, 2, 1, LH::NcNa, SH::Cs>());
  // launch bounds: 256 x 8 blocks per SM (<= 32 registers)
  vs.push_back(make_mx<R, 256, 4, 1, LH::NcNa, SH::Cs, 8>());
  vs.push_back(make_mx<R, 256, 2, 1, LH::NcNa, SH::Cs, 8>());
  vs.push_back(make_mx<R, 256, 4, 1, LH::NcNa, SH::Wb, 8>());
  vs.push_back(make_mx<R, 256, 2, 2, LH::NcNa, SH::Wb, 8>());
  vs.push_back(make_mx<R, 256, 4, 1, LH::NcNa, SH::Cs, 6>());
  // bulk L2 prefetch of the block P blocks ahead (a block = 16 KB of input here)
  vs.push_back(make_mx<R, 256, 4, 1, LH::NcNa, SH::Cs, 1, true>(512));
  vs.push_back(make_mx<R, 256, 4, 1, LH::NcNa, SH::Cs, 1, true>(1024));
  vs.push_back(make_mx<R, 256, 2, 2, LH::NcNa, SH::Wb, 1, true>(1024));
  return vs;
}

template <bool R>
void run_mx() {
  const char* rule = R ? "rceil" : "floor";
  std::printf("\n######## mxfp8_quant %s (bf16) ########\n", rule);
  std::vector<Variant> vs = mx_variants<R>();
  const int64_t shapes[][2] = {{16384, 8192}, {16384, 14336}, {4096, 8192}, {37, 8192}, {37, 14336}, {5, 96}, {1, 32}, {3, 4128}};
  for (const auto& s : shapes) {
    const int64_t M = s[0], K = s[1];
    gen(M, K, kZeroRow | kNanInfRows | kTinyRows | kHugeRow);
    CK(vs[0].run(M, K));
    CK(cudaMemcpyAsync(B.q_ref, B.q, M * K, cudaMemcpyDeviceToDevice, B.st));
    CK(cudaMemcpyAsync(B.codes_ref, B.codes, M * K / 32, cudaMemcpyDeviceToDevice, B.st));
    for (size_t i = 1; i < vs.size(); ++i) {
      Variant& v = vs[i];
      if (!v.ok(M, K)) continue;
      CK(cudaMemsetAsync(B.q, 0xCD, M * K, B.st));
      CK(cudaMemsetAsync(B.codes, 0xCD, M * K / 32, B.st));
      CK(v.run(M, K));
      unsigned long long first, nb;
      if ((nb = compare(B.q, B.q_ref, M * K, &first))) fail(v, "q", M, K, "normal+outliers+zero/NaN/Inf/subnormal/boundary rows", nb, first);
      if ((nb = compare(B.codes, B.codes_ref, M * K / 32, &first))) fail(v, "codes", M, K, "normal+outliers+zero/NaN/Inf/subnormal/boundary rows", nb, first);
    }
  }
  CK(cudaGetLastError());
  const std::string op = std::string("mxfp8_quant ") + rule;
  report_checks(op.c_str(), vs);

  time_op(op, vs, [](int64_t M, int64_t K) { return static_cast<size_t>(3 * M * K + M * K / 32); });
}

// ---------------------------------------------------------------------------------------------------------------------
// per-tensor
// ---------------------------------------------------------------------------------------------------------------------
// A cast variant takes (partials, nparts) or a static scale; an amax variant writes partials and reports its grid.
struct CastV {
  std::string name;
  bool prod = false;
  std::function<bool(int64_t, int64_t)> ok;
  std::function<int()> threads;
  const void* fn = nullptr;
  std::function<cudaError_t(int64_t, int64_t, const float* partials, int nparts, const float* static_scale)> run;
  bool pass = true;
  std::string why;
};
struct AmaxV {
  std::string name;
  bool prod = false;
  std::function<int(int64_t, int64_t)> grid;
  int thr = 256;
  const void* fn = nullptr;
  std::function<cudaError_t(int64_t, int64_t, float* partials)> run;
  bool pass = true;
  std::string why;
};

int prod_amax_grid(int64_t M, int64_t K) {
  const int64_t nvec = M * K / N;
  const int64_t work = (nvec + 3) / 4;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(int64_t(B.num_sms) * 4, (work + 255) / 256)));
}

// MINB = -1: 2048/THR blocks per SM (32 registers, production's cast kernel has 32) when UPT*W <= 4, else 1.
template <int THR, int UPT, int W, LH L, SH S, int MINB_ = -1, bool PF = false>
CastV make_cast(int pf_blocks = 0) {
  constexpr int MINB = MINB_ >= 0 ? MINB_ : (UPT * W <= 4 ? 2048 / THR : 1);
  CastV v;
  v.name = variant_name("cast t" + std::to_string(THR) + " u" + std::to_string(UPT), W, L, S, THR, MINB, PF, pf_blocks);
  v.ok = [](int64_t, int64_t) { return true; };
  v.threads = []() { return THR; };
  v.fn = reinterpret_cast<const void*>(&cast_kernel<THR, UPT, W, L, S, MINB, PF>);
  v.run = [pf_blocks](int64_t M, int64_t K, const float* parts, int np, const float* ss) {
    const int64_t n = M * K, nvec = n / N;
    const int64_t grid = std::max<int64_t>(1, (nvec / W + THR * UPT - 1) / (THR * UPT));
    cast_kernel<THR, UPT, W, L, S, MINB, PF><<<static_cast<unsigned>(grid), THR, 0, B.st>>>(B.x, nvec, n, B.q, parts, np, ss,
                                                                                          B.scale, pf_blocks);
    return cudaGetLastError();
  };
  return v;
}
template <LH L, SH S>
CastV make_cast_row() {
  CastV v;
  v.name = std::string("row (vLLM static layout) t256 w16 ld=") + lh_name(L) + " st=" + sh_name(S);
  v.ok = [](int64_t, int64_t K) { return K % 16 == 0; };
  v.threads = []() { return 256; };
  v.fn = reinterpret_cast<const void*>(&cast_row_kernel<L, S>);
  v.run = [](int64_t M, int64_t K, const float* parts, int np, const float* ss) {
    cast_row_kernel<L, S><<<static_cast<unsigned>(M), 256, 0, B.st>>>(B.x, K, B.q, parts, np, ss, B.scale);
    return cudaGetLastError();
  };
  return v;
}
template <int THR, int UNR, LH L, bool CHUNK>
AmaxV make_amax(int bps) {
  AmaxV v;
  v.name = "amax t" + std::to_string(THR) + " u" + std::to_string(UNR) + " ld=" + lh_name(L) + " bps" + std::to_string(bps) +
           (CHUNK ? " chunk" : " gridstride");
  v.thr = THR;
  v.fn = reinterpret_cast<const void*>(&amax_kernel<THR, UNR, L, CHUNK>);
  v.grid = [bps](int64_t M, int64_t K) {
    const int64_t nvec = M * K / N;
    const int64_t work = (nvec + UNR - 1) / UNR;
    return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(int64_t(B.num_sms) * bps, (work + THR - 1) / THR)));
  };
  auto g = v.grid;
  v.run = [g](int64_t M, int64_t K, float* parts) {
    const int64_t n = M * K;
    amax_kernel<THR, UNR, L, CHUNK><<<g(M, K), THR, 0, B.st>>>(B.x, n / N, n, parts);
    return cudaGetLastError();
  };
  return v;
}

void run_pt() {
  std::printf("\n######## fp8_quant_per_tensor (bf16) ########\n");
  // ---- variants
  std::vector<CastV> cs;
  {
    CastV p;
    p.name = "production cast_flat_kernel (t256, 2 pairs/thread, w16, nc_na, cs)";
    p.prod = true;
    p.ok = [](int64_t, int64_t) { return true; };
    p.threads = []() { return 256; };
    p.fn = reinterpret_cast<const void*>(&prod_pt::cublade::cast_flat_kernel<BF>);
    p.run = [](int64_t M, int64_t K, const float* parts, int np, const float* ss) {  // production launcher's flat branch
      const int64_t n = M * K, nvec = n / N;
      const int64_t grid = std::max<int64_t>(1, (nvec / 2 + 511) / 512);
      prod_pt::cublade::cast_flat_kernel<BF><<<static_cast<unsigned>(grid), 256, 0, B.st>>>(B.x, nvec, n, B.q, parts, np, ss, B.scale);
      return cudaGetLastError();
    };
    cs.push_back(p);
  }
  cs.push_back(make_cast<256, 2, 2, LH::NcNa, SH::Cs>());  // production re-built (sanity; lb 256/8 = 32 registers)
  cs.push_back(make_cast<256, 2, 2, LH::NcNa, SH::Cs, 1>());  // same, lb 256/1 (40 registers, 6 blocks per SM)
  cs.push_back(make_cast<256, 2, 2, LH::NcNaL2_256, SH::Cs>());
  cs.push_back(make_cast<256, 2, 2, LH::NcL2_128, SH::Cs>());
  cs.push_back(make_cast<256, 2, 2, LH::Nc, SH::Cs>());
  cs.push_back(make_cast<256, 2, 2, LH::Plain, SH::Cs>());
  cs.push_back(make_cast<256, 2, 2, LH::Cs, SH::Cs>());
  cs.push_back(make_cast<256, 2, 2, LH::NcNaEF, SH::Cs>());
  cs.push_back(make_cast<256, 2, 2, LH::NcNa, SH::Wb>());
  cs.push_back(make_cast<256, 2, 2, LH::NcNa, SH::EF>());
  cs.push_back(make_cast<256, 2, 2, LH::Plain, SH::Wb>());
  cs.push_back(make_cast<256, 2, 2, LH::Nc, SH::Wb>());
  cs.push_back(make_cast<256, 2, 2, LH::NcNaL2_256, SH::Wb>());
  cs.push_back(make_cast<256, 2, 2, LH::Cxx, SH::Cxx>());
  cs.push_back(make_cast<256, 4, 1, LH::NcNa, SH::Cs>());
  cs.push_back(make_cast<256, 4, 1, LH::NcNa, SH::Wb>());
  cs.push_back(make_cast<256, 1, 2, LH::NcNa, SH::Cs>());
  cs.push_back(make_cast<256, 1, 2, LH::NcNa, SH::Wb>());
  cs.push_back(make_cast<256, 4, 2, LH::NcNa, SH::Cs>());
  cs.push_back(make_cast<128, 2, 2, LH::NcNa, SH::Cs>());
  cs.push_back(make_cast<512, 2, 2, LH::NcNa, SH::Cs>());
  cs.push_back(make_cast<512, 1, 2, LH::NcNa, SH::Wb>());
  cs.push_back(make_cast<256, 2, 2, LH::NcNa, SH::Wb, 1>());
  cs.push_back(make_cast<256, 2, 2, LH::NcNa, SH::Cs, -1, true>(512));
  cs.push_back(make_cast<256, 2, 2, LH::NcNa, SH::Wb, -1, true>(1024));
  cs.push_back(make_cast_row<LH::Cxx, SH::Cxx>());
  cs.push_back(make_cast_row<LH::Nc, SH::Wb>());
  cs.push_back(make_cast_row<LH::NcNa, SH::Cs>());
  cs.push_back(make_cast_row<LH::NcNa, SH::Wb>());
  cs.push_back(make_cast_row<LH::Plain, SH::Wb>());

  std::vector<AmaxV> as;
  {
    AmaxV p;
    p.name = "production amax_flat_kernel (t256 u4 __ldg bps4 gridstride)";
    p.prod = true;
    p.fn = reinterpret_cast<const void*>(&prod_pt::cublade::amax_flat_kernel<BF>);
    p.grid = [](int64_t M, int64_t K) { return prod_amax_grid(M, K); };
    p.run = [](int64_t M, int64_t K, float* parts) {
      const int64_t n = M * K;
      prod_pt::cublade::amax_flat_kernel<BF><<<prod_amax_grid(M, K), 256, 0, B.st>>>(B.x, n / N, n, parts);
      return cudaGetLastError();
    };
    as.push_back(p);
  }
  as.push_back(make_amax<256, 4, LH::Nc, false>(4));  // production re-built
  as.push_back(make_amax<256, 4, LH::NcNa, false>(4));
  as.push_back(make_amax<256, 4, LH::NcNaL2_256, false>(4));
  as.push_back(make_amax<256, 8, LH::Nc, false>(4));
  as.push_back(make_amax<256, 4, LH::Nc, false>(8));
  as.push_back(make_amax<512, 4, LH::Nc, false>(4));
  as.push_back(make_amax<256, 4, LH::Nc, true>(4));
  as.push_back(make_amax<256, 8, LH::NcNaL2_256, true>(4));
  as.push_back(make_amax<256, 4, LH::NcNaEF, false>(4));

  // ---- byte checks against production (launcher for the dynamic / static results)
  const int64_t shapes[][2] = {{16384, 8192}, {16384, 14336}, {4096, 8192}, {37, 8192}, {3, 4104}, {1, 8}, {1, 24}};
  struct DataSet { int flags; const char* name; };
  const DataSet sets[] = {{kZeroRow | kTinyRows, "normal+outliers+zero/subnormal rows"},
                          {kZeroRow | kTinyRows | kOnePosInf, "... + one +Inf"},
                          {kZeroRow | kTinyRows | kOneNanNegInf, "... + one NaN, one -Inf"},
                          {kZeroRow | kTinyRows | kHugeRow, "... + a huge row"}};
  for (const auto& s : shapes) {
    const int64_t M = s[0], K = s[1], n = M * K;
    for (int mode = 0; mode < 5; ++mode) {  // 0..3: dynamic on sets[mode]; 4: static scale on set 0 + NaN/Inf rows
      const bool stat = mode == 4;
      const char* dname = stat ? "static scale, NaN/Inf/zero/tiny/huge rows" : sets[mode].name;
      gen(M, K, stat ? (kZeroRow | kNanInfRows | kTinyRows | kHugeRow) : sets[mode].flags);
      CK(prod_pt::cublade::launch_fp8_quant_per_tensor(pt_args(M, K, stat ? B.static_scale : nullptr), B.st));
      CK(cudaMemcpyAsync(B.q_ref, B.q, n, cudaMemcpyDeviceToDevice, B.st));
      CK(cudaMemcpyAsync(B.scale_ref, B.scale, 4, cudaMemcpyDeviceToDevice, B.st));
      // production amax partials (the cast variants reduce them), then each cast variant
      if (!stat) CK(as[0].run(M, K, B.ws_prod));
      for (size_t i = 0; i < cs.size(); ++i) {  // includes production's cast kernel called directly
        CastV& v = cs[i];
        if (!v.ok(M, K)) continue;
        CK(cudaMemsetAsync(B.q, 0xCD, n, B.st));
        CK(cudaMemsetAsync(B.scale, 0xCD, 4, B.st));
        CK(v.run(M, K, stat ? nullptr : B.ws_prod, prod_amax_grid(M, K), stat ? B.static_scale : nullptr));
        unsigned long long first, nb;
        char w[64];
        std::snprintf(w, sizeof w, "%s q", stat ? "static" : "dynamic");
        if ((nb = compare(B.q, B.q_ref, n, &first)) && v.pass) {
          v.pass = false;
          v.why = std::string(w) + " differs at " + std::to_string(M) + "x" + std::to_string(K) + " (" + dname + "): " +
                  std::to_string(nb) + " bytes, first at " + std::to_string(first);
        }
        if ((nb = compare(B.scale, B.scale_ref, 4, &first)) && v.pass) {
          v.pass = false;
          v.why = std::string("scale_out differs at ") + std::to_string(M) + "x" + std::to_string(K) + " (" + dname + ")";
        }
      }
      if (stat) continue;
      // amax variants: their partials, reduced by production's cast kernel, must give the same q and scale
      for (size_t i = 1; i < as.size(); ++i) {
        AmaxV& v = as[i];
        CK(cudaMemsetAsync(B.q, 0xCD, n, B.st));
        CK(cudaMemsetAsync(B.scale, 0xCD, 4, B.st));
        CK(v.run(M, K, B.ws));
        CK(cs[0].run(M, K, B.ws, v.grid(M, K), nullptr));
        unsigned long long first, nb1, nb2;
        nb1 = compare(B.q, B.q_ref, n, &first);
        nb2 = compare(B.scale, B.scale_ref, 4, &first);
        if ((nb1 || nb2) && v.pass) {
          v.pass = false;
          v.why = "q/scale (via production cast) differ at " + std::to_string(M) + "x" + std::to_string(K) + " (" + dname + ")";
        }
      }
    }
  }
  CK(cudaGetLastError());
  int nf = 0;
  for (auto& v : cs) nf += !v.pass;
  for (auto& v : as) nf += !v.pass;
  std::printf("\n-- fp8_quant_per_tensor: byte checks of %zu cast + %zu amax variants vs production: %d FAIL --\n",
              cs.size() - 1, as.size() - 1, nf);
  for (auto& v : cs) std::printf("   %s  %s%s%s\n", v.pass ? "PASS" : "FAIL", v.name.c_str(), v.pass ? "" : "  : ", v.why.c_str());
  for (auto& v : as)
    if (!v.prod) std::printf("   %s  %s%s%s\n", v.pass ? "PASS" : "FAIL", v.name.c_str(), v.pass ? "" : "  : ", v.why.c_str());
  if (nf) g_any_fail = true;

  // ---- timing at the main shape: amax alone, cast alone (every variant)
  std::vector<double> cus(cs.size(), -1.0), aus(as.size(), -1.0);
  {
    const int64_t M = kMainM, K = kMainK;
    const std::string sh = std::to_string(M) + "x" + std::to_string(K);
    const size_t b3 = static_cast<size_t>(3 * M * K), b2 = static_cast<size_t>(2 * M * K);
    gen(M, K, kZeroRow | kTinyRows);
    std::vector<Row> rows;
    const double c2 = time_copy_us(b2);
    for (size_t i = 0; i < as.size(); ++i) {
      Row r{as[i].name, 0, as[i].prod, as[i].pass, false, -1, -1, as[i].thr};
      kernel_info(as[i].fn, as[i].thr, &r.regs, &r.occ);
      AmaxV& v = as[i];
      r.us = time_us([&]() { return v.run(M, K, B.ws); });
      aus[i] = r.us;
      rows.push_back(r);
    }
    print_table("fp8_quant_per_tensor AMAX pass alone bf16 " + sh + " (bytes: 2 per element)", rows, b2, c2);
    CK(as[0].run(M, K, B.ws_prod));  // production partials for the cast-alone timings
    const int np = prod_amax_grid(M, K);
    rows.clear();
    const double c3 = time_copy_us(b3);
    for (size_t i = 0; i < cs.size(); ++i) {
      if (!cs[i].ok(M, K)) continue;
      Row r{cs[i].name, 0, cs[i].prod, cs[i].pass, false, -1, -1, cs[i].threads()};
      kernel_info(cs[i].fn, r.thr, &r.regs, &r.occ);
      CastV& v = cs[i];
      r.us = time_us([&]() { return v.run(M, K, B.ws_prod, np, nullptr); });
      cus[i] = r.us;
      rows.push_back(r);
    }
    print_table("fp8_quant_per_tensor CAST pass alone (dynamic mode) bf16 " + sh, rows, b3, c3);
  }

  // dynamic total at the main shape: production launcher; fastest passing amax + each cast; production amax + top casts
  int best_a = 0;
  for (size_t i = 1; i < as.size(); ++i)
    if (as[i].pass && aus[i] > 0 && aus[i] < aus[best_a]) best_a = static_cast<int>(i);
  std::vector<int> cast_order;
  for (size_t i = 0; i < cs.size(); ++i)
    if (cs[i].pass && cus[i] > 0) cast_order.push_back(static_cast<int>(i));
  std::sort(cast_order.begin(), cast_order.end(), [&](int a, int b) { return cus[a] < cus[b]; });

  struct Combo { int a, c; };
  auto time_total = [&](int64_t M, int64_t K, const std::vector<Combo>& combos, std::vector<double>* out_us) {
    const std::string sh = std::to_string(M) + "x" + std::to_string(K);
    const size_t b3 = static_cast<size_t>(3 * M * K);
    gen(M, K, kZeroRow | kTinyRows);
    std::vector<Row> rows;
    const double c3 = time_copy_us(b3);
    Row pr{"production launch_fp8_quant_per_tensor (dynamic)", 0, true, true, false, -1, -1, 256};
    pr.us = time_us([&]() {
      return prod_pt::cublade::launch_fp8_quant_per_tensor(pt_args(M, K, nullptr), B.st);
    });
    rows.push_back(pr);
    out_us->assign(combos.size() + 1, -1.0);
    (*out_us)[0] = pr.us;
    for (size_t j = 0; j < combos.size(); ++j) {
      const AmaxV& a = as[combos[j].a];
      const CastV& c = cs[combos[j].c];
      if (!c.ok(M, K)) continue;
      Row r{"[" + a.name + "] + [" + c.name + "]", 0, false, a.pass && c.pass, false, -1, -1, 0};
      r.us = time_us([&]() {
        cudaError_t e = a.run(M, K, B.ws);
        if (e != cudaSuccess) return e;
        return c.run(M, K, B.ws, a.grid(M, K), nullptr);
      });
      (*out_us)[j + 1] = r.us;
      rows.push_back(r);
    }
    print_table("fp8_quant_per_tensor DYNAMIC TOTAL (amax + cast) bf16 " + sh, rows, b3, c3);
  };
  std::vector<Combo> combos;
  for (size_t i = 0; i < cs.size(); ++i) combos.push_back({best_a, static_cast<int>(i)});
  for (size_t j = 0; j < cast_order.size() && j < 5; ++j)
    if (best_a != 0) combos.push_back({0, cast_order[j]});
  std::vector<double> tot;
  time_total(kMainM, kMainK, combos, &tot);
  int best_combo = -1;
  for (size_t j = 0; j < combos.size(); ++j)
    if (as[combos[j].a].pass && cs[combos[j].c].pass && tot[j + 1] > 0 && (best_combo < 0 || tot[j + 1] < tot[best_combo + 1]))
      best_combo = static_cast<int>(j);

  // other shapes: production + the 5 fastest casts (alone), and totals for the best amax with them
  std::vector<int> top_cast;
  top_cast.push_back(0);
  for (size_t j = 0; j < cast_order.size() && top_cast.size() < 6; ++j)
    if (cast_order[j] != 0) top_cast.push_back(cast_order[j]);
  for (const auto& s : kOtherShapes) {
    const int64_t M = s[0], K = s[1];
    const std::string sh = std::to_string(M) + "x" + std::to_string(K);
    const size_t b3 = static_cast<size_t>(3 * M * K);
    gen(M, K, kZeroRow | kTinyRows);
    CK(as[0].run(M, K, B.ws_prod));
    const int np = prod_amax_grid(M, K);
    std::vector<Row> rows;
    const double c3 = time_copy_us(b3);
    for (int i : top_cast) {
      if (!cs[i].ok(M, K)) continue;
      Row r{cs[i].name, 0, cs[i].prod, cs[i].pass, false, -1, -1, cs[i].threads()};
      kernel_info(cs[i].fn, r.thr, &r.regs, &r.occ);
      CastV& v = cs[i];
      r.us = time_us([&]() { return v.run(M, K, B.ws_prod, np, nullptr); });
      rows.push_back(r);
    }
    print_table("fp8_quant_per_tensor CAST pass alone (dynamic mode) bf16 " + sh, rows, b3, c3);
    std::vector<Combo> cb;
    for (int i : top_cast) cb.push_back({best_a, i});
    if (best_a != 0) cb.push_back({0, top_cast.size() > 1 ? top_cast[1] : 0});
    std::vector<double> t2;
    time_total(M, K, cb, &t2);
  }

  // best lines
  {
    int bc = -1;
    for (size_t i = 1; i < cs.size(); ++i)
      if (cs[i].pass && cus[i] > 0 && (bc < 0 || cus[i] < cus[bc])) bc = static_cast<int>(i);
    char buf[512];
    if (bc >= 0)
      std::snprintf(buf, sizeof buf, "BEST fp8_quant_per_tensor CAST pass @16384x8192: %s  %.1f us vs production %.1f us  (speedup %.3fx)",
                    cs[bc].name.c_str(), cus[bc], cus[0], cus[0] / cus[bc]);
    else
      std::snprintf(buf, sizeof buf, "BEST fp8_quant_per_tensor CAST pass: no passing variant");
    g_best_lines.push_back(buf);
    if (aus.size() > 1)
      std::snprintf(buf, sizeof buf, "BEST fp8_quant_per_tensor AMAX pass @16384x8192: %s  %.1f us vs production %.1f us  (speedup %.3fx)",
                    as[best_a].name.c_str(), aus[best_a], aus[0], aus[0] / aus[best_a]);
    g_best_lines.push_back(buf);
    if (best_combo >= 0)
      std::snprintf(buf, sizeof buf,
                    "BEST fp8_quant_per_tensor DYNAMIC @16384x8192: [%s] + [%s]  %.1f us vs production %.1f us  (speedup %.3fx; target <= 170 us: %s)",
                    as[combos[best_combo].a].name.c_str(), cs[combos[best_combo].c].name.c_str(), tot[best_combo + 1], tot[0],
                    tot[0] / tot[best_combo + 1], tot[best_combo + 1] <= 170.0 ? "met" : "NOT met");
    else
      std::snprintf(buf, sizeof buf, "BEST fp8_quant_per_tensor DYNAMIC: no passing combination");
    g_best_lines.push_back(buf);
  }
}

}  // namespace sweep

int main(int argc, char** argv) {
  using namespace sweep;
  bool do_tok = true, do_mx = true, do_pt = true;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) {
      g_reps = std::max(50, std::atoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--ops") && i + 1 < argc) {
      const std::string o = argv[++i];
      do_tok = o.find("tok") != std::string::npos;
      do_mx = o.find("mx") != std::string::npos;
      do_pt = o.find("pt") != std::string::npos;
    } else {
      std::fprintf(stderr, "usage: %s [--reps N (>=50)] [--ops tok,mx,pt]\n", argv[0]);
      return 2;
    }
  }
  const harness::Device device;
  const cudaDeviceProp& prop = device.prop;
  B.num_sms = device.sms;
  B.st = device.stream;
  int drv = 0, rt = 0;
  cudaDriverGetVersion(&drv);
  cudaRuntimeGetVersion(&rt);
  std::printf("quant_sweep: %s, %d SMs, sm_%d%d, L2 %d MB, driver %d, runtime %d; median of %d runs, 256 MB L2 flush before each\n",
              prop.name, B.num_sms, prop.major, prop.minor, prop.l2CacheSize >> 20, drv, rt, g_reps);
  if (prop.major != 9) {
    std::fprintf(stderr, "needs an sm_90 GPU\n");
    return 2;
  }
  const int64_t maxMK = 16384ll * 14336ll;
  CK(cudaMalloc(&B.x, maxMK * 2));
  CK(cudaMalloc(&B.q, maxMK));
  CK(cudaMalloc(&B.q_ref, maxMK));
  CK(cudaMalloc(&B.scale, 16384 * 4));
  CK(cudaMalloc(&B.scale_ref, 16384 * 4));
  CK(cudaMalloc(&B.codes, maxMK / 32));
  CK(cudaMalloc(&B.codes_ref, maxMK / 32));
  CK(cudaMalloc(&B.ws, 8192 * 4));
  CK(cudaMalloc(&B.ws_prod, std::max<int64_t>(8192, prod_pt::cublade::fp8_quant_per_tensor_workspace_floats(B.num_sms)) * 4));
  CK(cudaMalloc(&B.static_scale, 4));
  const float ss = 0.0173f;
  CK(cudaMemcpy(B.static_scale, &ss, 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&B.flush, kFlushBytes));
  CK(cudaMalloc(&B.cp_src, maxMK * 2));
  CK(cudaMalloc(&B.cp_dst, maxMK * 2));
  CK(cudaMemset(B.cp_src, 1, maxMK * 2));
  CK(cudaMalloc(&B.cmp, 2 * sizeof(unsigned long long)));

  if (do_tok) run_tok();
  if (do_mx) {
    run_mx<true>();
    run_mx<false>();
  }
  if (do_pt) run_pt();

  std::printf("\n======== summary ========\n");
  for (const std::string& s : g_best_lines) std::printf("%s\n", s.c_str());
  std::printf("%s\n", g_any_fail ? "SOME VARIANTS FAILED THE BYTE CHECK (see the check lists above)" : "all variants passed the byte checks");
  return g_any_fail ? 1 : 0;
}
