"""Schemes: what a quantized layer's weights are (never how a kernel computes with them).

Each scheme is a frozen dataclass checked in __post_init__, serialized with `to_dict` into the checkpoint's
quantization_config, and owns its tensor format: the suffixes it writes next to `<module>.`, their shapes
and dtypes, how to quantize a float weight into them, and the reference linear over them.

Tensor format (N = out_features, K = in_features, per `<module>.<suffix>`):
  fp8     weight e4m3 [N, K]; weight_scale fp32 [N] (channel) or [1] (tensor);
          input_scale fp32 [1] (static-tensor activations only)
  w4a16   weight_packed int32 [N, K/8]; weight_scale bf16 [N, K/G]; weight_zero_point uint8 [N, K/G]
          (asymmetric only). See cublade.numerics.int4 for the bit layout.
  mxfp8   weight e4m3 [N, K]; weight_scale uint8 E8M0 [N, K/32]
  fp4     weight_packed uint8 [N, K/2]; weight_scale uint8 E8M0 [N, K/32] (mxfp4) or
          e4m3 [N, K/16] (nvfp4); weight_global_scale fp32 [1] (nvfp4)
  fp8 KV  <attention module>.k_scale, .v_scale fp32 [] (scalars)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

import torch

from cublade.numerics import fp4 as fp4_num
from cublade.numerics import int4 as int4_num
from cublade.numerics import linear as linear_num
from cublade.numerics.choice import Choice
from cublade.numerics.constants import MX_BLOCK, W4A16_GROUP_SIZES
from cublade.numerics.fp4 import Fp4Format
from cublade.numerics.fp8 import FP8_DTYPE, Fp8Activations, fp8_quant_weight
from cublade.numerics.mx import ScaleRule
from cublade.numerics.mxfp8 import mxfp8_dequantize, mxfp8_quantize

TensorSpec = tuple[tuple[int, ...], torch.dtype]


class WeightStrategy(Choice):
    """Granularity of FP8 weight scales."""
    CHANNEL = "channel"  # one scale per output channel
    TENSOR = "tensor"  # one scale for the whole weight


class KVCacheDtype(Choice):
    FP8 = "fp8"  # E4M3 with per-layer k_scale / v_scale


class KVRounding(Choice):
    """How the FP8 cache write rounds K (KVCacheScheme)."""
    NEAREST = "nearest"
    QUERY_AWARE = "query-aware"


# FP8 tensor-core GEMMs (CUTLASS scaled-mm, cuBLASLt) need 16-element alignment of K and N.
FP8_ALIGN = 16


class UnsupportedShape(NotImplementedError):
    """A layer whose shape the scheme cannot represent or serve; the message says which rule."""


def _choice(obj, scheme: str, field: str, valid) -> None:
    """Check obj.<field> against `valid` (a tuple, or a Choice enum, whose member then replaces the string)."""
    value = getattr(obj, field)
    if isinstance(valid, type) and issubclass(valid, Choice):
        object.__setattr__(obj, field, valid.parse(value, f"{scheme}: {field}"))
    elif value not in valid:
        raise ValueError(f"{scheme}: {field}={value!r} is not one of {', '.join(map(repr, valid))}")


def _plain(d: dict) -> dict:
    """Fields as the checkpoint's JSON holds them: enum members as their strings."""
    return {k: v.value if isinstance(v, Enum) else v for k, v in d.items()}


@dataclass(frozen=True)
class Scheme:
    kind: ClassVar[str] = ""

    def to_dict(self) -> dict:
        return {"kind": self.kind, **_plain(dataclasses.asdict(self))}

    def describe(self) -> str:
        fields = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())
        return f"{self.kind}({fields})"

    # --- the format -----------------------------------------------------------------------------------
    def check_shape(self, module: str, N: int, K: int) -> None:
        """Raise UnsupportedShape naming the module and the rule when [N, K] cannot be quantized/served."""

    def tensor_specs(self, N: int, K: int) -> dict[str, TensorSpec]:
        raise NotImplementedError

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def dequantize(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def linear_ref(self, x: torch.Tensor, t: dict[str, torch.Tensor], bias=None) -> torch.Tensor:
        raise NotImplementedError

    def _unsupported(self, module: str, why: str) -> UnsupportedShape:
        return UnsupportedShape(f"{module}: not supported by scheme {self.kind} because {why}")


@dataclass(frozen=True)
class Fp8Scheme(Scheme):
    """FP8 E4M3 W8A8. Weights per output channel (default) or per tensor; activations dynamic per token
    (default), dynamic per tensor, or static per tensor (a calibrated `input_scale`)."""
    kind: ClassVar[str] = "fp8"
    weight_strategy: WeightStrategy = WeightStrategy.CHANNEL
    activations: Fp8Activations = Fp8Activations.DYNAMIC_TOKEN

    def __post_init__(self):
        _choice(self, "fp8", "weight_strategy", WeightStrategy)
        _choice(self, "fp8", "activations", Fp8Activations)

    @property
    def static(self) -> bool:
        return self.activations is Fp8Activations.STATIC_TENSOR

    @property
    def per_channel(self) -> bool:
        return self.weight_strategy is WeightStrategy.CHANNEL

    def check_shape(self, module, N, K):
        for name, v in (("in_features", K), ("out_features", N)):
            if v % FP8_ALIGN:
                raise self._unsupported(module, f"{name}={v} is not a multiple of {FP8_ALIGN} "
                                                f"(FP8 tensor-core GEMM alignment)")

    def tensor_specs(self, N, K):
        specs = {"weight": ((N, K), FP8_DTYPE),
                 "weight_scale": ((N if self.per_channel else 1,), torch.float32)}
        if self.static:
            specs["input_scale"] = ((1,), torch.float32)
        return specs

    def quantize(self, w):
        q, s = fp8_quant_weight(w, per_channel=self.per_channel)
        return {"weight": q, "weight_scale": s}

    def dequantize(self, t):
        return t["weight"].float() * t["weight_scale"].float().reshape(-1, 1)

    def linear_ref(self, x, t, bias=None):
        return linear_num.fp8_linear_ref(x, t["weight"], t["weight_scale"], self.activations,
                                         t.get("input_scale"), bias)


@dataclass(frozen=True)
class W4A16Scheme(Scheme):
    """int4 weights in groups of `group_size` along K (-1: one group per row), bf16/fp16 activations."""
    kind: ClassVar[str] = "w4a16"
    group_size: int = 128
    symmetric: bool = True

    def __post_init__(self):
        _choice(self, "w4a16", "group_size", W4A16_GROUP_SIZES)

    def check_shape(self, module, N, K):
        if self.group_size != -1 and K % self.group_size:
            raise self._unsupported(module, f"in_features={K} is not a multiple of group_size={self.group_size}")
        if K % 8:
            raise self._unsupported(module, f"in_features={K} is not a multiple of 8 (8 int4 per int32)")

    def groups(self, K):
        return 1 if self.group_size == -1 else K // self.group_size

    def tensor_specs(self, N, K):
        g = self.groups(K)
        specs = {"weight_packed": ((N, K // 8), torch.int32), "weight_scale": ((N, g), int4_num.SCALE_DTYPE)}
        if not self.symmetric:
            specs["weight_zero_point"] = ((N, g), torch.uint8)
        return specs

    def quantize(self, w):
        return int4_num.int4_quant_weight(w, self.group_size, self.symmetric)

    def dequantize(self, t):
        return int4_num.int4_dequant_weight(t["weight_packed"], t["weight_scale"],
                                            t.get("weight_zero_point"), self.group_size)

    def linear_ref(self, x, t, bias=None):
        return linear_num.w4a16_linear_ref(x, t["weight_packed"], t["weight_scale"],
                                           t.get("weight_zero_point"), self.group_size, bias)


@dataclass(frozen=True)
class MXFP8Scheme(Scheme):
    """MXFP8 weights: E4M3 with one E8M0 scale per 32 along K. Activations stay bf16/fp16 on Hopper (no MX
    tensor cores there). scale_rule: 'rceil' (default, NVIDIA: 2^ceil(log2(amax/448)), never clips) or
    'floor' (OCP MX v1.0: 2^(floor(log2 amax) - 8), saturates the top of the block)."""
    kind: ClassVar[str] = "mxfp8"
    scale_rule: ScaleRule = ScaleRule.RCEIL

    def __post_init__(self):
        _choice(self, "mxfp8", "scale_rule", ScaleRule)

    def check_shape(self, module, N, K):
        if K % MX_BLOCK:
            raise self._unsupported(module, f"in_features={K} is not a multiple of the MX block size {MX_BLOCK}")

    def tensor_specs(self, N, K):
        return {"weight": ((N, K), FP8_DTYPE), "weight_scale": ((N, K // MX_BLOCK), torch.uint8)}

    def quantize(self, w):
        q, s = mxfp8_quantize(w, self.scale_rule)
        return {"weight": q, "weight_scale": s}

    def dequantize(self, t):
        return mxfp8_dequantize(t["weight"], t["weight_scale"])

    def linear_ref(self, x, t, bias=None):
        return linear_num.mxfp8_linear_ref(x, t["weight"], t["weight_scale"], bias)


@dataclass(frozen=True)
class FP4Scheme(Scheme):
    """FP4 E2M1 weights (for MoE experts): 'mxfp4' (E8M0 per 32) or 'nvfp4' (E4M3 per 16 + fp32 global).
    Activations stay bf16 on Hopper (FP4 storage, bf16 math)."""
    kind: ClassVar[str] = "fp4"
    format: Fp4Format = Fp4Format.MXFP4
    scale_rule: ScaleRule = ScaleRule.RCEIL  # mxfp4 only

    def __post_init__(self):
        _choice(self, "fp4", "format", Fp4Format)
        _choice(self, "fp4", "scale_rule", ScaleRule)

    @property
    def block(self) -> int:
        return self.format.block

    def check_shape(self, module, N, K):
        if K % self.block:
            raise self._unsupported(module, f"in_features={K} is not a multiple of the {self.format} "
                                            f"block size {self.block}")

    def tensor_specs(self, N, K):
        if self.format is Fp4Format.MXFP4:
            return {"weight_packed": ((N, K // 2), torch.uint8), "weight_scale": ((N, K // MX_BLOCK), torch.uint8)}
        return {"weight_packed": ((N, K // 2), torch.uint8),
                "weight_scale": ((N, K // self.block), FP8_DTYPE),
                "weight_global_scale": ((1,), torch.float32)}

    def quantize(self, w):
        return fp4_num.fp4_quant_weight(w, self.format, self.scale_rule)

    def dequantize(self, t):
        return fp4_num.fp4_dequant_weight(t, self.format)

    def linear_ref(self, x, t, bias=None):
        return linear_num.fp4_linear_ref(x, t, self.format, bias)


@dataclass(frozen=True)
class KVCacheScheme:
    """FP8 KV cache with per-layer k_scale / v_scale (calibrated: abs-max of K and V over the calibration
    text / 448), stored as `<attention module>.k_scale` / `.v_scale` fp32 scalars.

    rounding: how the cache write rounds K to E4M3 (V is always rounded to nearest); the cache format is the
    same either way. "nearest": vLLM's bytes, any attention backend writes them. "query-aware": each key's
    rounding error is steered away from its own token's queries (cublade.ops.fp8_kv_cache_write); served by
    cublade's cache write (`--attention-backend CUSTOM`), and what the reference backend scores."""
    dtype: KVCacheDtype = KVCacheDtype.FP8
    rounding: KVRounding = KVRounding.NEAREST

    def __post_init__(self):
        _choice(self, "kv_cache", "dtype", KVCacheDtype)
        _choice(self, "kv_cache", "rounding", KVRounding)

    def to_dict(self) -> dict:
        return _plain({"dtype": self.dtype, "rounding": self.rounding})


SCHEMES: dict[str, type[Scheme]] = {c.kind: c for c in (Fp8Scheme, W4A16Scheme, MXFP8Scheme, FP4Scheme)}


def scheme_from_dict(d: dict) -> Scheme:
    d = dict(d)
    kind = d.pop("kind", None)
    if kind not in SCHEMES:
        raise ValueError(f"unknown scheme kind {kind!r} in quantization_config; valid: {', '.join(SCHEMES)}")
    cls = SCHEMES[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"scheme {kind}: unknown field(s) {', '.join(sorted(unknown))}; "
                         f"valid: {', '.join(sorted(names))}")
    return cls(**d)
