"""Why FP8 activations move more than bf16 ones between TP = 1 and TP = 2, on the 2-layer Llama-3-8B-shaped model of
tests/gpu/test_tensor_parallel_8b_shaped.py (random N(0, 0.02) weights, benchmarks/bench_e2e.py's make_source).

    python scripts/tp_fp8_study.py [--tp 2] [--schemes bf16,fp8-static,fp8-dynamic] [--prompts 8] [--new-tokens 32]

A CPU simulation of the linear layers' numerics only (no vLLM, no kernels): each projection multiplies in fp32 and
rounds its output to bf16, as a GEMM with an fp32 accumulator does. At TP = N the row-parallel layers (o_proj,
down_proj) compute each 1/N of K on its own, round each partial sum to bf16 and add them in fp32, rounded once (the
all-reduce of bf16 outputs); the column-parallel layers split N, which changes no output. Activations, per scheme:

- bf16: as they are;
- fp8-static: rounded to E4M3 with one scale per layer (calibrated at TP = 1 on the same prompts), the same scale
  on every rank;
- fp8-dynamic: rounded to E4M3 with one scale per token over the layer's K, which a row-parallel rank takes over
  its own part.

Weights: E4M3 with a scale per output channel for the FP8 schemes. The TP = 1 model generates greedy continuations;
both models then score those tokens teacher-forced, as the GPU test does: the share of positions where the TP = N
model ranks the TP = 1 token first, and the mean |log-probability difference|. Since the inputs of each layer differ
by bf16 rounding only, what separates the schemes is how that difference propagates through FP8 rounding (one E4M3
step is 2^-3 relative, a bf16 step 2^-8) and, for fp8-dynamic, the per-rank scales.
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from cublade.numerics.fp8 import dynamic_scale, fp8_dequant, fp8_quant_weight, quantize_per_tensor, quantize_per_token

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
ROW_PARALLEL = ("o_proj", "down_proj")


class SimLinear(torch.nn.Module):
    """A projection with a scheme's numerics at TP = self.tp (row-parallel layers split K between the ranks), in
    cublade's FP8 math (cublade.numerics.fp8): weights per channel, activations per token or with one static scale."""

    def __init__(self, weight: torch.Tensor, scheme: str, row_parallel: bool):
        super().__init__()
        self.scheme, self.row_parallel, self.tp = scheme, row_parallel, 1
        self.w = weight.float() if scheme == "bf16" else fp8_dequant(*fp8_quant_weight(weight))
        self.input_amax = torch.zeros(())  # fp8-static: the calibration's abs-max
        self.calibrating = False

    def quant(self, x: torch.Tensor) -> torch.Tensor:
        """The activations as the layer's GEMM sees them (quantized and scaled back)."""
        if self.scheme == "bf16":
            return x
        if self.scheme == "fp8-static":
            return fp8_dequant(*quantize_per_tensor(x, dynamic_scale(self.input_amax)))
        return fp8_dequant(*quantize_per_token(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.calibrating:
            self.input_amax = torch.maximum(self.input_amax, x.abs().amax())
        if self.tp == 1 or not self.row_parallel:
            return (self.quant(x) @ self.w.T).to(torch.bfloat16)
        k = x.shape[-1] // self.tp
        parts = [(self.quant(x[..., r * k:(r + 1) * k]) @ self.w[:, r * k:(r + 1) * k].T).to(torch.bfloat16)
                 for r in range(self.tp)]
        return torch.stack(parts).float().sum(0).to(torch.bfloat16)


def load(src: Path, scheme: str):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(src, torch_dtype=torch.bfloat16).eval()
    sims = []
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    sim = SimLinear(child.weight.data, scheme, name in ROW_PARALLEL)
                    setattr(parent, name, sim)
                    sims.append(sim)
    return model, sims


def logprobs(model, ids: torch.Tensor, last: int = 0) -> torch.Tensor:
    """Log-probabilities at every position of ids (at the last `last` ones when given)."""
    with torch.no_grad():
        return F.log_softmax(model(ids[None], logits_to_keep=last).logits[0].float(), dim=-1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size simulated (default 2)")
    p.add_argument("--prompts", type=int, default=8, help="openings of the evaluation text's sentences (default 8)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    p.add_argument("--schemes", default="bf16,fp8-static,fp8-dynamic", help="comma-separated, of the default's")
    args = p.parse_args()
    unknown = set(args.schemes.split(",")) - {"bf16", "fp8-static", "fp8-dynamic"}
    if unknown or args.tp < 2:
        p.error(f"--schemes: unknown {sorted(unknown)}" if unknown else "--tp: 2 or more")
    from bench_e2e import make_source
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(REPO / "fixtures" / "models" / "stories260K-hf")
    text = (REPO / "fixtures" / "data" / "tinystories_valid_head30k.txt").read_text()
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", text) if len(s.split()) > 8]
    prompts = [tok(" ".join(s.split()[:6]), return_tensors="pt").input_ids[0] for s in sentences[:args.prompts]]
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "src"
        make_source(src, 2, shape="8b")
        print(f"| scheme | TP = 1 token ranked first at TP = {args.tp} | mean abs logprob difference | max |")
        print("|---|---:|---:|---:|")
        for scheme in args.schemes.split(","):
            model, sims = load(src, scheme)
            for s in sims:
                s.calibrating = scheme == "fp8-static"
            for ids in prompts:  # calibration pass (fp8-static) on the prompts themselves
                logprobs(model, ids, last=1)
            for s in sims:
                s.calibrating = False
            rank1, diffs = [], []
            for ids in prompts:
                seq = ids
                for _ in range(args.new_tokens):  # greedy at TP = 1, full recompute (no cache)
                    seq = torch.cat([seq, logprobs(model, seq, last=1)[-1].argmax()[None]])
                new = seq[len(ids):]
                ref = logprobs(model, seq, last=len(new) + 1)[:-1]
                for s in sims:
                    s.tp = args.tp
                got = logprobs(model, seq, last=len(new) + 1)[:-1]
                for s in sims:
                    s.tp = 1
                rank1 += (got.argmax(-1) == new).tolist()
                diffs += (ref.gather(1, new[:, None]) - got.gather(1, new[:, None])).abs().flatten().tolist()
            print(f"| {scheme} | {sum(rank1) / len(rank1):.1%} | {sum(diffs) / len(diffs):.4f} | {max(diffs):.3f} |",
                  flush=True)
            del model, sims


if __name__ == "__main__":
    main()
