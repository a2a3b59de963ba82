// The schemas of every cublade op (one m.def line per op) and the Python module `cublade._C`.
// Kernels register their CUDA implementations next to them, in plugin/csrc/<op>.cu
// (TORCH_LIBRARY_IMPL(cublade, CUDA, m)). Python entries, fakes and references: plugin/ops/<op>.py.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(cublade, m) {
  // Dynamic per-token FP8: x [..., K] -> (e4m3 [..., K], fp32 scale [..., 1]).
  m.def("fp8_quant_per_token(Tensor x) -> (Tensor, Tensor)");
  // The same E4M3 values written as bf16 or fp16 (exact in both): fp8_gemm's activations. bf16 x only.
  m.def("fp8_quant_per_token_bf16(Tensor x) -> (Tensor, Tensor)");
  m.def("fp8_quant_per_token_f16(Tensor x) -> (Tensor, Tensor)");
  // Per-tensor FP8, dynamic (scale=None) or static: x -> (e4m3 of x's shape, fp32 scale [1]).
  m.def("fp8_quant_per_tensor(Tensor x, Tensor? scale=None) -> (Tensor, Tensor)");
  // RMSNorm (vLLM's native rms_norm / fused_add_rms_norm) and FP8 quantization in one kernel: x [..., K] (bf16 /
  // fp16) -> (e4m3 [..., K], fp32 scale [..., 1] per token, or with a static scale its value [1]); the fused-add
  // form also returns the new residual (x + residual in x's dtype). The fusions of plugin/vllm/fusion.py.
  m.def("rms_norm_fp8_quant(Tensor x, Tensor weight, float eps, Tensor? scale=None) -> (Tensor, Tensor)");
  m.def("fused_add_rms_norm_fp8_quant(Tensor x, Tensor residual, Tensor weight, float eps, Tensor? scale=None) "
        "-> (Tensor, Tensor, Tensor)");
  // SiLU-and-mul and FP8 quantization in one kernel: x [..., 2K] (bf16 / fp16, gate | up) -> (e4m3 of y = silu(gate)
  // * up [..., K] as the compiled graph rounds it, fp32 scale [..., 1] per token, or with a static scale its value
  // [1]). The fusion of plugin/vllm/fusion.py in front of a gated MLP's fp8 down projection.
  m.def("silu_mul_fp8_quant(Tensor x, Tensor? scale=None) -> (Tensor, Tensor)");
  // Dynamic FP8 per 1 x 128 group: x [M, K] -> (e4m3 [M, K], fp32 scale [M, K/128] column-major).
  m.def("fp8_quant_per_group(Tensor x) -> (Tensor, Tensor)");
  // MXFP8: x [..., K] -> (e4m3 [..., K], uint8 E8M0 [..., K/32]); rceil picks the scale rule.
  m.def("mxfp8_quant(Tensor x, bool rceil) -> (Tensor, Tensor)");
  m.def("mxfp8_dequant(Tensor q, Tensor codes, ScalarType dtype) -> Tensor");
  // FP8 KV-cache write into vLLM's paged cache (reshape_and_cache_flash layout), in place; with the token's
  // query [T, num_heads, D], K is rounded query-aware (plugin/ops/fp8_kv_cache_write.py).
  m.def("fp8_kv_cache_write(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, Tensor k_scale, Tensor v_scale, Tensor? query=None) -> ()");
  // W4A16 GEMM: x [..., K] bf16/fp16 @ int4 weights in w4a16_repack's layout -> [..., size_n] (x's dtype).
  // prefill=False keeps every batch size on the exact-weight kernels (no dequantize + cuBLAS path and no rounded wide
  // passes: both multiply the weights rounded once to bf16).
  m.def("w4a16_gemm(Tensor x, Tensor packed, int group_size, bool symmetric, int size_n, int split_k=0, "
        "bool prefill=True) -> Tensor");
  // W4A16 dequant (the prefill path): the same blob -> the dense weight [size_n, size_k] in dtype (bf16 / fp16).
  m.def("w4a16_dequant(Tensor packed, int group_size, bool symmetric, int size_n, int size_k, ScalarType dtype) "
        "-> Tensor");
  // Its FP8 form (group size 128 / per channel): (E4M3 codes u - z [size_n, size_k], fp32 scales [size_n,
  // size_k/128] column-major), the weight operand of a 1x128 blockwise-scaled FP8 GEMM.
  m.def("w4a16_dequant_fp8(Tensor packed, int group_size, bool symmetric, int size_n, int size_k) "
        "-> (Tensor, Tensor)");
  // FP4 (MXFP4 / NVFP4) GEMM for MoE experts: x [T, K] bf16 (rows sorted by expert, expert_offsets [E+1]
  // int32; none = one expert) @ weights in fp4_repack's layout -> bf16 [T, size_n]. routed_experts: the experts
  // x's rows were routed over (expert parallel: the model's, of which packed holds E; 0 = E).
  m.def("fp4_gemm(Tensor x, Tensor packed, Tensor? row_scale, str format, int size_n, "
        "Tensor? expert_offsets=None, int max_m=0, int split_k=0, int routed_experts=0) -> Tensor");
  // MXFP8 weight GEMM (W8A16): x [..., K] bf16 @ e4m3 weights with E8M0 scales per 32 K in mxfp8_repack's layout
  // -> bf16 [..., size_n]; and the same blob -> the dense bf16 weight [size_n, size_k] (the prefill path).
  m.def("mxfp8_gemm(Tensor x, Tensor packed, int size_n, int split_k=0) -> Tensor");
  m.def("mxfp8_dequant_packed(Tensor packed, int size_n, int size_k) -> Tensor");
  // FP8 W8A8 decode GEMM on the E4M3 weight [size_n, K] as stored (no repack): x [..., K] bf16 or fp16 holding E4M3
  // values (fp8_quant_per_token_bf16 / _f16), x_scale fp32 (one per row or one), weight_scale fp32 [size_n] -> bf16
  // [..., size_n].
  m.def("fp8_gemm(Tensor x, Tensor x_scale, Tensor weight, Tensor weight_scale, int split_k=0) -> Tensor");
  // FP8 W8A8 GEMM on FP8 tensor cores (wgmma) for batches and prompts: x E4M3 [..., K], x_scale fp32 (one per row or
  // one), the E4M3 weight [size_n, K] as stored, weight_scale fp32 [size_n] -> bf16 [..., size_n]; vLLM's CUTLASS
  // scaled-mm's numerics. split_k: K over a cluster of that many CTAs (0: the launcher's plan, which halves K >= 8192
  // on grids of at most half the SMs; 1: never split, the same bits at every batch size).
  m.def("fp8_gemm_wgmma(Tensor x, Tensor x_scale, Tensor weight, Tensor weight_scale, int split_k=0) -> Tensor");
  // MoE routing around fp4_gemm: topk_ids [T, k] + x [T, H] -> (xs [T*k, H] sorted by expert, expert_offsets
  // [E+1] int32, pos [T*k] int32); then y [T*k, N] -> out [T, N] = sum_j topk_weights[t, j] * y[pos[t*k + j]].
  m.def("moe_route(Tensor topk_ids, Tensor x, int num_experts) -> (Tensor, Tensor, Tensor)");
  m.def("moe_finalize(Tensor y, Tensor pos, Tensor topk_weights) -> Tensor");
  // silu(h[:, :I]) * h[:, I:] for h [M, 2I] (w13's output) -> [M, I], rounded as the two torch ops round.
  m.def("silu_mul(Tensor h) -> Tensor");
}

// `import cublade._C` loads this library; the TORCH_LIBRARY blocks above and in the .cu files register
// the ops as torch.ops.cublade.* at load time. The module itself has no Python-level contents.
static struct PyModuleDef cublade_c_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&cublade_c_module); }
