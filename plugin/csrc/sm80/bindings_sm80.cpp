// The ops of cublade._C_sm80: kernels for GPUs without Hopper's copy engine and wgmma (sm_80 / 86 / 89 machine code,
// compute_80 PTX for the driver to compile on later GPUs). A fragment of the `cublade` namespace, so it loads beside
// cublade._C or alone. Python entries, fakes and references: plugin/ops/w4a16_gemm.py, mxfp8_gemm.py.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(cublade, m) {
  // W4A16 GEMM: x [..., K] bf16 / fp16 @ int4 weights in w4a16_repack's layout -> [..., size_n] (x's dtype).
  // kernel_only: never the dequantize + cuBLAS path (tests, tuning); tiles: 16-row weight tiles per CTA (1, 2, 4;
  // 0: the launcher's rule; tests, tuning).
  m.def("w4a16_gemm_sm80(Tensor x, Tensor packed, int group_size, bool symmetric, int size_n, bool kernel_only=False, "
        "int tiles=0) -> Tensor");
  // 1-byte-weight GEMM (W8A16): x [..., K] bf16 @ W^T, W from mxfp8_repack's blob (e4m3 code * 2^(e - 127)), times
  // row_scale [size_n] when given (fp8 weights stored with unit exponents and their per-channel scale) -> bf16.
  // kernel_only, tiles: as w4a16_gemm_sm80's.
  m.def("mxfp8_gemm_sm80(Tensor x, Tensor packed, Tensor? row_scale, int size_n, bool kernel_only=False, "
        "int tiles=0) -> Tensor");
  m.def("mxfp8_dequant_packed_sm80(Tensor packed, int size_n, int size_k) -> Tensor");
}

static struct PyModuleDef cublade_c_sm80_module = {PyModuleDef_HEAD_INIT, "_C_sm80", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C_sm80(void) { return PyModule_Create(&cublade_c_sm80_module); }
