"""`cublade convert`'s peak memory as `/usr/bin/time` reports it: the converter's whole resident set (VmHWM,
file-backed pages included), measured in a fresh interpreter, against a bound in source / output shard sizes."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "fixtures" / "models" / "stories260K-hf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def synthetic_llama_shards(out: Path, *, hidden: int, intermediate: int, n_layers: int, n_shards: int,
                           vocab: int = 512, kv_heads: int = 4, head_dim: int = 64, dtype=torch.float32,
                           experts: int = 0, fused: bool = False, seed: int = 0) -> Path:
    """A runnable Llama checkpoint of random weights (a Mixtral with `experts` > 0: per-expert tensors, or fused
    3-D ones with `fused`), its layers split evenly over `n_shards` safetensors files (embeddings in the first,
    final norm and untied lm_head in the last), with the bundled model's tokenizer so calibration can run on it.
    One random tensor per shape, scaled per layer: seconds for a GiB."""
    assert n_layers % n_shards == 0 and hidden % head_dim == 0
    g = torch.Generator().manual_seed(seed)
    base: dict[tuple[int, ...], torch.Tensor] = {}

    def rand(shape, layer):
        if shape not in base:
            base[shape] = torch.empty(shape, dtype=torch.float32).normal_(0, 0.02, generator=g).to(dtype)
        return base[shape] * (1 + 0.01 * layer)

    kv = kv_heads * head_dim
    per = n_layers // n_shards
    shards = []
    for s in range(n_shards):
        t = {}
        if s == 0:
            t["model.embed_tokens.weight"] = rand((vocab, hidden), -1)
        for layer in range(s * per, (s + 1) * per):
            p = f"model.layers.{layer}"
            for name, shape in (("q_proj", (hidden, hidden)), ("k_proj", (kv, hidden)), ("v_proj", (kv, hidden)),
                                ("o_proj", (hidden, hidden))):
                t[f"{p}.self_attn.{name}.weight"] = rand(shape, layer)
            t[f"{p}.input_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
            t[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
            if not experts:
                for name, shape in (("gate_proj", (intermediate, hidden)), ("up_proj", (intermediate, hidden)),
                                    ("down_proj", (hidden, intermediate))):
                    t[f"{p}.mlp.{name}.weight"] = rand(shape, layer)
            elif fused:
                t[f"{p}.mlp.gate.weight"] = rand((experts, hidden), layer)
                t[f"{p}.mlp.experts.gate_up_proj"] = rand((experts, 2 * intermediate, hidden), layer)
                t[f"{p}.mlp.experts.down_proj"] = rand((experts, hidden, intermediate), layer)
            else:
                t[f"{p}.block_sparse_moe.gate.weight"] = rand((experts, hidden), layer)
                for e in range(experts):
                    for name, shape in (("w1", (intermediate, hidden)), ("w3", (intermediate, hidden)),
                                        ("w2", (hidden, intermediate))):
                        t[f"{p}.block_sparse_moe.experts.{e}.{name}.weight"] = rand(shape, layer + e)
        if s == n_shards - 1:
            t["model.norm.weight"] = torch.ones(hidden, dtype=dtype)
            t["lm_head.weight"] = rand((vocab, hidden), -2)
        shards.append(t)

    out.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["MixtralForCausalLM" if experts else "LlamaForCausalLM"],
           "model_type": "mixtral" if experts else "llama", "vocab_size": vocab, "hidden_size": hidden,
           "intermediate_size": intermediate, "num_hidden_layers": n_layers, "num_attention_heads": hidden // head_dim,
           "num_key_value_heads": kv_heads, "head_dim": head_dim, "max_position_embeddings": 512,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
           "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": str(dtype).removeprefix("torch.")}
    if experts:
        cfg.update({"num_local_experts": experts, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.0,
                    "output_router_logits": False, "sliding_window": None})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in TOKENIZER_FILES:
        shutil.copy(TOKENIZER / f, out / f)
    weight_map = {}
    for i, tensors in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{n_shards:05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


PEAK_SCRIPT = r"""
import sys
from cublade.cli import main
rc = main(sys.argv[1:])
print(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1])  # kB
sys.exit(rc)
"""


def convert_peak_rss(src: Path, out: Path, *args) -> tuple[int, float]:
    """(peak RSS in bytes, wall seconds) of `cublade convert src out *args` in a fresh interpreter: its VmHWM,
    the high-water mark of its whole resident set, file-backed pages included (what /usr/bin/time reports)."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, "convert", str(src), str(out), *map(str, args)],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.split()[-1]) * 1024, time.perf_counter() - t0


@pytest.fixture(scope="module")
def four_shard_model(tmp_path_factory) -> Path:
    """4 shards of 306 MiB (fp32 Llama, hidden 1024, intermediate 5632, 16 layers): 317M parameters."""
    return synthetic_llama_shards(tmp_path_factory.mktemp("mem") / "src", hidden=1024, intermediate=5632,
                                  n_layers=16, n_shards=4)


@pytest.fixture(scope="module")
def four_shard_moe(tmp_path_factory) -> Path:
    """4 shards of 306 MiB (fp32 Mixtral, hidden 1024, 4 experts of intermediate 1408, 16 layers)."""
    return synthetic_llama_shards(tmp_path_factory.mktemp("mem-moe") / "src", hidden=1024, intermediate=1408,
                                  n_layers=16, n_shards=4, experts=4)


# Every preset that needs no calibration (fp4-experts-fp8-dense on the Mixtral); measured peaks in the test's
# docstring.
PRESETS = ["fp8-dynamic", "w4a16", "mxfp8", "fp4-experts-fp8-dense"]


@pytest.mark.parametrize("scheme", PRESETS)
def test_peak_rss_stays_within_one_and_a_half_shards(request, scheme, tmp_path):
    """Peak RSS of a whole `cublade convert` run, interpreter and torch included, file-backed pages included,
    is at most 1.5 x the larger of the largest source shard and the output shard size (--max-shard-size).

    The converter reads each source tensor through a mapping of its own bytes (unmapped with the tensor, so no
    shard stays mapped) and writes each output tensor to its place in its shard file as it is produced (no output
    shard is held in memory): what it holds is the interpreter and torch, one source tensor and its quantization's
    temporaries (int4 and FP8 quantization work in place on one fp32 copy of the weight). Measured here (4 x 306
    MiB fp32 source shards, 64 MiB output shards, bound 459 MiB), on a 2-core CPU machine shared with other jobs:
    fp8-dynamic 297-391 MiB, w4a16 297-361 MiB (asymmetric g32: 361-364 MiB), mxfp8 313-376 MiB,
    fp4-experts-fp8-dense 275-281 MiB (on the Mixtral); the same run varies by up to 100 MiB with the other jobs on the
    machine. A run takes 7-8 s on an idle machine (the file 39 s) and up to 220 s on a loaded one."""
    src = request.getfixturevalue("four_shard_moe" if scheme == "fp4-experts-fp8-dense" else "four_shard_model")
    max_shard = 64 * 2**20
    peak, wall = convert_peak_rss(src, tmp_path / "out", "--scheme", scheme, "--max-shard-size", max_shard)
    largest = max(f.stat().st_size for f in src.glob("*.safetensors"))
    bound = 1.5 * max(largest, max_shard)
    mib = 2**20
    print(f"\n{scheme}: peak RSS {peak / mib:.0f} MiB, bound {bound / mib:.0f} MiB (largest source "
          f"shard {largest / mib:.0f} MiB, output shards of {max_shard / mib:.0f} MiB), {wall:.1f} s")
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 1  # several output shards were written
    assert peak <= bound, f"peak RSS {peak / mib:.0f} MiB > {bound / mib:.0f} MiB"


if __name__ == "__main__":  # python tests/test_convert_memory.py OUT [key=value ...]: a model for measurements
    kw = {}
    for a in sys.argv[2:]:
        k, v = a.split("=")
        kw[k] = getattr(torch, v) if k == "dtype" else (v == "1" if k == "fused" else int(v))
    t0 = time.time()
    synthetic_llama_shards(Path(sys.argv[1]), **kw)
    print(f"{sys.argv[1]}: {time.time() - t0:.1f} s")
