// The tensor cores' rate under the wide kernel's consumer loop (wide_gemm.cuh), with no global memory traffic.
// Ablation builds of the wide kernel left its wgmma loop alone (8 wgmma m64n128k16 per batch, wait, fp32 fold, no
// dequant, no copies) at about half the tensor peak at 128 tokens; this program asks why, one pattern at
// a time. Every CTA (one per SM) fills its shared memory once (x as B: NTOK tokens x 512 K; each consumer warp's
// packets and records of 512 K), then each consumer warpgroup runs `iters` times over 4 batches of 128 K:
//
//   stream        A constant; 8 mma's into acc a batch, commit, wait<1>: the ceiling of the register-A loop
//   wait          A constant; 8 mma's into acc, wait<0> a batch
//   fold          A constant; 8 mma's into part, wait<0>, acc += part * s: production's loop without dequant or copies
//   dequant-fold  production's int4 g128 consumer: Int4Batch's dequant, 8 mma's into part, wait<0>, fold
//   dequant-wait  FP4's consumer: dequant, 8 mma's into acc, wait<0>
//   dequant-pipe  dequant batch b+1 into the other A set while batch b's mma's run (wait<1>), mma's into acc
//   ss            A from shared memory (128-byte swizzle), mma's into acc, wait<1>: the ceiling with no registers
//
// "ordered": warpgroup w waits on a named barrier before it issues a batch's mma's and then lets the next warpgroup go
// (CUTLASS's ping-pong order; production's from 48 tokens on 2 warpgroups, kOrderedIssue); "free": no order.
// B is either production's layout (core matrices of 8 tokens x 16 bytes, no swizzle) or the 128-byte swizzle
// (token rows of 64 K). The rate is ideal cycles (an m64nNk16 is N/2 cycles of the SM's tensor cores: 1024 bf16
// FLOP a cycle each, 4 an SM) over the slowest CTA's clock64 cycles. The last rows add a copy warp that writes shared
// memory as the production ring does (CP below). On the H200:
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I plugin/csrc -I benchmarks/tuning \
//        benchmarks/tuning/wgmma_rate.cu -o /tmp/wgmma_rate && /tmp/wgmma_rate
//
// Found (docs/decisions.md, "Ordered issue", with the raw output): the register-A loop reaches the peak in cycles with either B
// layout; two warpgroups that each wait for their batch keep it there only with nothing between the waits; with the
// int4 dequant and fold 72% (ordered 84%), with the dequant alone 85% (ordered 99%). Shared-memory writes beside the
// mma's cost few cycles (ordered dequant-wait 99.1% -> 95.7% at 22 bytes a cycle) but lower the clock: the stream loop
// took 13-18% longer in wall time at 40 bytes a cycle with the same cycle count.
#define CUBLADE_W4A16_ONE_TU  // the wide kernel's instantiations in this program too (w4a16_gemm_wide.cuh)
#include "w4a16_gemm.cu"
#include "harness.cuh"

#include <cstdio>

namespace {

using bf16 = __nv_bfloat16;
namespace wg = cublade::wgmma;
namespace lb = cublade::lowbit;
using Batch = cublade::wide::Int4Batch<bf16, 128, false>;

constexpr int kK = 512;                  // K of the staged x: 4 batches of 128
constexpr int kIters = 2000;             // passes over it per launch
constexpr int kPacketBytes = 8 * 512;    // a warp's packets over kK
constexpr int kTileBytes = kPacketBytes + 1024;  // and its records
constexpr int kSSABytes = 2 * 8192;      // ss: a warpgroup's A, 64 rows x 128 K in two 128-byte-swizzled blocks

enum Pattern : int { kStream, kWait, kFold, kDequantFold, kDequantWait, kDequantPipe, kSS };
const char* const kPatternNames[] = {"stream", "wait", "fold", "dequant-fold", "dequant-wait", "dequant-pipe", "ss"};

// Shared-memory descriptor with a layout type (0: none, 1: 128-byte swizzle).
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo, uint64_t layout) {
  return wg::desc(addr, lbo, sbo) | layout << 62;
}

__device__ __forceinline__ void mma_ss_n128(float (&d)[64], uint64_t a, uint64_t b, int scale_d) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %66, 0; "
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, 0, 0; }"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(scale_d));
}

template <int NTOK>
__device__ __forceinline__ void mma(float (&d)[NTOK / 2], const uint32_t (&a)[4], uint64_t b, int scale_d) {
  wg::MmaRS<bf16, NTOK>::run(d, a, b, scale_d);
}

// ORD: warpgroup w waits on named barrier 1 + w before it issues a batch's mma's and, once they are issued, lets
// warpgroup w + 1 (mod WG) go (wide_gemm.cuh's ordered issue, generalized to WG warpgroups).
using cublade::wide::bar_arrive;
using cublade::wide::bar_sync;

// CP: one more warp whose lane 0 streams bulk copies of kCopyBytes from an L2-resident buffer into shared memory
// (two in flight), paced to `copy_rate` bytes a cycle, until the consumers finish: shared-memory writes like the
// production ring's (x and weights: ~40 bytes a cycle at 128 tokens when the tensor cores run at peak), to see whether
// they slow the wgmma's reads of B. `copies` gets each CTA's bytes a cycle achieved.
constexpr int kCopyBytes = 16384;
constexpr int kCopySrcBlocks = 64;  // the source: 1 MB

template <int WG, bool CP>
__host__ __device__ constexpr int smem_bytes(int ntok, int pat) {
  return ntok * kK * 2 + WG * (pat == kSS ? kSSABytes : 4 * kTileBytes) + (CP ? 2 * kCopyBytes + 64 : 0);
}

template <int NTOK, int WG, int PAT, bool SWZ, bool ORD = false, bool CP = false>
__global__ void __launch_bounds__(WG * 128 + (CP ? 32 : 0), 1)
    rate(int iters, float* sink, long long* cycles, const unsigned char* copy_src, float copy_rate, float* copies) {
  constexpr int ND = NTOK / 2;
  constexpr int kXBytes = NTOK * kK * 2;
  extern __shared__ __align__(1024) unsigned char smem[];
  const int words = (kXBytes + WG * (PAT == kSS ? kSSABytes : 4 * kTileBytes)) / 4;
  unsigned char* scratch = smem + smem_bytes<WG, false>(NTOK, PAT);
  uint64_t* cbar = reinterpret_cast<uint64_t*>(scratch + 2 * kCopyBytes);
  volatile int* finished = reinterpret_cast<volatile int*>(cbar + 2);
  if (CP && threadIdx.x == 0) {
    lb::mbar_init(cbar, 1);
    lb::mbar_init(cbar + 1, 1);
    *finished = 0;
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  for (int i = threadIdx.x; i < words; i += blockDim.x) {  // random bf16 pairs; records 1.0 (scales and zeros)
    const int byte = 4 * i - kXBytes;
    const bool rec = PAT != kSS && byte >= 0 && byte % kTileBytes >= kPacketBytes;
    reinterpret_cast<uint32_t*>(smem)[i] = rec ? 0x3C003C00u : (static_cast<uint32_t>(i) * 2654435761u) & 0xBFFFBFFFu;
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the fill, visible to wgmma's reads
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wgi = warp / 4;
  const unsigned char* tb = smem + kXBytes + warp * kTileBytes;
  const uint32_t xs = lb::smem_u32(smem), as = lb::smem_u32(smem + kXBytes + wgi * kSSABytes);
  auto bdesc = [&](int j) {  // k-step j of the staged x
    if constexpr (SWZ) return desc(xs + (j / 4) * NTOK * 128 + (j % 4) * 32, 16, 1024, 1);
    else return desc(xs + j * 256, 128, kK * 16, 0);
  };
  float acc[ND], part[ND];
  for (int i = 0; i < ND; ++i) acc[i] = 0.0f;
  uint32_t a[2][8][4];
  for (int k = 0; k < 8; ++k)
    for (int j = 0; j < 4; ++j) a[0][k][j] = a[1][k][j] = 0x3C003C00u ^ (lane << 3) ^ (4 * k + j);
  float s_lo = 1.0f, s_hi = 1.0f;
  if constexpr (PAT == kDequantPipe) Batch::batch(tb, tb + kPacketBytes, 0, lane, a[0], s_lo, s_hi);
  __syncthreads();
  if (CP && wgi == WG) {  // the copy warp
    if (lane == 0) {
      const uint64_t pol = lb::policy_evict_last();
      const long long c0 = clock64();
      long long next = c0;
      int n = 0;
      for (; *finished < WG * 4; ++n) {
        const int s = n & 1;
        if (n >= 2) lb::mbar_wait(cbar + s, ((n - 2) >> 1) & 1);
        while (clock64() < next) {}
        next += static_cast<long long>(kCopyBytes / copy_rate);
        lb::mbar_expect_tx(cbar + s, kCopyBytes);
        lb::bulk_g2s(scratch + s * kCopyBytes, copy_src + (n % kCopySrcBlocks) * kCopyBytes, kCopyBytes, cbar + s, pol);
      }
      for (int m = n < 2 ? 0 : n - 2; m < n; ++m) lb::mbar_wait(cbar + (m & 1), (m >> 1) & 1);
      copies[blockIdx.x] = static_cast<float>(n) * kCopyBytes / static_cast<float>(clock64() - c0);
    }
    return;
  }
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int b = 0; b < kK / 128; ++b) {
      if constexpr (PAT == kDequantFold || PAT == kDequantWait)
        Batch::batch(tb, tb + kPacketBytes, b, lane, a[0], s_lo, s_hi);
      if (ORD && (it > 0 || b > 0 || wgi > 0)) bar_sync(1 + wgi);
      wg::fence();
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const uint64_t bd = bdesc(8 * b + k);
        if constexpr (PAT == kSS) mma_ss_n128(acc, desc(as + (k / 4) * 8192 + (k % 4) * 32, 16, 1024, 1), bd, 1);
        else if constexpr (PAT == kFold || PAT == kDequantFold) mma<NTOK>(part, a[0][k], bd, k);
        else if constexpr (PAT == kDequantPipe) mma<NTOK>(acc, a[b & 1][k], bd, 1);
        else mma<NTOK>(acc, a[0][k], bd, 1);
      }
      wg::commit();
      if (ORD && (it + 1 < iters || b < 3 || wgi < WG - 1)) bar_arrive(1 + (wgi + 1) % WG);
      if constexpr (PAT == kStream || PAT == kSS) {
        wg::wait<1>();
      } else if constexpr (PAT == kDequantPipe) {
        wg::wait<1>();  // batch b-1's mma's are done: its A set takes batch b+1
        Batch::batch(tb, tb + kPacketBytes, (b + 1) % 4, lane, a[(b + 1) & 1], s_lo, s_hi);
      } else {
        wg::wait<0>();
        if constexpr (PAT == kFold || PAT == kDequantFold) {
          wg::fence_regs(part);
#pragma unroll
          for (int i = 0; i < ND; ++i) acc[i] = fmaf(part[i], (i & 2) ? s_hi : s_lo, acc[i]);
        } else {
          wg::fence_regs(acc);
        }
      }
    }
  }
  wg::wait<0>();
  wg::fence_regs(acc);
  const long long t1 = clock64();
  if (CP && lane == 0) atomicAdd(const_cast<int*>(finished), 1);
  float sum = 0.0f;
  for (int i = 0; i < ND; ++i) sum += acc[i];
  if (sum == 1234.5f) sink[threadIdx.x] = sum;  // keeps the mma's
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

struct Buffers {
  long long* cycles;
  float* sink;
  unsigned char* copy_src;
  float* copies;
};

template <int NTOK, int WG, int PAT, bool SWZ, bool ORD = false, bool CP = false>
void run(const harness::Device& dev, const Buffers& buf, float copy_rate = 0.0f) {
  constexpr auto kernel = rate<NTOK, WG, PAT, SWZ, ORD, CP>;
  const int smem = smem_bytes<WG, CP>(NTOK, PAT);
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  std::vector<float> us;
  long long worst = 0;
  double copied = 0.0;
  for (int rep = 0; rep < 5; ++rep) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaEventRecord(e0, dev.stream));
    kernel<<<dev.sms, WG * 128 + (CP ? 32 : 0), smem, dev.stream>>>(kIters, buf.sink, buf.cycles, buf.copy_src,
                                                                      copy_rate, buf.copies);
    CK(cudaGetLastError());
    CK(cudaEventRecord(e1, dev.stream));
    CK(cudaStreamSynchronize(dev.stream));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    us.push_back(ms * 1e3f);
    std::vector<long long> c(dev.sms);
    CK(cudaMemcpy(c.data(), buf.cycles, dev.sms * sizeof(long long), cudaMemcpyDeviceToHost));
    std::vector<float> cp(dev.sms);
    CK(cudaMemcpy(cp.data(), buf.copies, dev.sms * sizeof(float), cudaMemcpyDeviceToHost));
    if (rep > 0) worst = std::max(worst, *std::max_element(c.begin(), c.end()));
    if (rep > 0) copied += harness::median(cp) / 4;
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
  }
  const double ideal = static_cast<double>(kIters) * (kK / 16) * WG * NTOK / 2;
  const double flops = 2.0 * 64 * NTOK * 16 * (kK / 16) * WG * static_cast<double>(kIters) * dev.sms;
  const double t = harness::median(us);
  std::printf("%-13s %-7s %5d %3d %-10s %12lld %8.1f%% %9.1f %8.1f %8.1f\n", kPatternNames[PAT],
              ORD ? "ordered" : "free", NTOK, WG, SWZ ? "swizzle128" : "none", worst, 100.0 * ideal / worst, t,
              flops / t * 1e-6, CP ? copied : 0.0);
}

}  // namespace

int main() {
  const harness::Device dev;
  Buffers buf{};
  CK(cudaMalloc(&buf.cycles, dev.sms * sizeof(long long)));
  CK(cudaMalloc(&buf.sink, 1024 * sizeof(float)));
  CK(cudaMalloc(&buf.copies, dev.sms * sizeof(float)));
  CK(cudaMalloc(&buf.copy_src, kCopySrcBlocks * kCopyBytes));
  CK(cudaMemset(buf.copy_src, 0x3C, kCopySrcBlocks * kCopyBytes));
  std::printf("%s, %d SMs; %d iterations of 4 batches of 128 K a warpgroup\n", dev.prop.name, dev.sms, kIters);
  std::printf("%-13s %-7s %5s %3s %-10s %12s %9s %9s %8s %8s\n", "pattern", "issue", "ntok", "wg", "B layout", "cycles",
              "of peak", "us", "TFLOP/s", "copy B/c");
#define R(NT, W, P, S) run<NT, W, P, S>(dev, buf);
#define O(NT, W, P) run<NT, W, P, false>(dev, buf); run<NT, W, P, false, true>(dev, buf);
  R(128, 1, kStream, false) R(128, 2, kStream, false) R(128, 2, kStream, true) R(128, 2, kSS, true)
  R(128, 1, kFold, false) R(128, 1, kDequantFold, false) R(128, 1, kDequantWait, false)
  O(128, 2, kWait) O(128, 2, kFold) O(128, 2, kDequantFold) O(128, 2, kDequantWait) O(128, 2, kDequantPipe)
  O(128, 3, kDequantFold) O(128, 3, kDequantWait)
  O(96, 2, kDequantFold) O(96, 2, kDequantWait)
  O(64, 2, kDequantFold) O(64, 4, kFold) O(64, 4, kDequantFold) O(64, 4, kDequantWait) O(64, 4, kDequantPipe)
  O(48, 4, kDequantFold) O(32, 4, kDequantFold) O(32, 2, kDequantFold)
#undef O
#undef R
  // Shared-memory writes beside the mma's (the copy warp), bytes a cycle asked. (Not dequant-fold: with the copy warp
  // the CTA counts as 3 warpgroups for ptxas, whose 168 registers a thread spill that loop.)
  for (const float r : {10.0f, 20.0f, 40.0f, 60.0f, 80.0f, 120.0f})
    run<128, 2, kStream, false, false, true>(dev, buf, r);
  for (const float r : {20.0f, 40.0f, 60.0f}) run<128, 2, kDequantWait, false, true, true>(dev, buf, r);
  return 0;
}
