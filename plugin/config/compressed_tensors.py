"""Reading compressed-tensors checkpoints (llm-compressor's FP8 W8A8 and int4 W4A16) as cublade schemes.

The checkpoint's `quantization_config` (quant_method "compressed-tensors") translates into an equivalent cublade
Policy (`policy_from_compressed_tensors`). Its tensors hold the same numbers as cublade's, in two layouts that
differ (`tensor_specs` gives the compressed-tensors one per scheme):
  * FP8 per-channel weight scales are [N, 1] (cublade: [N]); scales may be stored in the model's dtype;
  * int4 zero points (asymmetric W4A16) are packed 8 per int32 along N: int32 [N/8, groups] (cublade: uint8
    [N, groups]): `unpack_zero_points` / `pack_zero_points` convert;
  * a W4A16 layer also stores `weight_shape` ([2] int64), which only describes the weight (DESCRIPTIVE).
The vLLM layer (cublade.vllm.linear) loads these layouts and brings them to cublade's after loading.

Writing (`cublade convert --format compressed-tensors`) runs the same tables the other way:
`check_expressible` refuses a policy compressed-tensors cannot express, `CompressedTensorsLayout` gives the
tensors of each quantized module in compressed-tensors' layout and the quantization_config, which is read back
with `policy_from_compressed_tensors` and checked to give every module the scheme it was converted with.
"""
from __future__ import annotations

import re

import torch

from cublade.config.format import QuantMethod
from cublade.config.policy import EXPERT_PATTERN, Policy, Rule
from cublade.config.schemes import (FP4Scheme, Fp8Scheme, KVCacheDtype, KVCacheScheme, KVRounding, MXFP8Scheme, Scheme,
                                    UnsupportedShape, W4A16Scheme, WeightStrategy)
from cublade.numerics.constants import INT4_PER_INT32
from cublade.numerics.fp8 import Fp8Activations
from cublade.numerics.int4 import pack_int4, unpack_int4

CT_METHOD = QuantMethod.COMPRESSED_TENSORS.value
FLOAT_FORMAT, PACK_FORMAT = "float-quantized", "pack-quantized"
# cublade's FP8 activation modes as compressed-tensors input_activations (strategy, dynamic).
FP8_ACTIVATION_ARGS = {Fp8Activations.DYNAMIC_TOKEN: ("token", True), Fp8Activations.DYNAMIC_TENSOR: ("tensor", True),
                       Fp8Activations.STATIC_TENSOR: ("tensor", False)}
# The FP8 KV cache with static per-tensor scales, as compressed-tensors' kv_cache_scheme.
KV_CACHE_ARGS = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
# Tensors that only describe another one: loaded and dropped.
DESCRIPTIVE = ("weight_shape",)


def _ct_pattern(target: str, field: str) -> str:
    """A compressed-tensors target/ignore entry as a Policy regex (matched with re.fullmatch)."""
    if target == "Linear":
        return r".*"
    if target.startswith("re:"):
        # compressed-tensors matches `re:` targets with re.match (anchored at the start only).
        return f"(?:{target[3:]}).*"
    if re.fullmatch(r"[A-Z]\w*", target):
        raise NotImplementedError(f"compressed-tensors {field} {target!r}: cublade matches module names and "
                                  f"the class 'Linear' only")
    return rf"(?:.*\.)?{re.escape(target)}"  # a module name, possibly without the model's prefix


def _ct_scheme(name: str, group: dict, fmt: str | None) -> Scheme:
    where = f"compressed-tensors config_groups.{name}"
    w = group.get("weights") or {}
    a = group.get("input_activations")
    fmt = group.get("format") or fmt
    if (group.get("output_activations")) is not None:
        raise NotImplementedError(f"{where}.output_activations: output quantization is not supported by cublade")
    wtype, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    if not w.get("symmetric", True) and wtype == "float":
        raise NotImplementedError(f"{where}.weights.symmetric=false: cublade's FP8 weights are symmetric")
    if wtype == "float" and bits == 8:
        if strategy not in WeightStrategy.values():
            raise NotImplementedError(f"{where}.weights.strategy={strategy!r}: cublade FP8 weights are per "
                                      f"channel or per tensor (not block/group)")
        if a is None:
            raise NotImplementedError(f"{where}.input_activations is null (FP8 weight-only W8A16): cublade's fp8 "
                                      f"scheme quantizes activations too")
        if a.get("type") != "float" or a.get("num_bits") != 8:
            raise NotImplementedError(f"{where}.input_activations: expected 8-bit float, got "
                                      f"type={a.get('type')!r} num_bits={a.get('num_bits')!r}")
        a_strategy, dynamic = a.get("strategy"), a.get("dynamic")
        modes = {args: mode for mode, args in FP8_ACTIVATION_ARGS.items()}
        if (a_strategy, dynamic) not in modes:
            raise NotImplementedError(f"{where}.input_activations: strategy={a_strategy!r} dynamic={dynamic!r} "
                                      f"is not one of cublade's FP8 activation modes (token+dynamic, tensor+dynamic, "
                                      f"tensor+static)")
        if fmt not in (None, "float-quantized", "naive-quantized"):
            raise NotImplementedError(f"{where}: FP8 weights in format {fmt!r}; cublade reads 'float-quantized'")
        return Fp8Scheme(weight_strategy=strategy, activations=modes[(a_strategy, dynamic)])
    if wtype == "int" and bits == 4:
        if a is not None:
            raise NotImplementedError(f"{where}.input_activations: int4 weights with quantized activations "
                                      f"(W4A8) are not supported; cublade serves W4A16")
        if fmt not in (None, "pack-quantized"):
            raise NotImplementedError(f"{where}: int4 weights in format {fmt!r}; cublade reads 'pack-quantized'")
        if w.get("actorder") == "group":
            raise NotImplementedError(f"{where}.weights.actorder='group' (a g_idx per layer) is not supported; "
                                      f"'weight' (static) act-order is")
        if strategy == "channel":
            group_size = -1
        elif strategy == "group":
            group_size = w.get("group_size")
        else:
            raise NotImplementedError(f"{where}.weights.strategy={strategy!r}: cublade int4 weights are per group "
                                      f"or per channel")
        try:
            return W4A16Scheme(group_size=group_size, symmetric=bool(w.get("symmetric", True)))
        except ValueError as e:
            raise NotImplementedError(f"{where}.weights: {e}") from None
    raise NotImplementedError(f"{where}.weights: type={wtype!r} num_bits={bits!r} is not a cublade scheme "
                              f"(cublade reads 8-bit float W8A8 and 4-bit int W4A16)")


def policy_from_compressed_tensors(qc: dict) -> Policy:
    """The cublade Policy equivalent to a compressed-tensors quantization_config."""
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    if qc.get("sparsity_config"):
        raise NotImplementedError("compressed-tensors sparsity_config: sparse checkpoints are not supported")
    if qc.get("transform_config"):
        raise NotImplementedError("compressed-tensors transform_config: transformed checkpoints are not supported")
    schemes, rules = [], []
    for name, group in groups.items():
        schemes.append((name, _ct_scheme(name, group, qc.get("format"))))
        targets = group.get("targets") or []
        if not targets:
            raise ValueError(f"compressed-tensors config_groups.{name}.targets is empty")
        rules += [Rule(_ct_pattern(t, f"config_groups.{name}.targets"), name) for t in targets]
    ignore = tuple(_ct_pattern(t, "ignore") for t in qc.get("ignore") or [])
    kv = qc.get("kv_cache_scheme")
    if kv is not None:
        if not (kv.get("type") == "float" and kv.get("num_bits") == 8 and kv.get("strategy", "tensor") == "tensor"
                and not kv.get("dynamic", False)):
            raise NotImplementedError(f"compressed-tensors kv_cache_scheme {kv}: cublade's KV cache is FP8 with "
                                      f"static per-tensor scales")
    # compressed-tensors lets a module match any group whose target fits; cublade rules are ordered, first
    # match wins. Module-name targets go before the catch-all 'Linear' so the specific group wins.
    rules.sort(key=lambda r: r.pattern == r".*")
    return Policy(preset=CT_METHOD, schemes=tuple(schemes), rules=tuple(rules), ignore=ignore,
                  kv_cache=KVCacheScheme(KVCacheDtype.FP8) if kv is not None else None)


def tensor_specs(scheme: Scheme, N: int, K: int) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """suffix -> (shape, dtype) of the compressed-tensors tensors of a [N, K] module (dtype None: any float)."""
    out = {}
    for name, (shape, dtype) in scheme.tensor_specs(N, K).items():
        if isinstance(scheme, Fp8Scheme) and name == "weight_scale" and scheme.per_channel:
            shape = (N, 1)
        if name in ("weight_scale", "input_scale"):
            dtype = None  # compressed-tensors stores scales in the model's dtype or fp32
        if name == "weight_zero_point":
            shape, dtype = (-(-N // INT4_PER_INT32), shape[1]), torch.int32
        out[name] = (shape, dtype)
    if isinstance(scheme, W4A16Scheme):
        out["weight_shape"] = ((2,), torch.int64)
    return out


def pack_zero_points(zp: torch.Tensor) -> torch.Tensor:
    """cublade's uint8 zero points [N, groups] -> compressed-tensors' int32 [N/8, groups] (8 per int32 along N)."""
    return pack_int4(zp.t().contiguous()).t().contiguous()


def unpack_zero_points(packed: torch.Tensor, N: int) -> torch.Tensor:
    """compressed-tensors' int32 zero points [ceil(N/8), groups] -> cublade's uint8 [N, groups]."""
    return unpack_int4(packed.t().contiguous())[:, :N].t().contiguous()


# ---- writing ---------------------------------------------------------------------------------------------

def check_expressible(policy: Policy) -> None:
    """A ValueError naming the first scheme (or KV-cache setting) of `policy` that compressed-tensors cannot
    express so that vLLM's own method computes what cublade does."""
    why = {MXFP8Scheme: "compressed-tensors' MXFP8 quantizes activations to MXFP8 too (W8A8); cublade's mxfp8 "
                        "keeps them in bf16",
           FP4Scheme: "compressed-tensors has no FP4-weight, bf16-activation scheme for MoE experts that vLLM "
                      "serves as cublade does"}
    for name, scheme in policy.schemes:
        if type(scheme) in why:
            raise ValueError(f"--format {CT_METHOD}: scheme {name!r} ({scheme.describe()}) cannot be written in "
                             f"this format: {why[type(scheme)]}; use --format {QuantMethod.CUBLADE.value}")
    if policy.scheme_for("lm_head") is not None:
        raise ValueError(f"--format {CT_METHOD}: a quantized lm_head cannot be written in this format (vLLM's "
                         f"compressed-tensors method quantizes linear layers only, not the output projection); drop "
                         f"--quantize-lm-head or use --format {QuantMethod.CUBLADE.value}")
    if policy.kv_cache is not None and policy.kv_cache.rounding is not KVRounding.NEAREST:
        raise ValueError(f"--format {CT_METHOD}: --kv-rounding {policy.kv_cache.rounding} cannot be written in this "
                         f"format (its kv_cache_scheme has no rounding mode; vLLM rounds K to nearest); use --format "
                         f"{QuantMethod.CUBLADE.value}")


def _scheme_args(scheme: Scheme) -> dict:
    """The config group (weights, input_activations, format) of a cublade scheme."""
    if isinstance(scheme, Fp8Scheme):
        a_strategy, dynamic = FP8_ACTIVATION_ARGS[scheme.activations]
        return {"weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": scheme.weight_strategy.value,
                            "group_size": None, "block_structure": None, "dynamic": False, "actorder": None},
                "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": a_strategy,
                                      "group_size": None, "block_structure": None, "dynamic": dynamic,
                                      "actorder": None},
                "output_activations": None, "format": FLOAT_FORMAT}
    if isinstance(scheme, W4A16Scheme):
        channel = scheme.group_size == -1
        return {"weights": {"num_bits": 4, "type": "int", "symmetric": scheme.symmetric,
                            "strategy": "channel" if channel else "group",
                            "group_size": None if channel else scheme.group_size, "block_structure": None,
                            "dynamic": False, "actorder": None},
                "input_activations": None, "output_activations": None, "format": PACK_FORMAT}
    raise ValueError(f"--format {CT_METHOD}: scheme {scheme.describe()} cannot be written in this format")


def _ignore_target(pattern: str) -> str:
    """A cublade ignore regex (whole-name match) as a compressed-tensors `re:` target (matched from the start)."""
    return f"re:(?:{pattern})$" if "|" in pattern else f"re:{pattern}$"


def check_shape(scheme: Scheme, module: str, N: int, K: int) -> None:
    """What compressed-tensors' layout adds to the scheme's own shape rules (Scheme.check_shape)."""
    if isinstance(scheme, W4A16Scheme) and not scheme.symmetric and N % INT4_PER_INT32:
        raise scheme._unsupported(module, f"out_features={N} is not a multiple of {INT4_PER_INT32} "
                                          f"(compressed-tensors packs zero points {INT4_PER_INT32} per int32 along "
                                          f"the output dim)")


class CompressedTensorsLayout:
    """What `cublade convert --format compressed-tensors` writes in place of cublade's layout: per quantized
    module the tensors of `tensor_specs` (with concrete dtypes: the scales cublade computed, fp32 for FP8 and
    bf16 for int4), and the quantization_config."""

    method = CT_METHOD

    @staticmethod
    def specs(scheme: Scheme, N: int, K: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        ours = scheme.tensor_specs(N, K)
        return {name: (shape, dtype if dtype is not None else ours[name][1])
                for name, (shape, dtype) in tensor_specs(scheme, N, K).items()}

    @staticmethod
    def tensors(scheme: Scheme, t: dict[str, torch.Tensor], N: int, K: int) -> dict[str, torch.Tensor]:
        """cublade's tensors of one [N, K] module in compressed-tensors' layout: the same numbers."""
        out = dict(t)
        if isinstance(scheme, Fp8Scheme) and scheme.per_channel:
            out["weight_scale"] = t["weight_scale"].reshape(N, 1)
        if "weight_zero_point" in t:
            out["weight_zero_point"] = pack_zero_points(t["weight_zero_point"])
        if isinstance(scheme, W4A16Scheme):
            out["weight_shape"] = torch.tensor([N, K], dtype=torch.int64)
        return out

    @staticmethod
    def check_plan(plan, skip_unsupported: bool, experts: bool) -> None:
        """This format's own rules on a conversion's plan (cublade.convert.Plan): routed experts are not written
        in it, and shapes its layout cannot hold are refused, or left unquantized with `skip_unsupported` (as
        for Scheme.check_shape)."""
        shapes = {name[: -len(".weight")]: shape for name, shape, _ in plan.tensors if name.endswith(".weight")}
        for module, scheme in list(plan.quantize.items()):
            if experts and re.fullmatch(EXPERT_PATTERN, module):
                raise ValueError(f"--format {CT_METHOD}: {module} is a routed MoE expert; cublade writes experts "
                                 f"in its own format only (--ignore 're:{EXPERT_PATTERN}' keeps them unquantized)")
            try:
                check_shape(scheme, module, *shapes[module])
            except UnsupportedShape as e:
                if not skip_unsupported:
                    raise UnsupportedShape(f"{e} (use --skip-unsupported to leave such layers unquantized)") from None
                del plan.quantize[module]
                plan.skipped[module] = str(e)

    @staticmethod
    def config(policy: Policy, quantize: dict[str, Scheme], linear_modules: list[str]) -> dict:
        """The quantization_config for a conversion that quantizes `quantize` (module -> scheme) and leaves the
        other `linear_modules` unquantized. One scheme: one group targeting 'Linear', every unquantized linear
        the policy's ignore patterns miss named in `ignore`. Several: one group per scheme naming its modules.
        Read back (policy_from_compressed_tensors), it must give every module its scheme."""
        by_scheme: dict[Scheme, list[str]] = {}
        for module, scheme in quantize.items():
            by_scheme.setdefault(scheme, []).append(module)
        if not by_scheme:
            raise ValueError(f"--format {CT_METHOD}: the policy quantizes no module of this checkpoint")
        ignore = [_ignore_target(p) for p in policy.ignore]
        groups = {}
        if len(by_scheme) == 1:
            scheme = next(iter(by_scheme))
            groups["group_0"] = {"targets": ["Linear"], **_scheme_args(scheme)}
            ignore += [m for m in linear_modules if m not in quantize and not policy.is_ignored(m)]
        else:
            for i, (scheme, modules) in enumerate(by_scheme.items()):
                groups[f"group_{i}"] = {"targets": sorted(modules), **_scheme_args(scheme)}
        formats = {g["format"] for g in groups.values()}
        qc = {"quant_method": CT_METHOD, "format": formats.pop() if len(formats) == 1 else "mixed-precision",
              "quantization_status": "compressed", "config_groups": groups, "ignore": ignore,
              "kv_cache_scheme": dict(KV_CACHE_ARGS) if policy.kv_cache is not None else None,
              "global_compression_ratio": None}
        back = policy_from_compressed_tensors(qc)
        for module in linear_modules:
            if back.scheme_for(module) != quantize.get(module):
                raise RuntimeError(f"--format {CT_METHOD}: the written config gives {module} "
                                   f"{back.scheme_for(module)}, not {quantize.get(module)}")
        return qc
