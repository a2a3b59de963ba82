"""Running a Hugging Face causal LM one decoder layer at a time, and what calibration observes on the way.

`LayerwiseModel` builds the model's module tree on the meta device (no memory), then materializes one
decoder layer at a time from the safetensors shards, so the peak holds one layer's weights plus the
calibration hidden states ([tokens, hidden] fp32), whatever the model's depth.

Observers (forward pre-hooks on the layer's nn.Linear modules, and an attention function):
  * `LinearInputStats`: per linear, the input Hessian sum X^T X (for GPTQ) and/or the input abs-max (for
    static FP8 input scales), over every calibration token;
  * `KVStats`: per attention module, abs-max of K after RoPE and of V, i.e. the tensors vLLM writes into
    its KV cache. They are read inside the attention function (`CALIB_ATTENTION`), which transformers calls
    with the post-RoPE key/value states, before any GQA head repeat.
"""
from __future__ import annotations

import ctypes
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from cublade.checkpoint import CheckpointError, read_header, read_tensor, tensor_infos
from cublade.config.experts import ExpertLayout

CALIB_ATTENTION = "cublade_calib"

# The KVStats collecting right now (None: the attention function only computes attention).
_ACTIVE_KV: KVStats | None = None


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; nothing where libc has none).

    Tensors freed below glibc's mmap threshold (which grows to 32 MiB as large blocks are freed) stay in the heap,
    resident; the next Hessian or factor (K x K, above the threshold) is mapped afresh beside them. Called before
    each layer and each GPTQ linear, so calibration's peak does not hold a layer's freed temporaries too."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc_with_malloc_trim():
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc_with_malloc_trim()


@dataclass
class KVStats:
    """abs-max of post-RoPE K and of V per attention module name."""
    names: dict[int, str] = field(default_factory=dict)  # id(attention module) -> its full name
    k_amax: dict[str, torch.Tensor] = field(default_factory=dict)
    v_amax: dict[str, torch.Tensor] = field(default_factory=dict)

    def update(self, module: nn.Module, key: torch.Tensor, value: torch.Tensor) -> None:
        name = self.names.get(id(module))
        if name is None:
            return
        for store, x in ((self.k_amax, key), (self.v_amax, value)):
            a = x.detach().abs().amax().float()
            store[name] = a if name not in store else torch.maximum(store[name], a)


def _calib_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _ACTIVE_KV is not None:
        _ACTIVE_KV.update(module, key, value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(CALIB_ATTENTION, _calib_attention)


@contextmanager
def observe_kv(layer: nn.Module, prefix: str):
    """Collect KVStats for the attention modules of `layer` (full names `prefix.<path>`)."""
    global _ACTIVE_KV
    stats = KVStats()
    for path, mod in layer.named_modules():
        if hasattr(mod, "k_proj") and hasattr(mod, "v_proj"):  # the converter's rule: parent of a k_proj
            stats.names[id(mod)] = f"{prefix}.{path}" if path else prefix
    _ACTIVE_KV = stats
    try:
        yield stats
    finally:
        _ACTIVE_KV = None


@dataclass
class LinearInputStats:
    hessian: torch.Tensor | None = None  # fp32 [K, K], sum of x^T x over tokens
    amax: torch.Tensor | None = None  # fp32 scalar


@contextmanager
def observe_linears(layer: nn.Module, prefix: str, hessian: set[str], amax: set[str]):
    """Forward pre-hooks on the layer's linears named (full name) in `hessian` / `amax`.
    Yields {full name: LinearInputStats}."""
    stats: dict[str, LinearInputStats] = {}
    handles = []
    # The input the last Hessian hook summed and the sum it went into: linears that read the same tensor (q, k, v;
    # gate, up) share one X^T X, computed once per input.
    last: dict[str, torch.Tensor] = {}

    def hook(name, want_h, want_a):
        def fn(mod, args):
            x = args[0].detach()
            x = x.reshape(-1, x.shape[-1]).float()
            st = stats[name]
            if want_h:
                if last.get("input") is args[0] and (st.hessian is None or st.hessian is last["sum"]):
                    st.hessian = last["sum"]
                else:
                    xtx = x.t() @ x
                    st.hessian = xtx if st.hessian is None else st.hessian.add_(xtx)
                    last.update(input=args[0], sum=st.hessian)
            if want_a:
                a = x.abs().amax()
                st.amax = a if st.amax is None else torch.maximum(st.amax, a)
        return fn

    try:
        for path, mod in layer.named_modules():
            full = f"{prefix}.{path}"
            if isinstance(mod, nn.Linear) and (full in hessian or full in amax):
                stats[full] = LinearInputStats()
                handles.append(mod.register_forward_pre_hook(hook(full, full in hessian, full in amax)))
        yield stats
    finally:
        last.clear()
        for h in handles:
            h.remove()


def linear_groups(layer: nn.Module, prefix: str, names: set[str], run) -> list[list[str]]:
    """The linears `names` of `layer` in the order the layer calls them, grouped by shared input (q/k/v read
    the same tensor, so do gate/up): [[q, k, v], [o], [gate, up], [down]] for a Llama layer. `run()` runs
    the layer once. Linears the run does not reach come last, one group."""
    seen: dict[str, torch.Tensor] = {}  # name -> its input tensor (kept alive: compared by identity)

    def record(full):
        def fn(mod, args):
            seen.setdefault(full, args[0])
        return fn

    handles = []
    for path, mod in layer.named_modules():
        full = f"{prefix}.{path}"
        if full in names:
            handles.append(mod.register_forward_pre_hook(record(full)))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    groups: list[list[str]] = []
    last = None
    for name, key in seen.items():
        if groups and key is last:
            groups[-1].append(name)
        else:
            groups.append([name])
        last = key
    rest = [n for n in names if n not in seen]
    return groups + ([sorted(rest)] if rest else [])


class QuantizedLinear(nn.Module):
    """Stands in for an nn.Linear while calibration propagates hidden states through the quantized layer:
    y = scheme.linear_ref(x, tensors), the checkpoint's own numerics."""

    def __init__(self, scheme, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None):
        super().__init__()
        self.scheme, self.tensors, self.bias = scheme, tensors, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scheme.linear_ref(x, self.tensors, self.bias)


class LayerwiseModel:
    """A causal LM whose decoder layers are loaded from the checkpoint one at a time.

    Supports the Llama-style layout transformers uses for Llama, Mistral, Qwen2/3, Mixtral and similar
    models: `model.embed_tokens`, `model.rotary_emb`, `model.layers[i]`, with checkpoint tensor names equal to
    the module names, except MoE experts, read in the layouts cublade.config.experts knows. Other layouts get a
    NotImplementedError naming what is missing."""

    def __init__(self, src_dir: Path, device: torch.device, dtype: torch.dtype = torch.float32):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.src_dir, self.device, self.dtype = Path(src_dir), torch.device(device), dtype
        register_attention()
        self.config = AutoConfig.from_pretrained(str(src_dir))
        if "quantization_config" in self.config.to_dict():
            raise CheckpointError(f"{src_dir}: already quantized (config.json has a quantization_config); "
                                  f"calibration needs the unquantized checkpoint")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.config, dtype=dtype,
                                                     attn_implementation=CALIB_ATTENTION)
        base = getattr(model, "model", None)
        missing = [a for a in ("embed_tokens", "layers", "rotary_emb") if not hasattr(base, a)]
        if missing:
            raise NotImplementedError(f"calibration: {type(model).__name__} has no model.{', model.'.join(missing)}; "
                                      f"layer-by-layer calibration supports Llama-style decoder models")
        self.base = base
        self.layers = base.layers
        self.prefix = next(n for n, m in model.named_modules() if m is base.layers)  # e.g. "model.layers"
        self.embed_name = next(n for n, m in model.named_modules() if m is base.embed_tokens)
        with torch.device(self.device):
            self.rotary = type(base.rotary_emb)(config=self.config).to(torch.float32)
        self.files: dict[str, Path] = {name: path for path, name, _, _ in tensor_infos(self.src_dir)}
        self.config_dict = json.loads((self.src_dir / "config.json").read_text())
        self.experts = ExpertLayout.from_config(self.config_dict)  # None: no routed experts
        self.quantized_experts: dict[str, object] = {}  # expert linear -> scheme, filled by load_layer

    def __len__(self) -> int:
        return len(self.layers)

    def layer_name(self, i: int) -> str:
        return f"{self.prefix}.{i}"

    def _read(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors `names` as the checkpoint stores them, one at a time, each on a mapping of its own bytes
        (cublade.checkpoint.read_tensor) that is unmapped when the tensor is freed: no shard stays mapped."""
        missing = [n for n in names if n not in self.files]
        if missing:
            raise CheckpointError(f"{self.src_dir}: tensor(s) {', '.join(missing[:4])} missing from the "
                                  f"checkpoint (needed to run the model for calibration)")
        wanted = set(names)
        for path in dict.fromkeys(self.files[n] for n in names):
            with open(path, "rb") as f:
                for e in read_header(path):
                    if e.name in wanted:
                        yield e.name, read_tensor(f, e)

    def _load(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The tensors `names` on the device in the calibration dtype; each source tensor is dropped once
        converted."""
        return {n: t.to(self.device, self.dtype) for n, t in self._read(names)}

    def embed(self, windows: list[list[int]]) -> list[torch.Tensor]:
        """Hidden states [1, T, hidden] of each window of token ids: rows gathered from the embedding as stored
        (only the rows' pages are read), then converted."""
        (_, w), = self._read([f"{self.embed_name}.weight"])
        return [nn.functional.embedding(torch.tensor([ids]), w).to(self.device, self.dtype) for ids in windows]

    def load_layer(self, i: int, policy=None) -> nn.Module:
        """Layer i with its weights from the checkpoint. MoE experts (read in either layout, see
        cublade.config.experts) are quantized with `policy`'s schemes and run through the reference experts, as the
        converted checkpoint will run them; their weights are not calibrated."""
        layer = self.layers[i]
        prefix = self.layer_name(i)
        tensors = self._load([n for n in self.files if n.startswith(prefix + ".")])
        if self.experts is not None:
            self._prepare_experts(prefix, layer, tensors, policy)
        state = {n[len(prefix) + 1:]: t for n, t in tensors.items()}
        layer.load_state_dict(state, strict=False, assign=True)
        still_meta = [n for n, t in (*layer.named_parameters(), *layer.named_buffers()) if t.is_meta]
        if still_meta:
            raise NotImplementedError(f"calibration: layer {prefix} has tensors the checkpoint does not "
                                      f"name as module paths: {', '.join(still_meta[:4])}")
        return layer.eval()

    def _prepare_experts(self, prefix: str, layer: nn.Module, tensors: dict[str, torch.Tensor], policy) -> None:
        from cublade.convert_experts import expert_tensors
        from cublade.reference_experts import prepare_moe_reference

        split = dict(expert_tensors(list(tensors.items()), self.experts))
        tensors.clear()
        for name, t in split.items():
            p = self.experts.parse_expert(name)
            scheme = policy.scheme_for(name[: -len(".weight")]) if p and p[3] == "weight" and policy else None
            if scheme is None:
                tensors[name] = t
                continue
            module = name[: -len(".weight")]
            if getattr(scheme, "static", False):
                raise NotImplementedError(f"calibration: {module}: static FP8 input scales for MoE experts are not "
                                          f"supported (this pass does not gather per-expert inputs); give experts "
                                          f"dynamic activations (e.g. the fp4-experts-fp8-dense preset)")
            self.quantized_experts[module] = scheme
            tensors.update({f"{module}.{k}": v for k, v in scheme.quantize(t).items()})
        # prepare_moe_reference finds the experts module by its full name: hang the layer at its path.
        root = cur = nn.Module()
        *parents, last = prefix.split(".")
        for part in parents:
            cur.add_module(part, nn.Module())
            cur = getattr(cur, part)
        cur.add_module(last, layer)
        prepare_moe_reference(root, tensors, policy, self.config_dict)

    def release_layer(self, i: int) -> None:
        """Drop layer i (its weights and any quantized stand-ins): each layer is run once."""
        self.layers[i] = nn.Identity()

    def position_embeddings(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(hidden.shape[1], device=self.device).unsqueeze(0)
        cos, sin = self.rotary(hidden, pos)
        return cos.to(hidden.dtype), sin.to(hidden.dtype)

    def run_layer(self, layer: nn.Module, hidden: torch.Tensor, pos_emb) -> torch.Tensor:
        out = layer(hidden, attention_mask=None, position_embeddings=pos_emb)
        return out[0] if isinstance(out, tuple) else out
