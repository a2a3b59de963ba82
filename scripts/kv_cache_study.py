"""Where the FP8 KV cache's loss goes on the bundled stories260K model, and what would win it back.

    python scripts/kv_cache_study.py [--model DIR] [--text FILE]

Converts the model with fp8-dynamic + `--kv-cache fp8` calibrated on lines [0:6) of the text, then scores lines
[6:) with the reference backend (fp32, windows of 512), K/V rounded through E4M3 in several ways:

- the shipped scheme: one abs-max scale per layer for K and one for V (what vLLM's FP8 cache takes);
- K only / V only, to split the cost;
- per-head and per-channel abs-max scales (E4M3 is a float format: a scale only moves values between
  saturation and subnormals, so finer scales should not help);
- K smoothing (as in SageAttention): store K - m, with m the calibration mean of each layer's post-RoPE K per
  (head, channel). softmax(q.(k_j - m)) = softmax(q.k_j - q.m) is the same for every key j of a query, so the
  attention is unchanged in exact arithmetic while the values E4M3 rounds are smaller than K's large per-channel
  offsets. Serving it would need the cache-write op to subtract m; cublade does not ship it (not measured on a
  GPU), this study only sizes the gain;
- a Hadamard rotation of Q and K per head (q.k unchanged), which spreads channels that are large in both;
- where the cost sits: K rounded in one layer at a time, and K's per-layer scale times 0.75 .. 2 (abs-max / 448 is
  x1; larger scales clip nothing and only move values within E4M3's binades, smaller ones clip);
- which way each element of K rounds: an oracle that picks, per key, the E4M3 neighbours (nearest or the other one
  of each element, all 2^8 choices of the 8 real channels) minimising the logit error weighted by the attention
  each later query actually pays the key (not servable: it sees the future), the same with every later query
  weighted alike, and what cublade ships, `--kv-rounding query-aware` (the key's own token's queries, at most 8
  flips from nearest: cublade.ops.fp8_kv_cache_write).
"""
from __future__ import annotations

import argparse
import itertools
import tempfile
from pathlib import Path

import torch

from cublade.config import preset
from cublade.convert import convert
from cublade.ops.fp8_kv_cache_write import _other_neighbour, fp8_kv_quant_ref
from cublade.text import tokenize, windows
from cublade.reference import FP8_KV_ATTENTION, fp8_kv_round_key, load_reference_model

REPO = Path(__file__).resolve().parents[1]
CALIB, EVAL = slice(0, 6), slice(6, None)


def fp8_round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (fp8_kv_quant_ref(x, scale).float() * scale).to(x.dtype)


def hadamard(n: int) -> torch.Tensor:
    """Orthonormal n x n Hadamard matrix (Sylvester's construction, n a power of 2)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / n**0.5


LABELS = {"none": "not rounded (fp8-dynamic alone)", "per-layer": "abs-max scale per layer, K to nearest (shipped default)",
          "K only": "K only, per layer", "V only": "V only, per layer", "per-head": "K scale per head",
          "per-channel": "K scale per channel", "K smoothed": "K - calibrated mean, scale per layer",
          "K rotated": "Q and K rotated (Hadamard per head), scale per layer",
          "oracle attention": "K rounded per key for the attention later queries pay it (oracle)",
          "oracle uniform": "K rounded per key for every later query alike (oracle)",
          "query-aware": "K rounded query-aware (shipped: --kv-rounding query-aware)"}


def oracle_round(query: torch.Tensor, key: torch.Tensor, scale: torch.Tensor, weights: str) -> torch.Tensor:
    """query [H, T, D], key [G, T, D] (one window, after RoPE) -> key rounded per key vector to the E4M3 choice
    (nearest or other neighbour per element) minimising sum_i w_ij (q_i . e_j)^2 over the later queries i of
    its group; w: the attention probabilities (weights="attention") or 1 (weights="uniform")."""
    H, T, D = query.shape
    G, R = key.shape[0], H // key.shape[0]
    xs = (key / scale).clamp(-448, 448)
    r = xs.to(torch.float8_e4m3fn)
    near, other = r.float(), _other_neighbour(r, xs).float()
    e0, e1 = near - xs, other - xs
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    if weights == "attention":
        logits = query @ key.repeat_interleave(R, 0).transpose(1, 2) / D**0.5
        w = logits.masked_fill(~causal, float("-inf")).softmax(-1)  # [H, i, j]
    else:
        w = causal.float().expand(H, T, T)
    C = torch.einsum("hij,hid,hie->hjde", w, query, query).reshape(G, R, T, D, D).sum(1)
    live = (e0 != e1).any(dim=(0, 1)).nonzero().flatten()  # channels that can move (not the zero padding)
    combos = torch.tensor(list(itertools.product([0, 1], repeat=len(live))), dtype=torch.bool)
    e = torch.where(combos, e1[..., None, live], e0[..., None, live])  # [G, T, choices, live]
    cost = torch.einsum("gtmd,gtde,gtme->gtm", e, C[..., live, :][..., live], e)
    pick = torch.zeros_like(near, dtype=torch.bool)
    pick[..., live] = combos[cost.argmin(-1)]
    return torch.where(pick, other, near) * scale


class Study:
    """Swaps the reference backend's attention function for one that rounds K/V as `self.mode` says."""

    def __init__(self, ckpt: Path, text: Path):
        from transformers import AttentionInterface

        self.model, _ = load_reference_model(ckpt)
        self.attn = [m for m in self.model.modules() if hasattr(m, "cublade_kv_scales")]
        for i, m in enumerate(self.attn):
            m.cublade_layer = i
        self.calib = windows(tokenize(ckpt, text, CALIB), 512)
        self.eval = windows(tokenize(ckpt, text, EVAL), 512)
        self.mode = "none"
        self.k_layer, self.k_mult = None, 1.0  # "K only": round one layer's K only / scale its scale
        self.keys: list[list[torch.Tensor]] = [[] for _ in self.attn]
        AttentionInterface.register(FP8_KV_ATTENTION, self._attention)

    def _attention(self, module, query, key, value, attention_mask, **kw):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        i = module.cublade_layer
        k_scale, v_scale = module.cublade_kv_scales
        if self.mode == "record":
            self.keys[i].append(key[0].float())  # [heads, tokens, head_dim], after RoPE
        elif self.mode == "per-layer":
            key, value = fp8_round(key, k_scale), fp8_round(value, v_scale)
        elif self.mode == "K only":  # in layer self.k_layer alone when set, with the scale times self.k_mult
            if self.k_layer in (None, i):
                key = fp8_round(key, k_scale * self.k_mult)
        elif self.mode == "V only":
            value = fp8_round(value, v_scale)
        elif self.mode in ("per-head", "per-channel"):
            key, value = fp8_round(key, self.k_scales[i]), fp8_round(value, v_scale)
        elif self.mode == "K smoothed":
            key, value = fp8_round(key - self.k_mean[i], self.k_scales[i]), fp8_round(value, v_scale)
        elif self.mode == "K rotated":
            h = hadamard(key.shape[-1]).to(key.dtype)
            query, key, value = query @ h, fp8_round(key @ h, self.k_scales[i]), fp8_round(value, v_scale)
        elif self.mode.startswith("oracle"):
            key = oracle_round(query[0], key[0], k_scale, self.mode.split()[1])[None]
            value = fp8_round(value, v_scale)
        elif self.mode == "query-aware":
            key, value = fp8_kv_round_key(query, key, k_scale, "query-aware"), fp8_round(value, v_scale)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    @torch.inference_mode()
    def loss(self, mode: str, wins=None) -> float:
        self.mode = mode
        total, n = 0.0, 0
        for w in wins or self.eval:
            x = torch.tensor([w])
            logits = self.model(x).logits[0, :-1]
            total += torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
            n += len(w) - 1
        return total / n

    def calibrate(self) -> None:
        """Per (head, channel) K statistics over the calibration windows."""
        self.loss("record", self.calib)
        keys = [torch.cat(k, dim=1) for k in self.keys]  # [heads, all tokens, head_dim]
        self.k_mean = [k.mean(dim=1)[None, :, None, :] for k in keys]
        self.amax = {
            "per-head": [k.abs().amax(dim=(1, 2))[None, :, None, None] for k in keys],
            "per-channel": [k.abs().amax(dim=1)[None, :, None, :] for k in keys],
            "K smoothed": [(k - m[0]).abs().amax() for k, m in zip(keys, self.k_mean)],
            "K rotated": [(k @ hadamard(k.shape[-1])).abs().amax() for k in keys],
        }

    def run(self) -> list[tuple[str, float]]:
        """(row label, loss) for every way of rounding; the first row is fp8-dynamic alone."""
        self.calibrate()
        rows = [(LABELS[mode], self.loss(mode)) for mode in ("none", "per-layer", "K only", "V only",
                                                              "oracle attention", "oracle uniform", "query-aware")]
        for mode in ("per-head", "per-channel", "K smoothed", "K rotated"):
            self.k_scales = [(a / 448).clamp_min(1e-12) for a in self.amax[mode]]
            rows.append((LABELS[mode], self.loss(mode)))
        for self.k_layer in range(len(self.attn)):
            rows.append((f"K only, layer {self.k_layer} alone", self.loss("K only")))
        self.k_layer = None
        for self.k_mult in (0.75, 1.25, 1.5, 2.0):
            rows.append((f"K only, per-layer scale x {self.k_mult}", self.loss("K only")))
        self.k_mult = 1.0
        return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "fixtures/models/stories260K-padded-hf")
    ap.add_argument("--text", type=Path, default=REPO / "fixtures/data/tinystories_valid_head30k.txt")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = convert(args.model, Path(tmp) / "fp8-kv", preset("fp8-dynamic", kv_cache="fp8"),
                       calib_text=args.text, calib_lines=CALIB, progress=False)
        study = Study(ckpt, args.text)
        rows = study.run()
    base = rows[0][1]
    print("K's rms per RoPE channel pair (after RoPE, calibration text), fastest to slowest rotating of the 4 real "
          "pairs (HF pairs i, i + 8; 1, 0.1, 0.01, 0.001 rad per token):")
    for layer, keys in enumerate(study.keys):
        k = torch.cat(keys, dim=1)
        pairs = (k[..., :8] ** 2 + k[..., 8:] ** 2).mean(dim=(0, 1)).sqrt()[:4]
        print(f"  layer {layer}: " + " / ".join(f"{v:.1f}" for v in pairs.tolist()))
    print("fp8-dynamic weights/activations, K/V rounded through E4M3; loss on lines [6:), calibrated on [0:6)")
    print("| K/V in the cache | loss | cost over fp8-dynamic |\n|---|---|---|")
    for label, loss in rows:
        print(f"| {label} | {loss:.4f} | {loss - base:+.4f} |")


if __name__ == "__main__":
    main()
