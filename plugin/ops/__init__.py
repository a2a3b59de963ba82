"""Op entry points (`<op>`: cublade's CUDA kernel on a GPU when built, else the reference) and their pure
PyTorch references (`<op>_ref`, calling into cublade.numerics). One module per op, named after its kernel's
stem in plugin/csrc. Nothing here knows vLLM or the checkpoint format. Importing this package loads the
extension (cublade.ops._dispatch)."""
from cublade.ops.fp8_kv_cache_write import fp8_kv_cache_write, fp8_kv_cache_write_ref, fp8_kv_quant_ref
from cublade.ops.fp8_quant_per_tensor import fp8_quant_per_tensor, fp8_quant_per_tensor_ref
from cublade.ops.fp8_quant_per_token import fp8_quant_per_token, fp8_quant_per_token_ref
from cublade.ops.mxfp8_quant import mxfp8_dequant, mxfp8_dequant_ref, mxfp8_quant, mxfp8_quant_ref
from cublade.ops.silu_mul_fp8_quant import silu_mul_fp8_quant, silu_mul_fp8_quant_ref

__all__ = [
    "fp8_kv_cache_write", "fp8_kv_cache_write_ref", "fp8_kv_quant_ref",
    "fp8_quant_per_tensor", "fp8_quant_per_tensor_ref", "fp8_quant_per_token", "fp8_quant_per_token_ref",
    "mxfp8_dequant", "mxfp8_dequant_ref", "mxfp8_quant", "mxfp8_quant_ref",
    "silu_mul_fp8_quant", "silu_mul_fp8_quant_ref",
]
