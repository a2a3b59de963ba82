// The wide W4A16 kernel (wgmma, w4a16_gemm.cu namespace wide) against the streaming kernel, on four Llama-70B-like
// shapes (K x N: 8192x28672, 4096x14336, 28672x8192, 8192x10240; others with a third argument, e.g.
// 4096x4096,4096x6144), M = 1..512: checks both against a host reference
// on sampled rows, and times every configuration (kVariants: tokens per pass, warpgroups per CTA, K per stage, PDL;
// x K splits 1 / 2 / 4, or "sk": stream-K) after do_bench's memset flush.
// Stand-alone (CUDA runtime only), on the H200:
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I plugin/csrc \
//        benchmarks/tuning/w4a16_wide.cu -o /tmp/w4a16_wide && /tmp/w4a16_wide [REPS [M,M,... [KxN,KxN,...]]]
//
// Weights: random codes, random bf16 scales in [2^-8, 2^-6) per group of 128 (symmetric). "ref err": over sampled
// outputs, the largest |kernel - host| / (|host| / 128 + 2e-3 mean |host|) (host: the blob decoded, fp64 sums;
// for passes of more than 128 tokens, Int4PrescaledBatch's, the decoded weights rounded to bf16 first); <= 1 is "ok"
// (one bf16 rounding of the output). Rows with "-" for variant and S: the production choices ("- rounded": with
// W4a16GemmArgs::rounded, as the torch op runs bf16 x; "- exact": without).
#define CUBLADE_W4A16_ONE_TU  // the wide kernel's instantiations in this program too (w4a16_gemm_wide.cuh)
#include "w4a16_gemm.cu"
#include "harness.cuh"
#include "int4_problem.cuh"

#include <cmath>
#include <cstring>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace {

using bf16 = __nv_bfloat16;
constexpr int kGS = 128;

float bf16_bits_to_float(uint32_t b) {
  const uint32_t v = b << 16;
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}
uint16_t float_to_bf16_bits(float f) {  // round to nearest even (finite inputs)
  uint32_t v;
  std::memcpy(&v, &f, 4);
  return uint16_t((v + 0x7FFF + ((v >> 16) & 1)) >> 16);
}

// Host decode of output row n of the blob (w4a16_gemm.cu's layout): w[k] for k < K.
std::vector<double> decode_row(const std::vector<uint32_t>& blob, int n, int K, int chunks, int words) {
  std::vector<double> w(K, 0.0);
  const int group = n / 64, tile = (n % 64) / 16, g = n % 8, hi = (n % 16) / 8;
  for (int c = 0; c < chunks; ++c) {
    const uint32_t* tb = blob.data() + ((size_t(group) * chunks + c) * 4 + tile) * words;
    for (int j = 0; j < 8; ++j)
      for (int t = 0; t < 4; ++t)
        for (int s = 0; s < 4; ++s) {
          const uint32_t q = tb[j * 128 + (4 * g + t) * 4 + s];
          const int k0 = c * 512 + 64 * j + 32 * (s / 2) + 8 * t + 4 * (s % 2);
          // nibble slots (row g: 0, 4, 2, 6; row g + 8: 1, 5, 3, 7) hold K0, K0+1, K0+2, K0+3
          const int slots[2][4] = {{0, 4, 2, 6}, {1, 5, 3, 7}};
          for (int e = 0; e < 4; ++e) {
            const int k = k0 + e;
            if (k >= K) continue;
            const uint32_t rec = tb[1024 + ((k % 512) / kGS) * 8 + g];
            const double scale = bf16_bits_to_float(hi ? rec >> 16 : rec & 0xFFFF);
            const int u = (q >> (4 * slots[hi][e])) & 0xF;
            w[k] = (u - 8) * scale;
          }
        }
  }
  return w;
}

// The wide kernel's configurations: tokens per pass (wgmma N), consumer warpgroups per CTA, K per ring stage,
// and whether the kernel is a programmatic dependent launch of the x prep; more than 128 tokens: prescaled batches
// (Int4PrescaledBatch, the weights rounded once to bf16). M > tokens per pass runs passes.
struct Variant {
  int ntok, wg, ks;
  bool pdl;
  bool pre() const { return ntok > cublade::wide::kMaxPassRows; }
  std::string name() const {
    return "n" + std::to_string(ntok) + " wg" + std::to_string(wg) + " k" + std::to_string(ks) + (pdl ? " pdl" : "");
  }
};
const Variant kVariants[] = {
    {8, 2, 512, true},  {8, 4, 512, true},  {8, 4, 256, true},  {16, 2, 512, true},  {16, 4, 512, true},
    {16, 4, 256, true},
    {32, 2, 512, true}, {32, 4, 512, true}, {48, 2, 512, true}, {48, 4, 256, true},  {64, 2, 512, true},
    {64, 4, 256, true}, {96, 2, 256, true}, {128, 2, 256, true}, {64, 2, 512, false}, {128, 2, 256, false},
    {192, 2, 128, true}, {256, 2, 128, true},
};
// The variants a sweep row of M times: the production tier's token count, the next tier up (what a coarser rule
// would run), and for M > 128 the multi-pass sizes.
bool applies(const Variant& v, int M) {
  if (M <= 16) return v.ntok == 16 || (M <= 8 && v.ntok == 8);  // the small-M tiers (the streaming kernel's range)
  if (v.ntok < 32) return false;
  const int m = std::min(M, 128), nt = cublade::wide::ntok(m);
  return v.ntok == nt || (m > 32 && m <= 64 && v.ntok == 64) || (m > 64 && v.ntok == 128) ||
         (M > 128 && (v.ntok == 96 || v.ntok == 192 || v.ntok == 256));
}

template <int NTOK, int WG, int KS>
cudaError_t run_config(bool pdl, int S, const bf16* x, int M, int K, const void* blob, bf16* out, int N, void* ws,
                       int sms, cudaStream_t st) {
  for (int m0 = 0; m0 < M; m0 += NTOK) {  // passes of NTOK rows
    const int rows = std::min(NTOK, M - m0);
    const cudaError_t e = cublade::wide::launch<bf16, NTOK, kGS, false, WG, KS>(
        x + size_t(m0) * K, K, rows, K, static_cast<const unsigned char*>(blob), out + size_t(m0) * N, N, N, S, 0,
        pdl, ws, sms, st);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

cudaError_t run_variant(const Variant& v, int S, const bf16* x, int M, int K, const void* blob, bf16* out, int N,
                        void* ws, int sms, cudaStream_t st) {
#define CUBLADE_VARIANT(NT, W, KS_)                      \
  if (v.ntok == NT && v.wg == W && v.ks == KS_)          \
    return run_config<NT, W, KS_>(v.pdl, S, x, M, K, blob, out, N, ws, sms, st);
  CUBLADE_VARIANT(8, 2, 512) CUBLADE_VARIANT(8, 4, 512) CUBLADE_VARIANT(8, 4, 256) CUBLADE_VARIANT(16, 2, 512)
  CUBLADE_VARIANT(16, 4, 512) CUBLADE_VARIANT(16, 4, 256)
  CUBLADE_VARIANT(32, 2, 512) CUBLADE_VARIANT(32, 4, 512) CUBLADE_VARIANT(48, 2, 512) CUBLADE_VARIANT(48, 4, 256)
  CUBLADE_VARIANT(64, 2, 512) CUBLADE_VARIANT(64, 4, 256) CUBLADE_VARIANT(96, 2, 256) CUBLADE_VARIANT(128, 2, 256)
  CUBLADE_VARIANT(192, 2, 128) CUBLADE_VARIANT(256, 2, 128)
#undef CUBLADE_VARIANT
  return cudaErrorInvalidValue;
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = harness::reps_arg(argc, argv);
  std::vector<int> ms =  // the rows to time (at most 512)
      harness::sizes_arg(argc, argv, 2, {1, 4, 8, 12, 16, 17, 32, 40, 48, 64, 80, 96, 128, 192, 256});
  for (int& m : ms) m = std::min(m, 512);
  const harness::Device device;
  const harness::Flushes flush(device);
  const int sms = device.sms;
  cudaStream_t st = device.stream;
  std::printf("device: %s, %d SMs; median of %d launches after a 256 MB memset (do_bench's flush); wide = prep + "
              "kernel\n", device.prop.name, sms, reps);
  std::printf("%-11s %3s %-8s %-14s %2s %9s %7s %s\n", "KxN", "M", "kernel", "variant", "S", "us", "TB/s", "ref err");

  struct Shape { int K, N; };
  std::vector<Shape> shapes = {{8192, 28672}, {4096, 14336}, {28672, 8192}, {8192, 10240}};
  if (argc > 3) {  // KxN,KxN,...
    shapes.clear();
    for (const char* p = argv[3]; *p;) {
      char* end;
      const int K = int(std::strtol(p, &end, 10));
      const int N = *end == 'x' ? int(std::strtol(end + 1, &end, 10)) : 0;
      if (K < 128 || K % 128 != 0 || N < 64 || N % 64 != 0) {
        std::fprintf(stderr, "shapes: KxN with K a multiple of 128 and N of 64, e.g. 4096x4096,4096x6144\n");
        return 2;
      }
      shapes.push_back({K, N});
      p = *end ? end + 1 : end;
    }
  }
  for (const Shape sh : shapes) {
    const int K = sh.K, N = sh.N, max_m = 512;
    std::mt19937 rng(1234);
    std::uniform_real_distribution<float> Us(1.0f / 256, 1.0f / 64);
    const Int4Problem pb(K, N, max_m, rng, [&Us](std::mt19937& r) {
      return (uint32_t(float_to_bf16_bits(Us(r))) << 16) | float_to_bf16_bits(Us(r));
    });
    const int chunks = pb.chunks, words = pb.words;
    const double bytes = pb.bytes;
    const std::vector<uint32_t>& hb = pb.hblob;
    const std::vector<bf16>& hx = pb.hx;
    void *blob = pb.blob, *ws = pb.ws;
    bf16 *x = pb.x, *out = pb.out;
    std::vector<int> rows;  // sampled output rows, with their decoded weights
    std::vector<std::vector<double>> wrows, wrows_pre;  // and rounded to bf16 (the prescaled batches' weights)
    for (int i = 0; i < 24; ++i) {
      rows.push_back(i < 4 ? N - 1 - i : int(rng() % N));
      wrows.push_back(decode_row(hb, rows.back(), K, chunks, words));
      wrows_pre.push_back(wrows.back());
      for (double& w : wrows_pre.back()) w = bf16_bits_to_float(float_to_bf16_bits(float(w)));
    }
    for (const int M : ms) {
      std::vector<double> want(rows.size() * M), want_pre(rows.size() * M);
      double mean = 0;
      for (size_t r = 0; r < rows.size(); ++r)
        for (int m = 0; m < M; ++m) {
          double acc = 0, acc_pre = 0;
          for (int k = 0; k < K; ++k) {
            const double xv = __bfloat162float(hx[size_t(m) * K + k]);
            acc += wrows[r][k] * xv;
            acc_pre += wrows_pre[r][k] * xv;
          }
          want[r * M + m] = acc;
          want_pre[r * M + m] = acc_pre;
          mean += std::fabs(acc) / want.size();
        }
      // which rows the production launcher runs prescaled with `rounded` (the rows of its passes of over 128 rows)
      std::vector<bool> op_pre(M, false);
      for (int64_t m0 = 0, p; (p = cublade::wide::pass_rows(M - m0, N, K, true)) > 0; m0 += p)
        for (int64_t m = m0; m < m0 + p; ++m) op_pre[m] = p > cublade::wide::kMaxPassRows;
      const std::vector<bool> all_pre(M, true), none_pre(M, false);
      auto row = [&](const char* name, const char* variant, int S, const std::function<cudaError_t()>& f,
                     const std::vector<bool>& pre) {
        CK(cudaMemsetAsync(out, 0xFF, size_t(M) * N * sizeof(bf16), st));
        CK(f());
        CK(cudaStreamSynchronize(st));
        std::vector<bf16> ho(size_t(M) * N);
        CK(cudaMemcpy(ho.data(), out, ho.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
        double err = 0;
        for (size_t r = 0; r < rows.size(); ++r)
          for (int m = 0; m < M; ++m) {
            const double got = __bfloat162float(ho[size_t(m) * N + rows[r]]);
            const double w = (pre[m] ? want_pre : want)[r * M + m];  // one bf16 rounding, plus fp32 summation slack
            err = std::max(err, std::isfinite(got) ? std::fabs(got - w) / (std::fabs(w) / 128 + mean * 2e-3) : 1e9);
          }
        const double us = harness::time_us(f, flush.memset, reps, st);
        const std::string split = S == cublade::wide::kStreamKSplit ? "sk" : S ? std::to_string(S) : "-";
        std::printf("%5dx%-5d %3d %-8s %-14s %2s %9.2f %7.2f %.1e %s\n", K, N, M, name, variant, split.c_str(), us,
                    bytes / us * 1e-6, err, err <= 1.0 ? "ok" : "FAIL");
      };
      // the production launcher (rounded: may run rounded passes)
      auto op = [&](int split_k, void* workspace, bool rounded = true) {
        cublade::W4a16GemmArgs a;
        a.x = x; a.M = M; a.K = K; a.x_stride = K; a.packed = blob; a.group_size = kGS;
        a.out = out; a.out_stride = N; a.N = N; a.split_k = split_k; a.workspace = workspace; a.sms = sms;
        a.rounded = rounded;
        return cublade::launch_w4a16_gemm(a, st);
      };
      if (M <= 64) row("stream", "-", 0, [&] {  // the streaming kernel, its automatic split
        return op(cublade::w4a16_stream_split((N + 63) / 64, chunks, M, sms), nullptr);
      }, none_pre);
      // the production choice (split_k = 0: the wide kernel from 17 rows, from 9 on large weights)
      if (cublade::wide::pass_rows(M, N, K) > 0) {
        const bool pre = op_pre[0];
        row("wide", pre ? "- rounded" : "-", 0, [&] { return op(0, ws); }, op_pre);
        if (pre) row("wide", "- exact", 0, [&] { return op(0, ws, false); }, none_pre);
      }
      for (const Variant& v : kVariants) {
        if (!applies(v, M)) continue;
        for (const int S : {1, 2, 4, cublade::wide::kStreamKSplit}) {
          if (chunks < 2 * S) continue;  // (stream-K: S < 0)
          const auto f = [&, v, S] { return run_variant(v, S, x, M, K, blob, out, N, ws, sms, st); };
          if (f() != cudaSuccess) {  // does not fit the shared memory
            CK(cudaGetLastError());
            continue;
          }
          row("wide", v.name().c_str(), S, f, v.pre() ? all_pre : none_pre);
        }
      }
      {  // the x prep alone (part of every wide row), at the production pass size
        const int nt = cublade::wide::ntok(std::min(M, cublade::wide::kMaxPassRows));
        const int64_t units = int64_t(chunks) * nt * 64;
        auto prep = [&] {
          cublade::wide::prep_x<bf16><<<int(std::min<int64_t>((units + 255) / 256, 8LL * sms)), 256, 0, st>>>(
              x, K, std::min(M, nt), K, nt / 8, 512, chunks, static_cast<uint4*>(ws));
          return cudaGetLastError();
        };
        std::printf("%5dx%-5d %3d %-8s %-14s %2s %9.2f\n", K, N, M, "prep", "-", "-",
                    harness::time_us(prep, flush.memset, reps, st));
      }
    }
  }
  std::printf("done\n");
  return 0;
}
