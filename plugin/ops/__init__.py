"""Op entry points (`<op>`: cublade's CUDA kernel on a GPU when built, else the reference) and their pure
PyTorch references (`<op>_ref`). Nothing here knows vLLM or the checkpoint format."""
from cublade.ops.fp8_kv_cache_write import fp8_kv_cache_write, fp8_kv_cache_write_ref, fp8_kv_quant_ref
from cublade.ops.fp8_quant import (fp8_dequant, fp8_quant_per_tensor, fp8_quant_per_tensor_ref,
                                   fp8_quant_per_token, fp8_quant_per_token_ref, fp8_quant_weight)
from cublade.ops.mxfp8_quant import mxfp8_dequant, mxfp8_dequant_ref, mxfp8_quant, mxfp8_quant_ref

__all__ = [
    "fp8_kv_cache_write", "fp8_kv_cache_write_ref", "fp8_kv_quant_ref",
    "fp8_dequant", "fp8_quant_per_tensor", "fp8_quant_per_tensor_ref", "fp8_quant_per_token",
    "fp8_quant_per_token_ref", "fp8_quant_weight",
    "mxfp8_dequant", "mxfp8_dequant_ref", "mxfp8_quant", "mxfp8_quant_ref",
]
