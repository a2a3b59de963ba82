// The streaming W4A16 kernel with the math taken out, for the tuning programs that time its copy pipeline alone
// (w4a16_pipeline.cu, w4a16_layers.cu): bulk copies, mbarriers and ring as in production; the consumers wait for
// each stage, read one word of their packet and release it. Include after w4a16_gemm.cu.
#pragma once

struct NullPolicy {
  using T = __nv_bfloat16;
  static constexpr int NT = 1;
  static constexpr int kPacketBytes = 512;
  struct State {};
  template <int kSliceK>
  __device__ static const unsigned char* slice_records(const unsigned char* srec, int) { return srec; }
  __device__ static const float* row_scale(const cublade::lowbit::GemmParams&, int) { return nullptr; }
  template <int j, int kSliceK>
  __device__ static void packet(State&, const uint4 (&q)[1], const unsigned char*, const uint4 (&)[2][1],
                                float (&acc)[1][4], int) {
    acc[0][0] += __uint_as_float(q[0].x & 1u);  // keeps the shared-memory read of the packet
  }
};
