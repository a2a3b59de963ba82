"""Schemes, policies and the checkpoint format."""
from cublade.config.format import (FORMAT_VERSION, QUANT_METHOD, parse_quantization_config, read_policy,
                                   to_quantization_config)
from cublade.config.policy import DEFAULT_IGNORE, PRESETS, Policy, Rule, preset
from cublade.config.schemes import (SCHEMES, FP4Scheme, Fp8Scheme, KVCacheScheme, MXFP8Scheme, Scheme,
                                    UnsupportedShape, W4A16Scheme, scheme_from_dict)

__all__ = ["FORMAT_VERSION", "QUANT_METHOD", "parse_quantization_config", "read_policy",
           "to_quantization_config", "DEFAULT_IGNORE", "PRESETS", "Policy", "Rule", "preset", "SCHEMES",
           "FP4Scheme", "Fp8Scheme", "KVCacheScheme", "MXFP8Scheme", "Scheme", "UnsupportedShape",
           "W4A16Scheme", "scheme_from_dict"]
