// A random int4 W4A16 problem for the tuning programs that time the production kernels (w4a16_occupancy.cu,
// w4a16_wide.cu): the repacked blob at group size 128, symmetric (host and device copies), x [max_m, K] bf16 uniform
// in [-1, 1), an output buffer and the wide kernel's workspace. Include after w4a16_gemm.cu and harness.cuh.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <vector>

struct Int4Problem {
  static constexpr int kGS = 128;
  int K, N, groups, chunks, words;  // words: int32 per tile block (weights, then scale records)
  double bytes;                     // weights + scales, as the benches count them
  std::vector<uint32_t> hblob;
  std::vector<__nv_bfloat16> hx;
  void* blob = nullptr;
  __nv_bfloat16* x = nullptr;
  __nv_bfloat16* out = nullptr;
  void* ws = nullptr;

  // Weight words come from rng(), each scale-record word (two bf16 scales) from record(rng), in blob order; then x.
  Int4Problem(int K_, int N_, int max_m, std::mt19937& rng, const std::function<uint32_t(std::mt19937&)>& record)
      : K(K_), N(N_), groups((N_ + 63) / 64), chunks((K_ + 511) / 512),
        words(1024 + cublade::int4_sbytes<kGS, false>() / 4),
        bytes(double(N_) * K_ / 2 + double(N_) * (K_ / kGS) * 2) {
    hblob.resize(size_t(groups) * chunks * 4 * words);
    for (size_t i = 0; i < hblob.size(); ++i) hblob[i] = (i % words) < 1024 ? rng() : record(rng);
    hx.resize(size_t(max_m) * K);
    std::uniform_real_distribution<float> U(-1.0f, 1.0f);
    for (auto& v : hx) v = __float2bfloat16(U(rng));
    CK(cudaMalloc(&blob, hblob.size() * 4));
    CK(cudaMemcpy(blob, hblob.data(), hblob.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&x, hx.size() * sizeof(__nv_bfloat16)));
    CK(cudaMemcpy(x, hx.data(), hx.size() * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
    CK(cudaMalloc(&out, size_t(max_m) * N * sizeof(__nv_bfloat16)));
    int sms = 0;  // the stream-K part of the workspace is per SM
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaMalloc(&ws, cublade::w4a16_gemm_workspace_bytes(max_m, K, N, kGS, 0, sms, true)));
  }
  ~Int4Problem() {
    CK(cudaFree(blob)); CK(cudaFree(x)); CK(cudaFree(out)); CK(cudaFree(ws));
  }
  Int4Problem(const Int4Problem&) = delete;
  Int4Problem& operator=(const Int4Problem&) = delete;
};
