// The w4a16_gemm op's wide-kernel passes for bf16 activations (w4a16_gemm_wide.cuh): one translation unit per
// dtype, so that a parallel build compiles them beside w4a16_gemm.cu.
#define CUBLADE_KERNELS_ONLY  // framework-free (no torch header); the op's torch wrapper is w4a16_gemm_torch.cpp
#include "w4a16_gemm_wide.cuh"

namespace cublade {
namespace wide {
template cudaError_t launch_pass<__nv_bfloat16>(int, bool, const void*, int64_t, int, int, const unsigned char*,
                                        void*, int64_t, int, void*, int, cudaStream_t);
}  // namespace wide
}  // namespace cublade
