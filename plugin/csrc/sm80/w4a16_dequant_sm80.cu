// The int4 blob's dequantize kernels (w4a16_dequant.cu) built into cublade._C_sm80 too: the prefill path of
// w4a16_gemm_sm80 (lowbit_gemm_sm80_torch.cpp). Its FP8 form needs sm_89 (E4M3 conversions) and traps below.
#include "w4a16_dequant.cu"
