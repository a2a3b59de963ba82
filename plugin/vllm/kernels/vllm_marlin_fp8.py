"""FP8 weights on vLLM's FP8 Marlin (W8A16, a fallback): the tensor-core path for `fp8` checkpoints on GPUs without
FP8 tensor cores (sm_80, sm_86)."""
from __future__ import annotations

import torch

from cublade.numerics.fp8 import FP8_DTYPE
from cublade.numerics.linear import fp8_w8a16_scale
from cublade.vllm.kernels.base import LinearKernel, gpu_half, replace_parameter


class VllmMarlinFp8(LinearKernel):
    """vLLM's Marlin GEMM over e4m3 weights with bf16 / fp16 activations (W8A16; a fallback), second for `fp8` after
    vLLM's CUTLASS scaled-mm (W8A8, sm_89+). It decodes each code to the activation dtype in the kernel, sums the
    products in fp32 and applies a per-channel scale to the sums (a per-tensor scale is repeated over the channels),
    so it serves every `fp8` checkpoint (channel or tensor weight scales, dynamic or static activations) but does not
    quantize the activations: a static input scale is not used. What it computes is
    cublade.numerics.linear.fp8_w8a16_linear_ref; against the W8A8 reference it differs within
    `w8a16_vs_w8a8_bound` (docs/kernel-selection.md#fp8-on-marlin-w8a16).
    Shapes: any N and K; Marlin's tiles (N % 64 with K % 128, or N % 128 with K % 64) are reached by zero padding,
    done once here for the weight and per call for the activations (vLLM's helpers)."""
    name = "vllm-marlin-fp8"
    own = False

    @classmethod
    def can_implement(cls, layer):
        cap, why = gpu_half(layer, layer.weight.device)
        if cap is None:
            return False, why
        try:
            from vllm.model_executor.layers.quantization.utils.marlin_utils_fp8 import is_fp8_marlin_supported
        except ImportError as e:
            return False, f"this vLLM has no FP8 Marlin ({e})"
        if not is_fp8_marlin_supported():
            return False, f"vLLM's FP8 Marlin does not run on sm_{cap}"
        return True, (f"W8A16 on sm_{cap}: e4m3 weights decoded to {layer.params_dtype} in the kernel, activations "
                      f"not quantized")

    def __init__(self, layer):
        super().__init__(layer)
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.quantization.utils import marlin_utils as mu
        from vllm.model_executor.layers.quantization.utils import marlin_utils_fp8 as mf

        N, K = layer.output_size_per_partition, layer.input_size_per_partition
        self.size_n, self.size_k = N, K
        pN, pK = mu.marlin_padded_nk(N, K)
        w = layer.weight.data
        if (pN, pK) != (N, K):  # zero codes decode to 0: padded rows / columns add nothing
            w = torch.nn.functional.pad(w.view(torch.uint8), (0, pK - K, 0, pN - N)).view(FP8_DTYPE)
        qweight = mf.pack_fp8_to_int32(w, size_k_first=False).t().contiguous()  # [pK/4, pN], GPTQ's layout
        perm = torch.empty(0, dtype=torch.int, device=w.device)
        replace_parameter(layer, "weight", ops.gptq_marlin_repack(b_q_weight=qweight, perm=perm, size_k=pK,
                                                                  size_n=pN, num_bits=8))
        # Scales [1, N] in fp32, padded, permuted to Marlin's order, then times 2^bias and rounded once
        # (fp8_w8a16_scale; vLLM's own preparation rounds to fp16 first, losing fp16 scales under 2^-14).
        s = layer.weight_scale.data.float().reshape(-1).expand(N).reshape(1, N)
        s = mu.marlin_permute_scales(s=mu.marlin_pad_scales(s, N, K, pN, pK, -1), size_k=pK, size_n=pN,
                                     group_size=-1)
        replace_parameter(layer, "weight_scale", fp8_w8a16_scale(s, pN, layer.params_dtype).reshape(1, pN))
        replace_parameter(layer, "input_scale", None)  # W8A16: the activations stay unquantized
        self.workspace = mu.marlin_make_workspace_new(w.device)
        self.gemm = mf.apply_fp8_marlin_linear

    def apply(self, layer, x, bias):
        # vLLM's layer hands apply() its own bias, not permuted to Marlin's order: added after the GEMM.
        y = self.gemm(input=x, weight=layer.weight, weight_scale=layer.weight_scale, workspace=self.workspace,
                      size_n=self.size_n, size_k=self.size_k, bias=None)
        return y if bias is None else y + bias
