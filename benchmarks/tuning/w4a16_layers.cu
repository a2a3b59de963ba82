// A decode step's int4 (or MXFP8) GEMMs the way vLLM runs them: replayed from one CUDA graph, each GEMM right after
// a small kernel that writes its x (standing in for the norm / attention / activation kernels between a model's
// GEMMs), every layer with weights of its own (nothing is left in L2 by the previous replay). Stand-alone, on the H200:
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I plugin/csrc -I benchmarks/tuning \
//        benchmarks/tuning/w4a16_layers.cu -o /tmp/w4a16_layers        (add -DCUBLADE_LAYERS_MXFP8 for MXFP8)
//   /tmp/w4a16_layers [REPS [SHAPES [ROWS [LAYERS [sweep | phases | step]]]]]
//   (SHAPES: K x N pairs, by default Llama-3-8B's qkv, o, gate_up, down; ROWS up to 16, by default 1; LAYERS 32;
//   sweep: also every K split x ring depth x K slices of the streaming kernel, with the CTAs per SM each gives;
//   phases, in a build with -DCUBLADE_STREAM_STAMPS: where one op launch's time goes, from its CTAs' stamps;
//   step: the four shapes as one layer with idle gaps between them, the weights prefetched into L2 in the gaps;
//   built with -DCUBLADE_STREAM_K, rows for the streaming kernel as stream-K, every CTA the GPU holds sharing the
//   (tile group, chunk) units, at K slices 1 / 2 and 2-4 stages)
//
// Why: at one token an 8B model's int4 decode step in vLLM takes far longer than its weight bytes need, and the
// kernel-level rows (one launch between CUDA events after an L2 flush) do not show how a step runs its GEMMs. This
// program times the GEMMs as a step runs them, against the same graph with a plain read of the bytes in the GEMM's
// place, with the copy pipeline alone (int4) and with no GEMM at all (docs/decisions.md, "Small grids"). The GEMM as
// a programmatic dependent launch, its first weight stages requested before the x kernel ended, was slower on every
// shape; the x kernels of a model do not release their dependents early either.
#define CUBLADE_LOWBIT_ALL_TPW
#ifdef CUBLADE_LAYERS_MXFP8
#include "mxfp8_gemm.cu"
#else
#define CUBLADE_W4A16_ONE_TU  // the wide kernel's instantiations in this program too (w4a16_gemm_wide.cuh)
#include "w4a16_gemm.cu"
#include "null_policy.cuh"
#endif
#include "harness.cuh"
#include "l2_prefetch.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

// The weight format: its streaming-kernel policy, blob layout and the op's own launch and choices.
namespace fmt {
using bf16 = __nv_bfloat16;
#ifdef CUBLADE_LAYERS_MXFP8
constexpr const char* kName = "MXFP8";
constexpr int kPacketBytes = 1024, kRecordBytes = cublade::kMxfp8RecordBytes;
template <int NT> using Policy = cublade::Mxfp8Policy<NT>;
inline size_t workspace_bytes(int M, int K, int, int sms) { return cublade::mxfp8_gemm_workspace_bytes(M, K, 0, sms); }
inline int split(int groups, int chunks, int, int sms) { return cublade::lowbit::pick_split(groups, chunks, sms); }
inline cudaError_t op(const bf16* x, int M, int K, const void* w, bf16* out, int N, void* ws, int sms,
                      cudaStream_t st) {
  cublade::Mxfp8GemmArgs a;
  a.x = x; a.M = M; a.K = K; a.x_stride = K; a.packed = w;
  a.out = out; a.out_stride = N; a.N = N; a.workspace = ws; a.sms = sms;
  return cublade::launch_mxfp8_gemm(a, st);
}
#else
constexpr const char* kName = "int4 g128 sym";
constexpr int kGS = 128;
constexpr int kPacketBytes = 512, kRecordBytes = cublade::int4_sbytes<kGS, false>();
template <int NT> using Policy = cublade::Int4Policy<bf16, NT, kGS, false>;
inline size_t workspace_bytes(int M, int K, int N, int sms) {
  return cublade::w4a16_gemm_workspace_bytes(M, K, N, kGS, 0, sms);
}
inline int split(int groups, int chunks, int M, int sms) { return cublade::w4a16_stream_split(groups, chunks, M, sms); }
inline cudaError_t op(const bf16* x, int M, int K, const void* w, bf16* out, int N, void* ws, int sms,
                      cudaStream_t st) {
  cublade::W4a16GemmArgs a;
  a.x = x; a.M = M; a.K = K; a.x_stride = K; a.packed = w; a.group_size = kGS;
  a.out = out; a.out_stride = N; a.N = N; a.workspace = ws; a.sms = sms;
  return cublade::launch_w4a16_gemm(a, st);
}
#endif
// The streaming kernel as configured in p (tpw, ksl, stages), S splits.
template <int NT>
cudaError_t stream(cublade::lowbit::GemmParams p, int S, cudaStream_t st) {
  p.xrows = std::min(8 * NT, p.M);
  p.sbytes = kRecordBytes;
  return cublade::lowbit::launch_tpw<Policy<NT>>(p, 1, S, st);
}
}  // namespace fmt

namespace {

using bf16 = __nv_bfloat16;

// The stand-in for the kernels between two GEMMs: rewrites x, as a norm or an activation does at decode (a
// different x per layer).
#ifdef CUBLADE_STREAM_STAMPS
__device__ unsigned long long g_x_end = 0;  // the latest end of a write_x block (globaltimer ns)
#endif
__global__ void write_x(bf16* x, int n, int layer) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    x[i] = __float2bfloat16(float((i * 7 + layer * 3) % 17 - 8) * 0.0625f);
#ifdef CUBLADE_STREAM_STAMPS
  __syncthreads();
  if (threadIdx.x == 0) atomicMax(&g_x_end, cublade::lowbit::globaltimer_ns());
#endif
}

#ifdef CUBLADE_STREAM_STAMPS
// The smallest step of %globaltimer seen by one thread reading it back to back (its update period on this GPU).
__global__ void globaltimer_step(unsigned long long* out) {
  unsigned long long prev = cublade::lowbit::globaltimer_ns(), step = ~0ull;
  for (int i = 0; i < 20000; ++i) {
    const unsigned long long t = cublade::lowbit::globaltimer_ns();
    if (t != prev) step = t - prev < step ? t - prev : step;
    prev = t;
  }
  *out = step;
}

// One op launch's phases from its CTAs' stamps (w4a16_gemm.cuh, kStampSlots per CTA; CTAs that exited early wrote
// none): the GEMM's first CTA start after its x kernel's end, and per CTA (SM clock cycles at clock_khz) the wait for
// its first stage, the stream to its last stage, the math after the last stage, the epilogue (K-slice and split sums,
// stores); medians and maxima over the CTAs; the span from the x kernel's end to the last CTA's end.
void print_phases(const char* shape, int M, const std::vector<unsigned long long>& st, int groups,
                  unsigned long long x_end, double clock_khz, double gemm_us) {
  const int S = cublade::lowbit::kStampSlots;
  std::vector<float> first, stream, math, epi, total;
  // With K splits, the epilogue of rank 0 (the split that sums and stores) and of the others, in three parts: the
  // K-slice sum and the split's sums written (4 -> 8), the first cluster barrier (8 -> 9: its latency and the wait
  // for the cluster's slowest split), then to the end (rank 0's reads of the others' sums and its stores, and the
  // second barrier).
  std::vector<float> own[2], bar1[2], rest[2];
  unsigned long long start_min = ~0ull, start_max = 0, end_max = 0;
  for (size_t c = 0; c + S <= st.size(); c += S) {
    const unsigned long long* v = &st[c];
    if (v[0] == 0 || v[2] == 0 || v[3] == 0 || v[4] == 0 || v[5] == 0) continue;
    auto us = [&](unsigned long long a, unsigned long long b) { return float(double(b - a) / clock_khz * 1e3); };
    first.push_back(us(v[1], v[2]));
    stream.push_back(us(v[2], v[3]));
    math.push_back(us(v[3], v[4]));
    epi.push_back(us(v[4], v[5]));
    if (v[8] != 0 && v[9] != 0) {
      const int r = (c / S) / groups > 0;  // blockIdx.y: the split
      own[r].push_back(us(v[4], v[8]));
      bar1[r].push_back(us(v[8], v[9]));
      rest[r].push_back(us(v[9], v[5]));
    }
    total.push_back(us(v[1], v[5]));
    start_min = std::min(start_min, v[0]);
    start_max = std::max(start_max, v[0]);
    end_max = std::max(end_max, v[6]);
  }
  if (total.empty()) {
    std::printf("%-11s %3d phases: no stamps\n", shape, M);
    return;
  }
  auto mx = [](const std::vector<float>& v) { return *std::max_element(v.begin(), v.end()); };
  auto gt_us = [](unsigned long long a, unsigned long long b) {  // globaltimer b - a, ns -> us (signed)
    return b >= a ? double(b - a) * 1e-3 : -double(a - b) * 1e-3;
  };
  std::printf("%-11s %3d phases (%zu CTAs, gemm %.2f us): start after x %.2f..%.2f us, span x end -> last end %.2f "
              "us; per CTA median / max us: first stage %.2f / %.2f, stream %.2f / %.2f, math after it %.2f / %.2f, "
              "epilogue %.2f / %.2f, CTA %.2f / %.2f\n",
              shape, M, total.size(), gemm_us, gt_us(x_end, start_min), gt_us(x_end, start_max), gt_us(x_end, end_max),
              harness::median(first), mx(first), harness::median(stream), mx(stream), harness::median(math), mx(math),
              harness::median(epi), mx(epi), harness::median(total), mx(total));
  for (int r = 0; r < 2; ++r)
    if (!own[r].empty())
      std::printf("%-11s %3d   epilogue of %s (%zu CTAs), median / max us: K-slice sum + sums written %.2f / "
                  "%.2f, first cluster barrier %.2f / %.2f, then to the end %.2f / %.2f\n",
                  shape, M, r ? "the other splits" : "rank 0", own[r].size(), harness::median(own[r]), mx(own[r]),
                  harness::median(bar1[r]), mx(bar1[r]), harness::median(rest[r]), mx(rest[r]));
}
#endif

// One weight shape: a blob per layer (timing only: every byte 0x11, so codes 1 and small positive scales).
struct Matrix {
  int K, N, groups, chunks;
  size_t bytes;  // one layer's blob
  unsigned char* blobs = nullptr;
  bf16* out = nullptr;
  void* ws = nullptr;       // the wide kernel's, which the op runs from 9 rows on large weights
  void* wide_ws = nullptr;  // int4: for a wide pass of 9-16 rows on any weight (the "wide pass" row)
  Matrix(int K_, int N_, int layers, int max_m)
      : K(K_), N(N_), groups((N_ + 63) / 64), chunks((K_ + 511) / 512),
        bytes(size_t(groups) * chunks * 4 * (8 * fmt::kPacketBytes + fmt::kRecordBytes)) {
    CK(cudaMalloc(&blobs, bytes * layers));
    CK(cudaMemset(blobs, 0x11, bytes * layers));
    CK(cudaMalloc(&out, size_t(max_m) * N * sizeof(bf16)));
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    if (const size_t b = fmt::workspace_bytes(max_m, K, N, sms)) CK(cudaMalloc(&ws, b));
#ifndef CUBLADE_LAYERS_MXFP8
    namespace wd = cublade::wide;
    if (max_m >= wd::kMinSmallRows)
      CK(cudaMalloc(&wide_ws, wd::workspace_bytes(max_m, K, wd::ntok(max_m), false, sms)));
#endif
  }
  const unsigned char* blob(int layer) const { return blobs + bytes * layer; }
};

// CTAs of the streaming kernel (NT token tiles, TPW tiles per warp, KSL K slices) that one SM holds.
template <int NT, int TPW, int KSL>
int ctas_per_sm(int xrows, int stages) {
  const cublade::lowbit::LayoutOf<fmt::kPacketBytes> L{fmt::kRecordBytes, xrows, stages};
  return cublade::lowbit::ctas_per_sm<fmt::Policy<NT>, TPW, KSL>(L.total(NT, KSL));
}

// The sweep's (tiles per warp, K slices) for NT token tiles: the production choice first, then more consumer warps.
struct Warps {
  int tpw, ksl;
};
std::vector<Warps> warp_choices(int nt) {
  return nt == 1 ? std::vector<Warps>{{1, 1}, {1, 2}, {1, 4}} : std::vector<Warps>{{2, 2}, {2, 4}, {1, 1}};
}
int ctas_per_sm(int nt, Warps w, int xrows, int stages) {
  if (nt == 1)
    return w.ksl == 1 ? ctas_per_sm<1, 1, 1>(xrows, stages) : w.ksl == 2 ? ctas_per_sm<1, 1, 2>(xrows, stages)
                                                                         : ctas_per_sm<1, 1, 4>(xrows, stages);
  return w.tpw == 1 ? ctas_per_sm<2, 1, 1>(xrows, stages) : w.ksl == 2 ? ctas_per_sm<2, 2, 2>(xrows, stages)
                                                                         : ctas_per_sm<2, 2, 4>(xrows, stages);
}


// The "step" rows: a decode step's layer as the GEMMs see it, every gap a kernel that leaves HBM idle (a clock spin
// on one CTA: attn_us before o_proj for attention, gap_us before the others for the norms and the activation), and
// the weights of the GEMM after a gap prefetched into L2 (l2_prefetch.cuh) on a second stream, forked when the GEMM
// before the gap ends and joined when the gap's GEMM starts. A prefetch of fraction f brings in the first f of every
// CTA's part of the weight (each (tile group, K split) walks its own part from its start).
__global__ void spin_cycles(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

using LaunchFn = std::function<cudaError_t(const Matrix&, int, int)>;

int step_rows(const std::vector<Matrix>& mats, const std::vector<int>& ms, int layers, int reps, int sms,
              cudaStream_t st, const LaunchFn& op, bf16* x) {
  if (mats.size() != 4) {
    std::fprintf(stderr, "step: four shapes (qkv, o, gate_up, down)\n");
    return 1;
  }
  int clock_khz = 0;
  CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const double attn_us = 12, gap_us = 3;
  cudaStream_t side;
  CK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  std::vector<cudaEvent_t> ev(2 * 4 * layers + 2);
  for (auto& e : ev) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  const size_t chunk_bytes = size_t(4) * (8 * fmt::kPacketBytes + fmt::kRecordBytes);
  // f[i]: the fraction of matrix i prefetched in the gap before it; chunk / ctas: the prefetch launch's.
  struct Plan {
    std::string name;
    double f[4];
    uint32_t chunk = cublade::kL2PrefetchChunk;
    int ctas = cublade::kL2PrefetchCtas;
    // how the prefetch runs: 0 on the second stream, joined at its GEMM; 1 on the second stream, joined at the
    // graph's end only (nothing waits for it); 2 on st itself, right after the GEMM before the gap (its bulk
    // prefetches outlive the kernel that issues them)
    int how = 0;
  };
  std::vector<Plan> plans = {{"no prefetch", {0, 0, 0, 0}}};
  for (const uint32_t chunk : {16u << 10})
    for (const int ctas : {16, 132}) {
      char n[64];
      std::snprintf(n, sizeof n, "o whole, chunk %uK x %d CTAs", chunk >> 10, ctas);
      plans.push_back({n, {0, 1, 0, 0}, chunk, ctas});
    }
  const char* names[4] = {"qkv", "o", "gate_up", "down"};
  for (int i : {0, 2, 3})
    for (const double f : {0.1, 0.2, 0.5}) {
      char n[64];
      std::snprintf(n, sizeof n, "o whole + %s %.2f", names[i], f);
      Plan pl{n, {0, 1, 0, 0}};
      pl.f[i] = f;
      plans.push_back(pl);
    }
  for (const int how : {0, 1, 2})
    for (const double f : {0.0, 0.1, 0.2, 0.35, 0.5}) {
      char n[64];
      std::snprintf(n, sizeof n, "%s: o whole + every other %.2f", how == 0 ? "join" : how == 1 ? "no join" : "on st",
                    f);
      Plan pl{n, {f, 1, f, f}};
      pl.how = how;
      plans.push_back(pl);
    }
  std::printf("step rows: per layer x + GEMM for qkv, o, gate_up, down; a %.0f us spin before o (attention), %.0f us "
              "before the others; us per layer, median of %d replays of %d layers\n", attn_us, gap_us, reps, layers);
  for (const int M : ms) {
    double base = 0;
    for (const Plan& pl : plans) {
      const double us = harness::graph_us(st, reps, [&] {
        int e = 0;
        for (int l = 0; l < layers; ++l)
          for (int i = 0; i < 4; ++i) {
            const Matrix& m = mats[i];
            const bool pre = pl.f[i] > 0;
            if (pre) {  // fork: the previous GEMM has ended on st
              cudaStream_t on = pl.how == 2 ? st : side;
              if (pl.how != 2) {
                CK(cudaEventRecord(ev[e], st));
                CK(cudaStreamWaitEvent(side, ev[e], 0));
              }
              const int S = fmt::split(m.groups, m.chunks, M, sms);
              const size_t group_bytes = size_t(m.chunks) * chunk_bytes;
              const bool even = m.chunks % S == 0;
              const size_t seg = even ? group_bytes / S : group_bytes;
              const size_t head = std::min(seg, (size_t(pl.f[i] * double(seg)) + 15) & ~size_t(15));
              CK(cublade::launch_l2_prefetch(m.blob(l), size_t(m.groups) * (even ? S : 1), seg, head, on,
                                             pl.chunk, pl.ctas));
              if (pl.how != 2) CK(cudaEventRecord(ev[e + 1], side));
            }
            spin_cycles<<<1, 32, 0, st>>>((long long)((i == 1 ? attn_us : gap_us) * clock_khz * 1e-3));
            write_x<<<64, 256, 0, st>>>(x, M * m.K, l);
            CK(cudaGetLastError());
            if (pre && pl.how == 0) CK(cudaStreamWaitEvent(st, ev[e + 1], 0));  // join
            if (pre) e += 2;
            CK(op(m, l, M));
          }
        if (pl.how == 1 && e > 0) CK(cudaStreamWaitEvent(st, ev[e - 1], 0));  // the capture's one join
      }) / layers;
      if (pl.name == "no prefetch") base = us;
      std::printf("step %3d %-40s %9.2f us/layer  %.3fx\n", M, pl.name.c_str(), us, base / us);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = harness::reps_arg(argc, argv);
  const harness::Device device;
  const harness::Flushes flush(device);  // its sink serves the plain read
  const int sms = device.sms;
  cudaStream_t st = device.stream;
  const std::vector<int> kn = harness::sizes_arg(argc, argv, 2, {4096, 6144, 4096, 4096, 4096, 28672, 14336, 4096});
  const std::vector<int> ms = harness::sizes_arg(argc, argv, 3, {1});
  const int layers = argc > 4 ? std::max(1, std::atoi(argv[4])) : 32;
  const bool sweep = argc > 5 && std::strcmp(argv[5], "sweep") == 0;
  const bool phases = argc > 5 && std::strcmp(argv[5], "phases") == 0;
  const bool step = argc > 5 && std::strcmp(argv[5], "step") == 0;
#ifndef CUBLADE_STREAM_STAMPS
  if (phases) {
    std::fprintf(stderr, "phases: build with -DCUBLADE_STREAM_STAMPS\n");
    return 1;
  }
#endif
  const int max_m = *std::max_element(ms.begin(), ms.end());
  int max_k = 0;
  for (size_t i = 0; i < kn.size(); i += 2) max_k = std::max(max_k, kn[i]);
  if (max_m > 16) {
    std::fprintf(stderr, "rows up to 16 (the streaming kernel's range)\n");
    return 1;
  }
  std::vector<Matrix> mats;
  for (size_t i = 0; i + 1 < kn.size(); i += 2) mats.emplace_back(kn[i], kn[i + 1], layers, max_m);
  bf16* x;
  CK(cudaMalloc(&x, size_t(max_m) * max_k * sizeof(bf16)));
  std::printf("%s; device: %s, %d SMs; %d layers, a graph of (x kernel, GEMM) pairs per row, median of %d replays; "
              "gemm_us: the row's pair minus the x kernel alone\n", fmt::kName, device.prop.name, sms, layers, reps);
  std::printf("%-11s %3s %-30s %9s %9s %7s %s\n", "KxN", "M", "variant", "pair_us", "gemm_us", "TB/s", "check");
#ifdef CUBLADE_STREAM_STAMPS
  int clock_khz_i = 0;
  CK(cudaDeviceGetAttribute(&clock_khz_i, cudaDevAttrClockRate, 0));
  const double clock_khz = clock_khz_i;
  if (phases) {
    unsigned long long* d_step;
    unsigned long long step = 0;
    CK(cudaMalloc(&d_step, sizeof(step)));
    globaltimer_step<<<1, 1, 0, st>>>(d_step);
    CK(cudaMemcpy(&step, d_step, sizeof(step), cudaMemcpyDeviceToHost));
    CK(cudaFree(d_step));
    std::printf("phases: SM clock %.0f MHz (the attribute; cycles -> us at it), %%globaltimer step %llu ns\n",
                clock_khz * 1e-3, step);
  }
#endif

  // A variant launches one GEMM (or its stand-in) of matrix m, layer l, M rows on st.
  using Launch = std::function<cudaError_t(const Matrix&, int, int)>;
  auto params = [&](const Matrix& m, int l, int M) {
    cublade::lowbit::GemmParams p = {};
    p.x = x; p.x_stride = m.K; p.M = M; p.K = m.K; p.w = m.blob(l);
    p.tiles = (m.N + 15) / 16; p.groups = m.groups; p.chunks = m.chunks;
    p.out = m.out; p.out_stride = m.N; p.N = m.N; p.sms = sms;
    return p;
  };
  auto split = [&](const Matrix& m, int M) { return fmt::split(m.groups, m.chunks, M, sms); };
  // The streaming kernel with the op's split times split_mult (or S when given), tpw / ksl / stages (0: the op's).
  auto stream = [&](int tpw, int ksl, int split_mult, int S = 0, int stages = 0) -> Launch {
    return [=, &params, &split](const Matrix& m, int l, int M) {
      cublade::lowbit::GemmParams p = params(m, l, M);
      p.tpw = tpw; p.ksl = ksl; p.stages = stages;
      const int s = S > 0 ? S : split(m, M) * split_mult;
      if (s > cublade::lowbit::kMaxSplit || m.chunks < s) return cudaErrorInvalidValue;
      const int nt = cublade::lowbit::token_tiles(M);
      return nt == 1 ? fmt::stream<1>(p, s, st) : fmt::stream<2>(p, s, st);
    };
  };
  const Launch op = [&](const Matrix& m, int l, int M) {
    return fmt::op(x, M, m.K, m.blob(l), m.out, m.N, m.ws, sms, st);
  };
  if (step) return step_rows(mats, ms, layers, reps, sms, st, op, x);
  struct Variant {
    std::string name;
    Launch f;
  };
  std::vector<Variant> variants = {
      {"x kernel only", [](const Matrix&, int, int) { return cudaSuccess; }},
      {"plain read of the bytes", [&](const Matrix& m, int l, int) {
         harness::plain_read<<<4 * sms, 512, 0, st>>>(reinterpret_cast<const uint4*>(m.blob(l)), m.bytes / 16,
                                                     flush.sink);
         return cudaGetLastError();
       }},
      {"op", op},
      {"2 K slices", stream(0, 2, 1)},  // tpw 1 (M <= 8): 8 consumer warps; tpw 2 (9-16 rows): 4, as the op
      {"4 K slices", stream(0, 4, 1)},
      {"2x splits", stream(0, 0, 2)},
  };
#ifdef CUBLADE_STREAM_K
  // Stream-K (w4a16_gemm.cuh, StreamK): as many CTAs as the GPU holds at once share the (tile group, chunk) units.
  for (const int ksl : {1, 2})
    for (const int stages : {2, 3, 4})
      variants.push_back({"stream-K ksl " + std::to_string(ksl) + " stages " + std::to_string(stages),
                          [=, &params](const Matrix& m, int l, int M) -> cudaError_t {
                            if (cublade::lowbit::token_tiles(M) != 1) return cudaErrorInvalidValue;
                            cublade::lowbit::GemmParams p = params(m, l, M);
                            p.stages = stages;
                            p.xrows = M;
                            p.sbytes = fmt::kRecordBytes;
                            return ksl == 1 ? cublade::lowbit::launch_stream_k<fmt::Policy<1>, 1, 1>(p, 0, st)
                                            : cublade::lowbit::launch_stream_k<fmt::Policy<1>, 1, 2>(p, 0, st);
                          }});
#endif
#ifndef CUBLADE_LAYERS_MXFP8
  variants.insert(variants.begin() + 2, {"copy pipeline only", [&](const Matrix& m, int l, int M) {
                    if (M > 8) return cudaErrorInvalidValue;
                    cublade::lowbit::GemmParams p = params(m, l, M);
                    p.xrows = M;
                    p.sbytes = fmt::kRecordBytes;
                    return cublade::lowbit::launch_stream<NullPolicy, 1>(p, 1, split(m, M), st);
                  }});
  // The wide kernel's pass at 9-16 rows, which the op takes only on weights of 2^27 elements or more.
  variants.push_back({"wide pass", [&](const Matrix& m, int l, int M) {
                        if (M < cublade::wide::kMinSmallRows) return cudaErrorInvalidValue;
                        return cublade::wide::launch_pass<bf16>(fmt::kGS, false, x, m.K, M, m.K, m.blob(l), m.out, m.N,
                                                                m.N, m.wide_ws, sms, st);
                      }});
#endif

  std::vector<bf16> ref, got;
  for (const int M : ms) {
    double x_only_layer = 0;
    const int nt = cublade::lowbit::token_tiles(M);
    for (const Matrix& m : mats) {
      std::vector<Variant> rows = variants;
      if (sweep)
        for (const Warps w : warp_choices(nt))
          for (const int S : {1, 2, 4, 8})
            for (const int stages : {2, 3, 4, 6}) {
              const int per_sm = ctas_per_sm(nt, w, std::min(M, 8 * nt), stages);
              if (per_sm == 0) continue;
              char name[64];
              std::snprintf(name, sizeof name, "tpw %d ksl %d S %d stages %d (%d/SM)", w.tpw, w.ksl, S, stages,
                            per_sm);
              rows.push_back({name, stream(w.tpw, w.ksl, 0, S, stages)});
            }
      double x_only = 0;
      [[maybe_unused]] double op_us = 0;  // the op's GEMM time, for the phases line
      for (const Variant& v : rows) {
        CK(cudaStreamSynchronize(st));
        if (v.f(m, 0, M) != cudaSuccess) {  // what the variant cannot launch here (probed outside the graph)
          (void)cudaGetLastError();
          continue;
        }
        const double us = harness::graph_us(st, reps, [&] {
          for (int l = 0; l < layers; ++l) {
            write_x<<<64, 256, 0, st>>>(x, M * m.K, l);
            CK(cudaGetLastError());
            CK(v.f(m, l, M));
          }
        }) / layers;
        // The outputs after the replays (the last layer's x): each GEMM row against the op's.
        std::string check;
        if (v.name != "x kernel only" && v.name != "plain read of the bytes" && v.name != "copy pipeline only") {
          got.resize(size_t(M) * m.N);
          CK(cudaMemcpy(got.data(), m.out, got.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
          if (v.name == "op") ref = got;
          const double rel = harness::rel_diff(got, ref);
          char c[48];
          std::snprintf(c, sizeof c, "%s rel %.1e", rel <= 2e-3 ? "ok" : "FAIL", rel);
          check = c;
        }
        if (v.name == "x kernel only") x_only = us;
        const double g = us - x_only;
        if (v.name == "op") op_us = g;
        std::printf("%5dx%-5d %3d %-30s %9.2f %9.2f %7.2f %s\n", m.K, m.N, M, v.name.c_str(), us, g,
                    g > 0 ? double(m.bytes) / g * 1e-6 : 0.0, check.c_str());
      }
      x_only_layer += x_only;
#ifdef CUBLADE_STREAM_STAMPS
      if (phases) {  // the op's graph once more with the stamps on: the last layer's launch is what they hold
        const size_t n = size_t(m.groups) * cublade::lowbit::kMaxSplit * cublade::lowbit::kStampSlots;
        unsigned long long *d_st = nullptr, *none = nullptr;
        CK(cudaMalloc(&d_st, n * sizeof(unsigned long long)));
        CK(cudaMemset(d_st, 0, n * sizeof(unsigned long long)));
        CK(cudaMemcpyToSymbol(cublade::lowbit::g_stream_stamps, &d_st, sizeof(d_st)));
        harness::graph_us(st, 3, [&] {
          for (int l = 0; l < layers; ++l) {
            write_x<<<64, 256, 0, st>>>(x, M * m.K, l);
            CK(cudaGetLastError());
            CK(op(m, l, M));
          }
        });
        std::vector<unsigned long long> h(n);
        unsigned long long x_end = 0;
        CK(cudaMemcpy(h.data(), d_st, n * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
        CK(cudaMemcpyFromSymbol(&x_end, g_x_end, sizeof(x_end)));
        CK(cudaMemcpyToSymbol(cublade::lowbit::g_stream_stamps, &none, sizeof(none)));
        CK(cudaFree(d_st));
        char shape[24];
        std::snprintf(shape, sizeof shape, "%dx%d", m.K, m.N);
        print_phases(shape, M, h, m.groups, x_end, clock_khz, op_us);
      }
#endif
    }
    // A whole layer: the four matrices in a row, each after its x kernel.
    const double us = harness::graph_us(st, reps, [&] {
      for (int l = 0; l < layers; ++l)
        for (const Matrix& m : mats) {
          write_x<<<64, 256, 0, st>>>(x, M * m.K, l);
          CK(cudaGetLastError());
          CK(op(m, l, M));
        }
    }) / layers;
    std::printf("%-11s %3d %-30s %9.2f %9.2f\n", "layer", M, "all matrices, op", us, us - x_only_layer);
  }
  std::printf("done\n");
  return 0;
}
