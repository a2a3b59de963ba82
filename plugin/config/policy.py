"""Policies: ordered rules mapping module names to schemes, an ignore list, an optional FP8 KV cache; and
the named presets. A module takes the scheme of the first rule whose pattern matches its full name
(`re.fullmatch`); ignored modules, and modules no rule matches, stay unquantized."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from cublade.config.schemes import (FP4Scheme, Fp8Scheme, KVCacheScheme, KVRounding, MXFP8Scheme, Scheme,
                                    W4A16Scheme, scheme_from_dict)

# Embeddings, the LM head and MoE routers stay in full precision: they are small, and the router's
# top-k is sensitive to small logit changes. `.*\.gate` is Mixtral's router; `gate_proj` does not match it.
# The LM head is quantized on request (Policy.with_lm_head, `cublade convert --quantize-lm-head`).
LM_HEAD = r"(.*\.)?lm_head"
DEFAULT_IGNORE = (r".*embed_tokens", LM_HEAD, r".*\.gate", r".*\.router")
# Names of the expert linears: Mixtral `experts.{e}.w1/w2/w3`, fused `experts.gate_up_proj/down_proj`.
EXPERT_PATTERN = r".*\.experts(\.\d+)?\.(w1|w2|w3|gate_up_proj|down_proj|gate_proj|up_proj)"
ROUTER_PATTERNS = (r".*\.gate", r".*\.router")


@dataclass(frozen=True)
class Rule:
    pattern: str
    scheme: str  # key into Policy.schemes

    def __post_init__(self):
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"policy rule pattern {self.pattern!r} is not a valid regex: {e}") from None


@dataclass(frozen=True)
class Policy:
    preset: str
    schemes: tuple[tuple[str, Scheme], ...]
    rules: tuple[Rule, ...]
    ignore: tuple[str, ...] = DEFAULT_IGNORE
    kv_cache: KVCacheScheme | None = None
    calibration: dict | None = field(default=None, compare=False)  # provenance only (e.g. GPTQ settings)

    def __post_init__(self):
        names = dict(self.schemes)
        for r in self.rules:
            if r.scheme not in names:
                raise ValueError(f"policy rule {r.pattern!r} names scheme {r.scheme!r}, "
                                 f"not one of {', '.join(names) or '(none)'}")

    @property
    def scheme_map(self) -> dict[str, Scheme]:
        return dict(self.schemes)

    def is_ignored(self, module: str) -> bool:
        return any(re.fullmatch(p, module) for p in self.ignore)

    def scheme_for(self, module: str) -> Scheme | None:
        if self.is_ignored(module):
            return None
        for r in self.rules:
            if re.fullmatch(r.pattern, module):
                return self.scheme_map[r.scheme]
        return None

    def needs_calibration(self) -> list[str]:
        """What this policy cannot produce without calibration data."""
        needs = [f"static FP8 input scales (scheme {n!r})" for n, s in self.schemes
                 if isinstance(s, Fp8Scheme) and s.static]
        if self.kv_cache is not None:
            needs.append("FP8 KV-cache scales")
        return needs

    def with_ignore(self, *extra: str) -> Policy:
        return dataclasses.replace(self, ignore=tuple(self.ignore) + tuple(extra))

    def with_lm_head(self) -> Policy:
        """The policy with the output projection (`lm_head`) off the ignore list, so the rule that matches it
        quantizes it (the presets leave it unquantized)."""
        return dataclasses.replace(self, ignore=tuple(p for p in self.ignore if p != LM_HEAD))

    def to_dict(self) -> dict:
        return {
            "preset": self.preset,
            "schemes": {n: s.to_dict() for n, s in self.schemes},
            "rules": [{"pattern": r.pattern, "scheme": r.scheme} for r in self.rules],
            "ignore": list(self.ignore),
            "kv_cache": self.kv_cache.to_dict() if self.kv_cache else None,
            **({"calibration": self.calibration} if self.calibration else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Policy:
        for key in ("schemes", "rules"):
            if key not in d:
                raise ValueError(f"quantization_config: missing field {key!r}")
        schemes = tuple((n, scheme_from_dict(s)) for n, s in d["schemes"].items())
        rules = tuple(Rule(r["pattern"], r["scheme"]) for r in d["rules"])
        kv = d.get("kv_cache")
        return cls(preset=d.get("preset", "custom"), schemes=schemes, rules=rules,
                   ignore=tuple(d.get("ignore", DEFAULT_IGNORE)),
                   kv_cache=KVCacheScheme(**kv) if kv else None, calibration=d.get("calibration"))


# ---- presets -----------------------------------------------------------------------------------------

def _single(preset: str, scheme: Scheme) -> Policy:
    return Policy(preset=preset, schemes=((scheme.kind, scheme),), rules=(Rule(r".*", scheme.kind),))


def _fp4_experts_fp8_dense() -> Policy:
    return Policy(preset="fp4-experts-fp8-dense",
                  schemes=(("fp4", FP4Scheme()), ("fp8", Fp8Scheme())),
                  rules=(Rule(EXPERT_PATTERN, "fp4"), Rule(r".*", "fp8")))


PRESETS = {
    "fp8-dynamic": lambda: _single("fp8-dynamic", Fp8Scheme()),
    "fp8-static": lambda: _single("fp8-static", Fp8Scheme(activations="static-tensor")),
    "w4a16": lambda: _single("w4a16", W4A16Scheme()),
    "mxfp8": lambda: _single("mxfp8", MXFP8Scheme()),
    "fp4-experts-fp8-dense": _fp4_experts_fp8_dense,
}


def preset(name: str, **overrides) -> Policy:
    """The named preset, with scheme fields overridden where a scheme has them (e.g. group_size=64 for
    w4a16, scale_rule='floor' for mxfp8/fp4, format='nvfp4' for fp4), `kv_cache='fp8'` to add an FP8
    KV cache and `kv_rounding='query-aware'` to round its K query-aware. An override no scheme of the preset
    takes is an error."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
    policy = PRESETS[name]()
    kv = overrides.pop("kv_cache", None)
    kv_rounding = overrides.pop("kv_rounding", None)
    if kv_rounding is not None and kv is None:
        raise ValueError(f"kv_rounding={kv_rounding!r} needs an FP8 KV cache (kv_cache='fp8')")
    used = set()
    schemes = []
    for n, s in policy.schemes:
        names = {f.name for f in dataclasses.fields(s)}
        mine = {k: v for k, v in overrides.items() if k in names and v is not None}
        used |= set(mine)
        schemes.append((n, dataclasses.replace(s, **mine)))
    unused = {k for k, v in overrides.items() if v is not None} - used
    if unused:
        raise ValueError(f"preset {name!r} has no scheme with option(s) {', '.join(sorted(unused))}")
    return dataclasses.replace(policy, schemes=tuple(schemes),
                               kv_cache=KVCacheScheme(kv, kv_rounding or KVRounding.NEAREST) if kv else None)
