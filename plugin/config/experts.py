"""MoE expert tensors in a checkpoint: their names and sizes per model type, read from config.json, and the
checks of a set of expert tensors against them.

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

Who uses the layout:
  the converter (cublade.convert, through cublade.convert_experts): fused tensors split, shapes and counts
      checked, routers kept unquantized;
  the reference backend (cublade.reference_experts): a checkpoint's experts fitted to a transformers model;
  serving (cublade.vllm.moe.check_checkpoint_experts): a converted checkpoint's experts checked before vLLM's
      FusedMoE loader, which drops expert ids beyond config.json's count without a word.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

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


def expert_layout(model_dir) -> ExpertLayout | None:
    """ExpertLayout.from_config of a checkpoint directory's config.json (None without one: the checkpoint
    reader reports a missing or unreadable config.json in its own words)."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return ExpertLayout.from_config(cfg) if isinstance(cfg, dict) else None
