"""The reference backend's part of the MoE experts: a checkpoint's expert tensors fitted to a transformers model
built from its config (cublade.reference calls prepare_moe_reference before load_state_dict). Quantized experts
run as QuantExpertsRef: every expert linear is scheme.linear_ref on the stored tensors, through
cublade.numerics.moe.experts_forward_ref.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cublade.checkpoint import check_tensors
from cublade.config.experts import PROJS, ExpertLayout
from cublade.config.policy import Policy
from cublade.config.schemes import Scheme
from cublade.numerics.moe import experts_forward_ref


class QuantExpertsRef(nn.Module):
    """Drop-in for transformers' MixtralExperts (forward(hidden_states, top_k_index, top_k_weights)) whose
    expert linears compute scheme.linear_ref(x, tensors) from the checkpoint's quantized per-expert tensors,
    kept as stored (buffers), never dequantized into a stored copy."""

    def __init__(self, name: str, layout: ExpertLayout, schemes: dict[tuple[int, str], Scheme | None],
                 tensors: dict[tuple[int, str], dict[str, torch.Tensor]], act: Callable = F.silu):
        super().__init__()
        self.name, self.num_experts, self.act = name, layout.num_experts, act
        self.schemes = schemes
        self._suffixes: dict[tuple[int, str], tuple[str, ...]] = {}
        for e in range(layout.num_experts):
            for proj in PROJS:
                mod = layout.expert_name(name, e, proj)
                scheme, got = schemes[(e, proj)], tensors.get((e, proj), {})
                N, K = layout.shape(proj)
                specs = {"weight": ((N, K), None)} if scheme is None else scheme.tensor_specs(N, K)
                check_tensors(mod, specs, got, "an unquantized expert" if scheme is None else f"scheme {scheme.kind}",
                              f"config.json: hidden_size={layout.hidden_size}, intermediate size "
                              f"{layout.intermediate_size}")
                for suffix in specs:
                    self.register_buffer(f"e{e}_{proj}_{suffix}", got[suffix], persistent=False)
                self._suffixes[(e, proj)] = tuple(specs)

    def expert_linear(self, e: int, proj: str, x: torch.Tensor) -> torch.Tensor:
        t = {s: getattr(self, f"e{e}_{proj}_{s}") for s in self._suffixes[(e, proj)]}
        scheme = self.schemes[(e, proj)]
        if scheme is None:
            return F.linear(x, t["weight"].to(x.dtype))
        return scheme.linear_ref(x, t)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return experts_forward_ref(hidden_states, top_k_index, top_k_weights, self.expert_linear,
                                   self.num_experts, self.act)

    def extra_repr(self) -> str:
        kinds = sorted({s.describe() if s else "unquantized" for s in self.schemes.values()})
        return f"{self.num_experts} experts, {', '.join(kinds)}"


def prepare_moe_reference(model: nn.Module, tensors: dict[str, torch.Tensor], policy: Policy | None,
                          config: dict) -> int:
    """Fit a checkpoint's MoE tensors to a transformers model built from its config (reference backend).

    For every transformers experts module (3-D `gate_up_proj` / `down_proj` parameters, at `P.mlp.experts`):
    per-expert tensors `P.<block>.experts.{e}.<proj>.*` are popped from `tensors`; quantized experts replace
    the module by a QuantExpertsRef, unquantized ones are stacked into the fused tensors transformers loads.
    Fused tensors already in `tensors` are left as they are. The router `P.<block>.gate.weight` is renamed to
    transformers' `P.mlp.gate.weight`. Errors name the tensor (expert count, shapes, scale layouts).
    Returns the number of experts modules handled; 0 for a model without routed experts."""
    layout = ExpertLayout.from_config(config)
    if layout is None:
        return 0
    act = getattr(F, config.get("hidden_act", "silu"), None)
    if act is None:
        raise NotImplementedError(f"config.json hidden_act={config.get('hidden_act')!r}: the reference experts "
                                  f"support activations in torch.nn.functional (silu, gelu, relu)")
    by_block: dict[str, dict[tuple[int, str], dict[str, torch.Tensor]]] = {}
    for name in list(tensors):
        p = layout.parse_expert(name)
        if p is None:
            continue
        prefix, e, proj, suffix = p
        layout.check_expert_id(name, e)
        by_block.setdefault(prefix, {}).setdefault((e, proj), {})[suffix] = tensors.pop(name)

    handled = 0
    for mod_name, mod in list(model.named_modules()):
        if not (isinstance(getattr(mod, "gate_up_proj", None), torch.Tensor)
                and isinstance(getattr(mod, "down_proj", None), torch.Tensor)):
            continue
        prefix = layout.per_expert_prefix(mod_name)
        got = by_block.pop(prefix, None)
        _rename_router(tensors, layout, prefix, mod_name)
        if got is None:  # fused tensors (or nothing: load_state_dict names what is missing)
            continue
        schemes = {(e, proj): policy.scheme_for(layout.expert_name(prefix, e, proj)) if policy else None
                   for e in range(layout.num_experts) for proj in PROJS}
        handled += 1
        if all(s is None for s in schemes.values()):
            _stack_unquantized(tensors, layout, prefix, mod_name, got)
            continue
        model.set_submodule(mod_name, QuantExpertsRef(prefix, layout, schemes, got, act))
    if by_block:
        prefix = sorted(by_block)[0]
        raise ValueError(f"{prefix}: expert tensors for an MoE block the model (config.json: "
                         f"{config.get('num_hidden_layers')} layers) does not have")
    return handled


def _rename_router(tensors: dict, layout: ExpertLayout, prefix: str, mod_name: str) -> None:
    src = prefix.rsplit(".experts", 1)[0] + ".gate"
    dst = mod_name.rsplit(".experts", 1)[0] + ".gate"
    for name in [n for n in tensors if n.startswith(src + ".")]:
        suffix = name[len(src) + 1:]
        if suffix != "weight":
            raise NotImplementedError(f"{name}: a quantized MoE router; the reference backend (like vLLM's "
                                      f"{layout.model_type}) runs routers unquantized")
        if src != dst:
            tensors[f"{dst}.{suffix}"] = tensors.pop(name)


def _stack_unquantized(tensors: dict, layout: ExpertLayout, prefix: str, mod_name: str, got: dict) -> None:
    w = {}
    for e in range(layout.num_experts):
        for proj in PROJS:
            name = f"{layout.expert_name(prefix, e, proj)}.weight"
            t = got.get((e, proj), {})
            if "weight" not in t:
                raise ValueError(f"{name}: missing from the checkpoint (the policy leaves this expert unquantized)")
            if set(t) != {"weight"}:
                extra = f"{layout.expert_name(prefix, e, proj)}.{sorted(set(t) - {'weight'})[0]}"
                raise ValueError(f"{extra}: unexpected tensor (the policy leaves this expert unquantized)")
            layout.check_weight(name, proj, tuple(t["weight"].shape))
            w[(e, proj)] = t["weight"]
    E = layout.num_experts
    tensors[f"{mod_name}.gate_up_proj"] = torch.stack(
        [torch.cat([w[(e, "gate")], w[(e, "up")]]) for e in range(E)])
    tensors[f"{mod_name}.down_proj"] = torch.stack([w[(e, "down")] for e in range(E)])
