"""The converter's part of the MoE experts: a source checkpoint's expert tensors in cublade's per-expert layout
(cublade.config.experts), checked against config.json, and the refusal to quantize a router.

What the converter calls (cublade.convert):
  layout = ExpertLayout.from_config(config_json)     # None for a model without routed experts
  expert_tensor_infos(tensor_infos(src), layout)      # the plan: fused tensors split, shapes/count checked
  check_router_policy(policy, layout, allow_quantized_router, plan_modules)  # before converting anything
  expert_tensors(iter_tensors(src), layout)           # the data, split the same way
Calibration (cublade.calib.capture) splits a layer's tensors with expert_tensors too.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from cublade.config.experts import ExpertLayout
from cublade.config.policy import ROUTER_PATTERNS, Policy

_FUSED = re.compile(r".*\.experts\.(gate_up_proj|down_proj)")


def is_fused_expert_tensor(name: str) -> bool:
    return _FUSED.fullmatch(name) is not None


def _split_fused_names(name: str, layout: ExpertLayout, kind: str) -> list[tuple[str, str, int]]:
    prefix = layout.per_expert_prefix(name.rsplit(".", 1)[0])
    projs = ("gate", "up") if kind == "gate_up" else ("down",)
    return [(f"{layout.expert_name(prefix, e, proj)}.weight", proj, e)
            for e in range(layout.num_experts) for proj in projs]


def expert_tensor_infos(infos: Iterable[tuple], layout: ExpertLayout | None) -> Iterator[tuple]:
    """Wrap cublade.checkpoint.tensor_infos: (path, name, shape, dtype) with every fused 3-D expert tensor
    replaced by its per-expert 2-D tensors (and a fused source's router renamed to match, see
    ExpertLayout.checkpoint_name), and every expert tensor checked against config.json (shape, expert id);
    after the last one, checks that no expert is missing."""
    if layout is None:
        yield from infos
        return
    names = []
    for path, name, shape, dtype in infos:
        if is_fused_expert_tensor(name):
            kind = layout.check_fused(name, shape)
            for n, proj, _ in _split_fused_names(name, layout, kind):
                names.append(n)
                yield path, n, layout.shape(proj), dtype
            continue
        p = layout.parse_expert(name)
        if p is not None:
            layout.check_expert_id(name, p[1])
            if p[3] == "weight":
                layout.check_weight(name, p[2], shape)
        names.append(name)
        yield path, layout.checkpoint_name(name), shape, dtype
    layout.check_complete(names)


def expert_tensors(tensors: Iterable[tuple[str, torch.Tensor]],
                   layout: ExpertLayout | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Wrap cublade.checkpoint.iter_tensors the same way (the data; checks are expert_tensor_infos')."""
    if layout is None:
        yield from tensors
        return
    for name, t in tensors:
        if not is_fused_expert_tensor(name):
            yield layout.checkpoint_name(name), t
            continue
        kind = layout.check_fused(name, tuple(t.shape))
        I = layout.intermediate_size
        for n, proj, e in _split_fused_names(name, layout, kind):
            if proj == "gate":
                yield n, t[e, :I]
            elif proj == "up":
                yield n, t[e, I:]
            else:
                yield n, t[e]


def check_router_policy(policy: Policy, layout: ExpertLayout | None, allow_quantized_router: bool,
                        module_names: Iterable[str]) -> None:
    """Refuse a policy that would quantize an MoE router unless asked for explicitly.

    The router's top-k flips on small logit changes, and vLLM builds Mixtral's router unquantized (it could
    not load a quantized one). Checked on every router among `module_names` (the model's modules with a
    2-D weight), so a rule that matches some layers' routers only is caught too."""
    if layout is None or allow_quantized_router:
        return
    routers = [m for m in module_names if any(re.fullmatch(p, m) for p in ROUTER_PATTERNS)]
    for m in routers:
        scheme = policy.scheme_for(m)
        if scheme is not None:
            raise ValueError(f"policy {policy.preset!r} quantizes the MoE router {m} (scheme {scheme.kind}); "
                             f"routers stay unquantized (add it to the ignore list), or pass "
                             f"allow_quantized_router=True (--allow-quantized-router) to quantize it anyway "
                             f"(vLLM's {layout.model_type} cannot serve a quantized router)")
