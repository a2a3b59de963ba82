"""MoE expert tensors: the layouts cublade reads, their checks against config.json, and the reference experts.

Two source layouts of the routed experts of one MoE block `P` (e.g. `model.layers.3`):
  per-expert  `P.<block>.experts.{e}.<gate|up|down>.weight`, 2-D [I, H] / [I, H] / [H, I].
              Mixtral: block `block_sparse_moe`, names w1 (gate), w3 (up), w2 (down) — what vLLM's
              MixtralForCausalLM loads. Qwen2/3-MoE, OLMoE: block `mlp`, names gate_proj / up_proj / down_proj.
  fused 3-D   `P.mlp.experts.gate_up_proj` [E, 2I, H] (gate rows 0..I-1, then up rows) and
              `P.mlp.experts.down_proj` [E, H, I]: the layout transformers 5 holds in memory, and that newer
              checkpoints ship.
A cublade checkpoint always stores experts per expert (the fused source is split by the converter, with the
per-expert names of the model type, so vLLM loads it), each expert linear quantized like any linear:
`...experts.{e}.w1.weight_packed`, `.weight_scale`, ... (tensor format: cublade.config.schemes).

What the converter calls (cublade.convert):
  layout = ExpertLayout.from_config(config_json)     # None for a model without routed experts
  expert_tensor_infos(tensor_infos(src), layout)      # the plan: fused tensors split, shapes/count checked
  check_router_policy(policy, layout, allow_quantized_router, plan_modules)  # before converting anything
  expert_tensors(iter_tensors(src), layout)           # the data, split the same way
What the reference backend calls (cublade.reference), before load_state_dict:
  prepare_moe_reference(model, tensors, policy, config_dict)
What a serving loader can call on a converted checkpoint (vLLM's FusedMoE loader silently drops expert ids
beyond config.json's count): check_checkpoint_experts(model_dir)
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cublade.checkpoint import check_tensors
from cublade.config.policy import ROUTER_PATTERNS, Policy
from cublade.config.schemes import Scheme

PROJS = ("gate", "up", "down")


@dataclass(frozen=True)
class ExpertLayout:
    """Names and sizes of a model type's routed experts, read from config.json."""
    model_type: str
    num_experts: int
    hidden_size: int
    intermediate_size: int  # of one expert
    top_k: int
    block: str  # per-expert checkpoint block name: 'block_sparse_moe' (Mixtral) or 'mlp'
    names: tuple[str, str, str]  # per-expert names of gate, up, down: ('w1', 'w3', 'w2') for Mixtral

    # model_type -> (block, (gate, up, down), config key of E, config key of I)
    KNOWN = {
        "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"), "num_local_experts", "intermediate_size"),
        "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts", "moe_intermediate_size"),
        "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts", "moe_intermediate_size"),
        "olmoe": ("mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts", "intermediate_size"),
    }

    @classmethod
    def from_config(cls, cfg: dict) -> ExpertLayout | None:
        """The layout of a config.json dict, None when it describes no routed experts."""
        mt = cfg.get("model_type")
        if mt not in cls.KNOWN:
            if any(k in cfg for k in ("num_local_experts", "num_experts", "n_routed_experts")):
                raise NotImplementedError(
                    f"config.json model_type={mt!r} has routed experts, but cublade knows the expert tensor "
                    f"names of {', '.join(cls.KNOWN)} only")
            return None
        block, names, e_key, i_key = cls.KNOWN[mt]
        for key in (e_key, i_key, "hidden_size", "num_experts_per_tok"):
            if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
                raise ValueError(f"config.json: {key}={cfg.get(key)!r}; a {mt} model needs a positive integer")
        return cls(mt, cfg[e_key], cfg["hidden_size"], cfg[i_key], cfg["num_experts_per_tok"], block, names)

    # --- names ----------------------------------------------------------------------------------------
    @property
    def _per_expert_re(self) -> re.Pattern:
        names = "|".join(map(re.escape, self.names))
        return re.compile(rf"(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>{names})(?P<rest>\..+)")

    def parse_expert(self, name: str) -> tuple[str, int, str, str] | None:
        """(experts prefix, expert id, proj in PROJS, tensor suffix) of a per-expert tensor name, else None."""
        m = self._per_expert_re.fullmatch(name)
        if m is None:
            return None
        return m["prefix"], int(m["e"]), PROJS[self.names.index(m["proj"])], m["rest"][1:]

    def expert_name(self, experts_prefix: str, e: int, proj: str) -> str:
        """Module name of one expert linear, e.g. model.layers.0.block_sparse_moe.experts.3.w1."""
        return f"{experts_prefix}.{e}.{self.names[PROJS.index(proj)]}"

    def shape(self, proj: str) -> tuple[int, int]:
        """[out, in] of one expert's linear."""
        H, I = self.hidden_size, self.intermediate_size
        return (H, I) if proj == "down" else (I, H)

    def checkpoint_name(self, name: str) -> str:
        """A fused-layout (transformers in-memory) router name in the per-expert checkpoint's naming:
        `P.mlp.gate.weight` -> `P.block_sparse_moe.gate.weight` for Mixtral; other names unchanged."""
        if self.block == "mlp":
            return name
        return re.sub(r"\.mlp\.gate\.(weight|bias)$", rf".{self.block}.gate.\1", name)

    def per_expert_prefix(self, fused_prefix: str) -> str:
        """`P.mlp.experts` (fused / transformers in-memory) -> `P.<block>.experts` (per-expert checkpoint)."""
        head, sep, tail = fused_prefix.rpartition(".mlp.experts")
        if not sep or tail:
            raise ValueError(f"{fused_prefix}: expected a name ending in .mlp.experts")
        return f"{head}.{self.block}.experts"

    # --- checks ---------------------------------------------------------------------------------------
    def check_expert_id(self, name: str, e: int) -> None:
        if e >= self.num_experts:
            raise ValueError(f"{name}: expert id {e}, but config.json says {self.num_experts} experts "
                             f"(ids 0..{self.num_experts - 1})")

    def check_weight(self, name: str, proj: str, shape: tuple[int, ...]) -> None:
        want = self.shape(proj)
        if tuple(shape) != want:
            raise ValueError(f"{name}: shape {list(shape)}, expected {list(want)} for the {proj} projection of "
                             f"one expert (config.json: hidden_size={self.hidden_size}, intermediate size "
                             f"{self.intermediate_size})")

    def check_fused(self, name: str, shape: tuple[int, ...]) -> str:
        """'gate_up' or 'down' for a valid fused 3-D tensor; else a ValueError naming it."""
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size
        kind = name.rsplit(".", 1)[-1].removesuffix("_proj")
        want = {"gate_up": (E, 2 * I, H), "down": (E, H, I)}[kind]
        if tuple(shape) == want:
            return kind
        if len(shape) == 3 and tuple(shape) == (want[0], want[2], want[1]):
            raise ValueError(f"{name}: shape {list(shape)} is the transposed fused layout [E, in, out]; "
                             f"cublade reads the transformers layout {list(want)} ([E, out, in], gate rows then "
                             f"up rows)")
        if len(shape) == 3 and shape[0] != E:
            raise ValueError(f"{name}: {shape[0]} experts, but config.json says {E}")
        raise ValueError(f"{name}: shape {list(shape)}, expected {list(want)} (config.json: {E} experts, "
                         f"hidden_size={H}, intermediate size {I})")

    def check_complete(self, names: Iterable[str]) -> None:
        """Every MoE block that has any expert tensor has all E experts x 3 projections (weights or the
        scheme's tensors: checked on the tensor suffix each projection has)."""
        seen: dict[str, dict[tuple[int, str], set[str]]] = {}
        for name in names:
            p = self.parse_expert(name)
            if p is None:
                continue
            prefix, e, proj, suffix = p
            self.check_expert_id(name, e)
            seen.setdefault(prefix, {}).setdefault((e, proj), set()).add(suffix)
        for prefix, got in seen.items():
            suffixes = set().union(*got.values())
            for e in range(self.num_experts):
                for proj in PROJS:
                    missing = suffixes - got.get((e, proj), set())
                    if missing:
                        raise ValueError(f"{self.expert_name(prefix, e, proj)}.{sorted(missing)[0]}: missing from "
                                         f"the checkpoint (config.json says {self.num_experts} experts; other "
                                         f"experts of {prefix} have it)")


# --- converter hooks --------------------------------------------------------------------------------------

def expert_layout(model_dir) -> ExpertLayout | None:
    """ExpertLayout.from_config of a checkpoint directory's config.json (None without one: the checkpoint
    reader reports a missing or unreadable config.json in its own words)."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return ExpertLayout.from_config(cfg) if isinstance(cfg, dict) else None


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


def check_checkpoint_experts(model_dir) -> None:
    """A cublade (or any per-expert) checkpoint's expert tensors against its config.json, from the safetensors
    headers only: no expert id beyond the config's count, none missing. For loaders that would otherwise drop
    an extra expert without a word (vLLM's FusedMoE loader maps ids 0..E-1 only)."""
    from cublade.checkpoint import tensor_infos

    layout = expert_layout(model_dir)
    if layout is None:
        return
    layout.check_complete(name for _, name, _, _ in tensor_infos(model_dir))


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


# --- the MoE computation, shared by the reference backend and the vLLM CPU path ---------------------------

ExpertLinear = Callable[[int, str, torch.Tensor], torch.Tensor]


def experts_forward_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        linear: ExpertLinear, num_experts: int,
                        act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j].

    x [T, H]; topk_ids [T, k] (ids outside 0..num_experts-1, e.g. -1 for an expert on another rank, are
    skipped); linear(e, proj, x) computes one expert linear (proj in 'gate', 'up', 'down') and returns x's
    dtype. The weighted sum is accumulated in fp32 and returned in x's dtype."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in range(num_experts):
        tok, slot = torch.where(topk_ids == e)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        h = act(linear(e, "gate", xe)) * linear(e, "up", xe)
        y = linear(e, "down", h)
        out.index_add_(0, tok, y.float() * topk_weights[tok, slot, None].float())
    return out.to(x.dtype)


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
