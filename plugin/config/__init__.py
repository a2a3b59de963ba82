"""Schemes, policies and the checkpoint format. Imports no op (cublade.ops) and loads no extension: the format
math comes from cublade.numerics."""
from cublade.config.format import (FORMAT_VERSION, QUANT_METHOD, parse_quantization_config, read_policy,
                                   to_quantization_config)
from cublade.config.policy import DEFAULT_IGNORE, PRESETS, Policy, Rule, preset
from cublade.config.schemes import (SCHEMES, FP4Scheme, Fp8Scheme, KVCacheDtype, KVCacheScheme, KVRounding,
                                    MXFP8Scheme, Scheme, UnsupportedShape, W4A16Scheme, WeightStrategy,
                                    scheme_from_dict)
from cublade.numerics.fp4 import Fp4Format
from cublade.numerics.fp8 import Fp8Activations
from cublade.numerics.mx import ScaleRule

__all__ = ["FORMAT_VERSION", "QUANT_METHOD", "parse_quantization_config", "read_policy",
           "to_quantization_config", "DEFAULT_IGNORE", "PRESETS", "Policy", "Rule", "preset", "SCHEMES",
           "FP4Scheme", "Fp8Scheme", "KVCacheDtype", "KVCacheScheme", "KVRounding", "MXFP8Scheme", "Scheme",
           "UnsupportedShape", "W4A16Scheme", "WeightStrategy", "scheme_from_dict", "Fp4Format", "Fp8Activations",
           "ScaleRule"]
