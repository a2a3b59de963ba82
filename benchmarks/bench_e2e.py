"""End-to-end decode speed in vLLM: cublade's checkpoints against vLLM's own quantization of the same model.

The model is a Llama-3-8B-shaped Llama (hidden 4096, MLP 14336, 32 heads / 8 KV heads, vocab 128256) with random
weights (no real 8B checkpoint is reachable from the GPU machine; decode time does not depend on the weights'
values, and every request generates exactly --steps tokens with ignore_eos). Configurations:

    bf16                  the source checkpoint, unquantized
    vllm-fp8              the source with vLLM's online `--quantization fp8_per_channel` (per-channel weights,
                          dynamic per-token activations: the scheme of cublade's fp8-dynamic)
    vllm-fp8-quant-op     the same with vLLM's quantization as its CUDA op (`-cc.custom_ops+=+quant_fp8`), which turns
                          on vLLM's RMSNorm + quant fusion pass (its fused CUDA kernel instead of Inductor's)
    cublade-fp8           `cublade convert SRC OUT --scheme fp8-dynamic` (RMSNorm + quantization fused by cublade's pass)
    cublade-fp8-unfused   the same with CUBLADE_FUSE_NORM_QUANT=0 (Inductor's norm, then cublade's quantization)
    cublade-fp8-fuse      the same with CUBLADE_FP8_FUSE=1 (under torch.compile the activation quantization in torch
                          ops, for Inductor to fuse with RMSNorm / SiLU-and-mul)
    cublade-fp8-gemm      the same with CUBLADE_FP8_GEMM=1 (cublade's FP8 decode GEMM up to 16 tokens, CUTLASS above)
    cublade-fp8-gemm-bf16  the same on its bf16 decode (CUBLADE_FP8_GEMM_VALUES=bf16; the default decodes to fp16)
    cublade-fp8-wgmma     the same with CUBLADE_FP8_WGMMA=1 (cublade's wgmma GEMM at the token counts where it
                          measured faster than CUTLASS at load); cublade-fp8-wgmma-lm-head on the FP8-lm_head
                          checkpoint, cublade-fp8-wgmma-static on the static one (--quantization cublade)
    vllm-mxfp8            the source with vLLM's online `--quantization mxfp8`
    vllm-mxfp8-humming    the same on vLLM's Humming MXFP8 kernel (every earlier MXFP8 kernel disabled; needs the
                          humming-kernels package)
    cublade-mxfp8         `cublade convert ... --scheme mxfp8`
    cublade-mxfp8-measured  the same checkpoint with CUBLADE_MXFP8_PREFILL=humming (vLLM's Humming at the token counts
                          where it measured faster at load, from a copy of the weights)
    vllm-w4a16            cublade's w4a16 checkpoint relabelled as compressed-tensors pack-quantized (the same
                          tensors: cublade writes that layout), served by vLLM's own WNA16 method (Machete on
                          Hopper; `VLLM_DISABLED_KERNELS=MacheteLinearKernel` gives Marlin)
    vllm-w4a16-humming    the same, on vLLM's Humming kernel (every earlier WNA16 kernel disabled; needs the
                          humming-kernels package)
    cublade-w4a16         `cublade convert ... --scheme w4a16` (RTN, group 128, symmetric)
    cublade-w4a16-fp8     the same checkpoint with CUBLADE_W4A16_PREFILL=fp8 (batches of 512 tokens or more on
                          FP8 tensor cores, activations rounded to E4M3 per 1 x 128)
    cublade-w4a16-machete, -humming, -measured
                          the same checkpoint with CUBLADE_W4A16_PREFILL=machete, humming, machete,humming (the
                          named vLLM kernels at the token counts where they measured faster at load)
    cublade-w4a16-measured-fp8  the same with CUBLADE_W4A16_PREFILL=fp8,machete,humming (cublade's FP8 tensor-core
                          path timed too, and run where it measured fastest)
    cublade-fp8-lm-head, cublade-fp8-gemm-lm-head, cublade-w4a16-lm-head, cublade-w4a16-measured-lm-head
                          the checkpoints converted with --quantize-lm-head (make's `-lm-head` presets); the second
                          with CUBLADE_FP8_GEMM=1, the last with CUBLADE_W4A16_PREFILL=machete,humming
    vllm-fp8-static       make's `fp8-static`: the source converted to FP8 (per-channel weights) in compressed-tensors'
                          format, its activations relabelled static per tensor with an input_scale of INPUT_SCALE in
                          every layer (no calibration: a step's time does not depend on the scales' values), served
                          by vLLM's own compressed-tensors method (its static FP8 quantization, fusions, CUTLASS)
    cublade-fp8-static    the same checkpoint with --quantization cublade (cublade's static fp8 layers)
    cublade-fp8-lm-head-unfused, cublade-fp8-static-unfused  those with CUBLADE_FUSE_NORM_QUANT=0
    cublade-fp8-kv-vllm   cublade-fp8 with an FP8 KV cache (k_scale = v_scale = KV_SCALE in every layer: the
                          step's time does not depend on them), K rounded to nearest, vLLM's FlashAttention and
                          its own cache write
    cublade-fp8-kv        the same under --attention-backend CUSTOM: the cache written by cublade's op
    cublade-fp8-kv-qa     the same checkpoint with `rounding: query-aware`, under CUSTOM: K rounded query-aware

Each configuration runs in a process of its own (one vLLM engine, CUDA graphs at the measured batch sizes). A
decode step's time is (time of a generate of 1 + S tokens - time of a generate of 1 token) / S for B requests
of P prompt tokens each, the median of --reps pairs; tokens/s = B / step. "prompts ms" is the 1-token generate
(the B prompts' prefill and one step; batches of prompt tokens are not CUDA-graphed, so at B = 1 it is mostly
host time). Request 0's first 16 tokens go into the JSON only: with random weights the top logits are close, so
kernels of different rounding part ways within a few tokens even on the same quantized tensors.

    python benchmarks/bench_e2e.py make WORKDIR [--shape 8b|70b] [--layers N] [--presets w4a16,...]   # (CPU ok)
    python benchmarks/bench_e2e.py run WORKDIR [CONFIG ...] [--batches 1,16,64] [--tensor-parallel-size N] [--json FILE]
    python benchmarks/bench_e2e.py profile WORKDIR [CONFIG ...] [--batches 1] [--steps 32] [--prefill]
    python benchmarks/bench_e2e.py report FILE [FILE ...]   # one table from the --json lines of several runs (CPU ok)

`profile` runs each configuration's engine in-process under torch.profiler (CUDA kernels only, CUDA graphs included)
over a generate of 1 + S tokens and one of 1 token, and prints where a decode step's GPU time goes: the difference of
the two, per kernel and per kind of kernel (cublade's GEMMs, vLLM's and cuBLAS's GEMMs, activation quantization,
attention, Inductor's fused elementwise kernels, ...), each divided by S, next to the step time measured by the same
pairs without the profiler (--reps of them, in the same in-process engine); what the kernels do not cover is time the
GPU waits (launch gaps, host work). On the dense models it also splits the step's GEMM time by projection (qkv_proj,
o_proj, gate_up_proj, down_proj summed over the layers, and lm_head), from the GEMMs' launch order, which CUDA graphs
keep: a kernel that leads on some shapes and trails on others shows where. `profile --prefill` profiles the 1-token
generate instead: the B prompts' forward (B x P tokens, not CUDA-graphed, as a server's prompt chunks run), its wall
time the median of --reps. With --tensor-parallel-size N > 1 the ranks are worker processes: vLLM's own worker profiler
(LLM(profiler_config=...), start_profile / stop_profile) writes each rank's trace, and the kernel times are the mean
over the ranks, next to the engine's step time (a step the kernels cover only partly is host or all-reduce bound: a
kernel's share of it then ranks the kernels where the step time cannot).

--shape 70b makes a Llama-3-70B-shaped model instead (hidden 8192, MLP 28672, 64 heads / 8 KV heads, vocab 128256;
80 layers in the real one: --layers picks how many, e.g. 8 where memory or time asks). --presets limits the
conversions (and the configurations that need them) to those listed. --shape mixtral makes a Mixtral-8x7B-shaped
MoE model (hidden 4096, 8 experts of intermediate 14336, top-2, 32 / 8 heads, vocab 32000) and its
`fp4-experts-fp8-dense` conversion, for the configurations cublade-fp4-moe (FP4 experts on cublade's kernel) and
vllm-marlin-moe (the same checkpoint on vLLM's fused Marlin MoE); `run --enable-expert-parallel` splits the experts
over the GPUs of `--tensor-parallel-size`.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
    "attention_bias": False, "mlp_bias": False,
}
CONFIGS = {  # name -> (checkpoint subdirectory of WORKDIR, vLLM --quantization, extra environment, attention backend)
    "bf16": ("src", None, {}, None),
    "vllm-fp8": ("src", "fp8_per_channel", {}, None),
    "vllm-fp8-quant-op": ("src", "fp8_per_channel", {"BENCH_E2E_CUSTOM_OPS": "+quant_fp8"}, None),
    "cublade-fp8": ("cublade-fp8-dynamic", None, {}, None),
    "cublade-fp8-unfused": ("cublade-fp8-dynamic", None, {"CUBLADE_FUSE_NORM_QUANT": "0"}, None),
    "cublade-fp8-fuse": ("cublade-fp8-dynamic", None, {"CUBLADE_FP8_FUSE": "1"}, None),
    "cublade-fp8-gemm": ("cublade-fp8-dynamic", None, {"CUBLADE_FP8_GEMM": "1"}, None),
    "cublade-fp8-wgmma": ("cublade-fp8-dynamic", None, {"CUBLADE_FP8_WGMMA": "1"}, None),
    "cublade-fp8-wgmma-lm-head": ("cublade-fp8-dynamic-lm-head", None, {"CUBLADE_FP8_WGMMA": "1"}, None),
    "cublade-fp8-wgmma-static": ("ct-fp8-static", "cublade", {"CUBLADE_FP8_WGMMA": "1"}, None),
    "cublade-fp8-gemm-bf16": ("cublade-fp8-dynamic", None, {"CUBLADE_FP8_GEMM": "1", "CUBLADE_FP8_GEMM_VALUES": "bf16"},
                              None),
    "cublade-fp8-lm-head": ("cublade-fp8-dynamic-lm-head", None, {}, None),
    "vllm-fp8-static": ("ct-fp8-static", None, {}, None),
    "cublade-fp8-static": ("ct-fp8-static", "cublade", {}, None),
    "cublade-fp8-lm-head-unfused": ("cublade-fp8-dynamic-lm-head", None, {"CUBLADE_FUSE_NORM_QUANT": "0"}, None),
    "cublade-fp8-static-unfused": ("ct-fp8-static", "cublade", {"CUBLADE_FUSE_NORM_QUANT": "0"}, None),
    "cublade-fp8-gemm-lm-head": ("cublade-fp8-dynamic-lm-head", None, {"CUBLADE_FP8_GEMM": "1"}, None),
    "vllm-mxfp8": ("src", "mxfp8", {}, None),
    "vllm-mxfp8-humming": ("src", "mxfp8", {"VLLM_DISABLED_KERNELS": ",".join(
        f"{k}Mxfp8LinearKernel" for k in ("FlashInferCutedsl", "FlashInferCutlass", "Marlin", "Emulation"))}, None),
    "cublade-mxfp8": ("cublade-mxfp8", None, {}, None),
    "cublade-mxfp8-measured": ("cublade-mxfp8", None, {"CUBLADE_MXFP8_PREFILL": "humming"}, None),
    "vllm-w4a16": ("ct-w4a16", None, {}, None),
    "vllm-w4a16-marlin": ("ct-w4a16", None, {"VLLM_DISABLED_KERNELS": "MacheteLinearKernel"}, None),
    "vllm-w4a16-humming": ("ct-w4a16", None, {"VLLM_DISABLED_KERNELS": ",".join(
        f"{k}LinearKernel" for k in ("CutlassW4A8", "Machete", "AllSpark", "Marlin", "Conch", "Exllama",
                                     "TritonW4A16"))}, None),
    "cublade-w4a16": ("cublade-w4a16", None, {}, None),
    "cublade-w4a16-lm-head": ("cublade-w4a16-lm-head", None, {}, None),
    "cublade-w4a16-fp8": ("cublade-w4a16", None, {"CUBLADE_W4A16_PREFILL": "fp8"}, None),
    "cublade-w4a16-machete": ("cublade-w4a16", None, {"CUBLADE_W4A16_PREFILL": "machete"}, None),
    "cublade-w4a16-humming": ("cublade-w4a16", None, {"CUBLADE_W4A16_PREFILL": "humming"}, None),
    "cublade-w4a16-measured": ("cublade-w4a16", None, {"CUBLADE_W4A16_PREFILL": "machete,humming"}, None),
    "cublade-w4a16-measured-fp8": ("cublade-w4a16", None, {"CUBLADE_W4A16_PREFILL": "fp8,machete,humming"}, None),
    "cublade-w4a16-measured-lm-head": ("cublade-w4a16-lm-head", None, {"CUBLADE_W4A16_PREFILL": "machete,humming"},
                                       None),
    "cublade-fp8-kv-vllm": ("cublade-fp8-kv-nearest", None, {}, None),
    "cublade-fp8-kv": ("cublade-fp8-kv-nearest", None, {}, "CUSTOM"),
    "cublade-fp8-kv-qa": ("cublade-fp8-kv-query-aware", None, {}, "CUSTOM"),
    # the Mixtral-shaped model (make --shape mixtral): FP4 experts on cublade's kernel, or the same checkpoint's
    # experts on vLLM's fused Marlin MoE (cublade's method, its kernel disabled)
    "cublade-fp4-moe": ("cublade-fp4-experts-fp8-dense", None, {}, None),
    "vllm-marlin-moe": ("cublade-fp4-experts-fp8-dense", None, {"CUBLADE_DISABLED_KERNELS": "cublade-fp4-moe"}, None),
}
LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_attention_heads=64)
MIXTRAL_8X7B = dict(LLAMA3_8B, architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000,
                    num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6, max_position_embeddings=32768,
                    bos_token_id=1, eos_token_id=2)
SHAPES = {"8b": LLAMA3_8B, "70b": LLAMA3_70B, "mixtral": MIXTRAL_8X7B}
DENSE_PRESETS, MOE_PRESETS = ("fp8-dynamic", "mxfp8", "w4a16"), ("fp4-experts-fp8-dense",)
LM_HEAD = "-lm-head"  # a preset name with this suffix: the preset, with `--quantize-lm-head`
STATIC = "fp8-static"  # not a conversion of its own: make_ct_fp8_static
PRESETS = DENSE_PRESETS + MOE_PRESETS + ("w4a16" + LM_HEAD, "fp8-dynamic" + LM_HEAD, STATIC)
DEFAULT_PRESETS = {"8b": DENSE_PRESETS, "70b": DENSE_PRESETS, "mixtral": MOE_PRESETS}  # per --shape
KV_SCALE = 0.02  # K and V of these random weights are about N(0, 1.3): abs-max about 9 = 448 * 0.02
INPUT_SCALE = 0.05  # the static FP8 activations' scale in every layer: |x| up to 22.4 = 448 * 0.05


# ---- make: the synthetic source checkpoint and its conversions ------------------------------------------------

def layer_shapes(cfg: dict, i: int) -> dict[str, tuple[int, ...]]:
    h, m, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    p = f"model.layers.{i}."
    shapes = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
              p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
              p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)}
    experts = cfg.get("num_local_experts")
    if experts is None:
        shapes.update({p + "mlp.gate_proj.weight": (m, h), p + "mlp.up_proj.weight": (m, h),
                       p + "mlp.down_proj.weight": (h, m)})
        return shapes
    moe = p + "block_sparse_moe."  # Mixtral's names: the router, then w1 (gate), w2 (down), w3 (up) per expert
    shapes[moe + "gate.weight"] = (experts, h)
    for e in range(experts):
        shapes.update({f"{moe}experts.{e}.w1.weight": (m, h), f"{moe}experts.{e}.w2.weight": (h, m),
                       f"{moe}experts.{e}.w3.weight": (m, h)})
    return shapes


def make_source(out: Path, layers: int, seed: int = 0, shape: str = "8b") -> None:
    """A bf16 Llama checkpoint of `shape` (SHAPES) with N(0, 0.02) matrices and unit norms, one shard per layer."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    cfg = dict(SHAPES[shape], num_hidden_layers=layers)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(dev).manual_seed(seed)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    shards = [{"model.embed_tokens.weight": (v, h)}] + [layer_shapes(cfg, i) for i in range(layers)]
    shards.append({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted run
    tmp.mkdir(parents=True)
    index = {}
    for n, shapes in enumerate(tqdm(shards, desc="source shards", unit="shard")):
        tensors = {}
        for name, shape in shapes.items():
            t = (torch.ones(shape, device=dev) if len(shape) == 1
                 else torch.randn(shape, device=dev, generator=gen).mul_(0.02))
            tensors[name] = t.to(torch.bfloat16).cpu()
        fname = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, fname))
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    tmp.rename(out)


def relabelled(src_dir: Path, out: Path, shard: str, tensors: dict[str, torch.Tensor], cfg: dict) -> None:
    """`out`: the checkpoint `src_dir`'s shards (hard links) plus one shard named `shard` holding `tensors`, in an index
    that names them, under config `cfg`; written in a temporary directory and renamed at the end."""
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted run
    tmp.mkdir(parents=True)
    index = json.loads((src_dir / "model.safetensors.index.json").read_text())
    for fname in sorted(set(index["weight_map"].values())):
        os.link(src_dir / fname, tmp / fname)
    save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(tensors, shard))
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    tmp.rename(out)


def weight_map(d: Path) -> dict[str, str]:
    return json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]


def make_ct_w4a16(cublade_dir: Path, out: Path) -> None:
    """cublade's w4a16 checkpoint relabelled for vLLM's compressed-tensors WNA16 method: the same shards
    (hard links), the config's quantization_config replaced, plus the `weight_shape` tensors that format has."""
    from safetensors import safe_open

    shapes = {}
    for fname in sorted(set(weight_map(cublade_dir).values())):
        with safe_open(str(cublade_dir / fname), "pt") as f:
            for name in f.keys():
                if name.endswith(".weight_packed"):
                    n, k8 = f.get_slice(name).get_shape()
                    shapes[name[: -len("packed")] + "shape"] = torch.tensor([n, k8 * 8], dtype=torch.int64)
    cfg = json.loads((cublade_dir / "config.json").read_text())
    q = cfg["quantization_config"]
    scheme = q["schemes"][q["rules"][0]["scheme"]]
    if scheme.get("group_size") != 128 or not scheme.get("symmetric", True):
        raise SystemExit(f"expected a symmetric group-128 w4a16 checkpoint, got {scheme}")
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True,
            "dynamic": False, "actorder": None}}}}
    relabelled(cublade_dir, out, "weight-shapes.safetensors", shapes, cfg)


def make_fp8_kv(fp8_dir: Path, out: Path, rounding: str) -> None:
    """cublade's fp8-dynamic checkpoint with an FP8 KV cache: the same shards (hard links), a shard of per-layer
    k_scale / v_scale (KV_SCALE), and kv_cache {dtype: fp8, rounding} in the config."""
    cfg = json.loads((fp8_dir / "config.json").read_text())
    scales = {f"model.layers.{i}.self_attn.{n}": torch.tensor(KV_SCALE, dtype=torch.float32)
              for i in range(cfg["num_hidden_layers"]) for n in ("k_scale", "v_scale")}
    cfg["quantization_config"]["kv_cache"] = {"dtype": "fp8", "rounding": rounding}
    relabelled(fp8_dir, out, "kv-scales.safetensors", scales, cfg)


def make_ct_fp8_static(ct_dir: Path, out: Path) -> None:
    """A compressed-tensors FP8 checkpoint (per-channel weights, dynamic per-token activations) relabelled static per
    tensor: the same shards (hard links), input_activations {strategy: tensor, dynamic: false}, and one input_scale
    of INPUT_SCALE for every quantized layer (those with a weight_scale)."""
    cfg = json.loads((ct_dir / "config.json").read_text())
    q = cfg["quantization_config"]
    if q.get("quant_method") != "compressed-tensors":
        raise SystemExit(f"{ct_dir}: expected a compressed-tensors checkpoint, got {q.get('quant_method')!r}")
    for group in q["config_groups"].values():
        a = group.get("input_activations") or {}
        if a.get("type") != "float" or a.get("num_bits") != 8:
            raise SystemExit(f"{ct_dir}: expected FP8 activations, got {a}")
        a.update(strategy="tensor", dynamic=False)
    scales = {name.removesuffix("weight_scale") + "input_scale": torch.tensor([INPUT_SCALE], dtype=torch.float32)
              for name in weight_map(ct_dir) if name.endswith(".weight_scale")}
    relabelled(ct_dir, out, "input-scales.safetensors", scales, cfg)


def cmd_make(args) -> None:
    work = Path(args.workdir)
    src = work / "src"
    if not src.exists():
        t0 = time.perf_counter()
        make_source(src, args.layers, shape=args.shape)
        print(f"source: {src} ({args.shape}, {args.layers} layers) in {time.perf_counter() - t0:.0f} s", flush=True)
    presets = args.presets or DEFAULT_PRESETS[args.shape]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        raise SystemExit(f"--presets: unknown {unknown}; known: {', '.join(PRESETS)}")
    device = ["--quant-device", "cuda"] if torch.cuda.is_available() else []
    for preset in presets:
        out = work / ("ct-fp8-static" if preset == STATIC else f"cublade-{preset}")
        if out.exists():
            continue
        t0 = time.perf_counter()
        if preset == STATIC:
            ct = work / "ct-fp8-dynamic"
            if not ct.exists():
                subprocess.run([sys.executable, "-m", "cublade.cli", "convert", str(src), str(ct), "--scheme",
                                "fp8-dynamic", "--format", "compressed-tensors", *device], check=True)
            make_ct_fp8_static(ct, out)
        else:
            scheme = preset.removesuffix(LM_HEAD)
            subprocess.run([sys.executable, "-m", "cublade.cli", "convert", str(src), str(out), "--scheme", scheme,
                            *(["--quantize-lm-head"] if preset != scheme else []), *device], check=True)
        print(f"{preset}: {out} in {time.perf_counter() - t0:.0f} s", flush=True)
    if "w4a16" in presets and not (work / "ct-w4a16").exists():
        make_ct_w4a16(work / "cublade-w4a16", work / "ct-w4a16")
    for rounding in ("nearest", "query-aware") if "fp8-dynamic" in presets else ():
        if not (work / f"cublade-fp8-kv-{rounding}").exists():
            make_fp8_kv(work / "cublade-fp8-dynamic", work / f"cublade-fp8-kv-{rounding}", rounding)


# ---- run: decode step time per configuration ------------------------------------------------------------------

def measure(model: str, quantization: str | None, batches: list[int], prompt: int, steps: int, reps: int,
            attention_backend: str | None = None, tensor_parallel_size: int = 1, profile: bool = False,
            expert_parallel: bool = False, prefill: bool = False, gpu_memory_utilization: float = 0.5) -> dict:
    """Runs in the configuration's own process: one engine, every batch size. profile: the engine in this process,
    and each batch size's kernel times per step (kernel_profile; prefill: of the prompts' forward) instead of timed
    pairs."""
    extra = {"attention_backend": attention_backend} if attention_backend else {}
    compilation = {"cudagraph_capture_sizes": sorted(set(batches))}
    if os.environ.get("BENCH_E2E_CUSTOM_OPS"):  # a configuration's vLLM custom ops, e.g. +quant_fp8
        compilation["custom_ops"] = os.environ["BENCH_E2E_CUSTOM_OPS"].split(",")
    trace_dir = None
    if profile and tensor_parallel_size > 1:  # the ranks are worker processes: vLLM's worker profiler traces each
        trace_dir = Path(tempfile.mkdtemp(prefix="bench-e2e-traces-"))
        extra["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": str(trace_dir),
                                    "torch_profiler_with_stack": False, "torch_profiler_use_gzip": False,
                                    "torch_profiler_dump_cuda_time_total": False}
    elif profile:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, for torch.profiler
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=model, quantization=quantization, skip_tokenizer_init=True, max_model_len=prompt + steps + 8,
              max_num_seqs=max(batches), gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=False,
              seed=0, tensor_parallel_size=tensor_parallel_size, enable_expert_parallel=expert_parallel,
              compilation_config=compilation, **extra)
    startup = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        prompts = [TokensPrompt(prompt_token_ids=torch.randint(1000, 100000, (prompt,), generator=gen).tolist())
                   for _ in range(b)]

        def timed(n: int) -> tuple[float, list[int]]:
            sp = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False)
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t
            assert all(len(o.outputs[0].token_ids) == n for o in out), "a request stopped early"
            return dt, list(out[0].outputs[0].token_ids)

        first_tokens = timed(steps + 1)[1][:16]  # warm-up
        if profile:
            kernels = None if trace_dir is None else worker_kernels(llm, timed, trace_dir)
            rows.append({"batch": b, "ranks": tensor_parallel_size,
                         **kernel_profile(timed, steps, reps, prefill, kernels)})
            continue
        steps_ms, short_ms = [], []
        for _ in range(reps):
            (long, _), (short, _) = timed(steps + 1), timed(1)
            steps_ms.append((long - short) / steps * 1e3)
            short_ms.append(short * 1e3)
        step = statistics.median(steps_ms)
        rows.append({"batch": b, "step_ms": step, "tok_s": b / step * 1e3, "spread_ms": max(steps_ms) - min(steps_ms),
                     "prefill_ms": statistics.median(short_ms), "first_tokens": first_tokens})
        print(f"  batch {b}: {step:.3f} ms a step, {rows[-1]['prefill_ms']:.1f} ms for the prompts", flush=True)
    return {"startup_s": startup, "rows": rows}


# Kinds of kernels, by a regular expression on the kernel's (demangled) name; the first match wins.
KERNEL_KINDS = (
    ("Inductor / Triton (norms, RoPE, SiLU, and what it fused into them)", r"^triton_"),
    ("cublade GEMM", r"cublade.*(gemm|wide|dequant)"),
    ("cublade quant", r"cublade.*quant|per_token_vec|per_tensor|per_group"),
    ("cublade other", r"cublade"),
    ("all-reduce (tensor parallelism)", r"all_?reduce|cross_device_reduce|nccl"),
    ("attention", r"flash|attn|attention|fmha|paged|reshape_and_cache|cache"),  # FA3 is a cutlass::device_kernel
    ("vLLM CUTLASS GEMM", r"cutlass|sm90_gemm|Gemm"),
    ("cuBLAS GEMM (bf16)", r"nvjet|xmma|gemm|cublas"),
    ("activation quant (vLLM)", r"quant"),
    ("sampling / other", r""),
)


GEMM_KINDS = ("cublade GEMM", "vLLM CUTLASS GEMM", "cuBLAS GEMM (bf16)")
# A dense Llama forward's linear GEMMs, in launch order: these four in each layer, then the lm_head.
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def kernel_kind(name: str) -> str:
    return next(k for k, rx in KERNEL_KINDS if re.search(rx, name, re.IGNORECASE))


def gemms_by_projection(prefill: list[tuple[str, float]], generate: list[tuple[str, float]],
                        steps: int) -> dict | None:
    """GPU time per decode step of each projection's GEMMs ({projection: [us, kernel names]}), from the GEMM launches
    of a 1-token generate (one forward: `prefill`) and of a (1 + steps)-token one (`generate`: that forward and
    `steps` decode forwards), each [(kernel, us)] in launch order: the generate's launches past the prompts' forward
    are the decode forwards', and launch j of each is the same layer's same projection (CUDA graphs replay one
    order). None where a decode forward's launches are not 4 a layer and one lm_head (another model, or a GEMM
    outside the forwards)."""
    decode = generate[len(prefill):]
    p = len(decode) // steps if steps else 0
    if p < 5 or p % 4 != 1 or len(decode) != steps * p:
        return None
    out: dict[str, list] = {}
    for f in range(steps):
        for j, (name, us) in enumerate(decode[f * p:(f + 1) * p]):
            proj = "lm_head" if j == p - 1 else PROJECTIONS[j % 4]
            t = out.setdefault(proj, [0.0, set()])
            t[0] += us / steps
            t[1].add(name[:80])
    return {proj: [us, sorted(names)] for proj, (us, names) in out.items()}


def trace_kernels(path: Path) -> dict[str, list[float]]:
    """Kernel name -> [us, launches] of one Chrome trace written by torch.profiler (empty: no GPU kernels in it)."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    per: dict[str, list[float]] = {}
    for ev in events:
        if ev.get("cat") == "kernel" and ev.get("dur", 0) > 0:
            t = per.setdefault(ev["name"], [0.0, 0.0])
            t[0] += ev["dur"]
            t[1] += 1
    return per


def worker_kernels(llm, timed, trace_dir: Path):
    """kernels(n) -> (seconds, {kernel: [us, launches]}) of a generate of n tokens under vLLM's worker profiler: the
    mean over the traces the ranks wrote for it (one per rank; traces without GPU kernels left out)."""
    def kernels(n: int) -> tuple[float, dict[str, list[float]]]:
        before = set(trace_dir.rglob("*.json*"))
        llm.start_profile()
        try:
            dt = timed(n)[0]
        finally:
            llm.stop_profile()  # returns once every worker has written its trace
        new = sorted(set(trace_dir.rglob("*.json*")) - before)
        ranks = [per for per in map(trace_kernels, new) if per]
        for t in new:
            t.unlink()
        if not ranks:
            raise RuntimeError(f"vLLM's worker profiler wrote no trace with GPU kernels into {trace_dir}")
        mean: dict[str, list[float]] = {}
        for per in ranks:
            for name, (us, calls) in per.items():
                t = mean.setdefault(name, [0.0, 0.0])
                t[0] += us / len(ranks)
                t[1] += calls / len(ranks)
        return dt, mean
    return kernels


def kernel_profile(timed, steps: int, reps: int, prefill: bool = False, kernels=None) -> dict:
    """GPU time per decode step by kernel: torch.profiler over a generate of 1 + steps tokens minus one of 1 token,
    divided by steps. Returns the step time (the median of `reps` such pairs run without the profiler, which
    slows the host), the kernels' sum, the time per kind of kernel and the kernels that take the most. prefill: the
    same of the 1-token generate alone (the prompts' forward and one sampling), its time the median of `reps`.
    kernels(n) -> (seconds, {kernel: [us, launches]}) profiles a generate of n tokens (default: torch.profiler in
    this process; worker_kernels for tensor-parallel ranks)."""
    from torch.profiler import ProfilerActivity, profile

    gemms: dict[int, list[tuple[str, float]]] = {}  # generate length -> its GEMM launches in order (in process)

    def in_process(n: int) -> tuple[float, dict[str, list[float]]]:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            dt = timed(n)[0]
        per: dict[str, list[float]] = {}
        launched = []
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
                t = per.setdefault(ev.name, [0.0, 0.0])
                t[0] += ev.device_time_total  # us
                t[1] += 1
                if kernel_kind(ev.name) in GEMM_KINDS:
                    launched.append((ev.time_range.start, ev.name, ev.device_time_total))
        gemms[n] = [(name, us) for _, name, us in sorted(launched, key=lambda e: e[0])]
        return dt, per

    kernels = kernels or in_process
    if prefill:
        step_s = statistics.median(timed(1)[0] for _ in range(reps))
        long_k, short_k, steps = kernels(1)[1], {}, 1
    else:
        step_s = statistics.median((timed(steps + 1)[0] - timed(1)[0]) / steps for _ in range(reps))
        _, long_k = kernels(steps + 1)
        _, short_k = kernels(1)
    per_step = {}
    for name, (us, calls) in long_k.items():
        s_us, s_calls = short_k.get(name, (0.0, 0.0))
        if us - s_us > 0:
            per_step[name] = ((us - s_us) / steps, (calls - s_calls) / steps)
    kinds: dict[str, float] = {}
    for name, (us, _) in per_step.items():
        kind = kernel_kind(name)
        kinds[kind] = kinds.get(kind, 0.0) + us
    top = sorted(per_step.items(), key=lambda kv: -kv[1][0])[:30]
    out = {"step_ms": step_s * 1e3, "kernels_ms": sum(v[0] for v in per_step.values()) / 1e3,
           "kinds_us": kinds, "top": [(n[:160], us, calls) for n, (us, calls) in top]}
    if not prefill and 1 in gemms and steps + 1 in gemms:
        out["gemms_us"] = gemms_by_projection(gemms[1], gemms[steps + 1], steps)
    return out


def print_profile(name: str, rows: list[dict], prefill: bool = False) -> None:
    for r in rows:
        step_us, kern_us = r["step_ms"] * 1e3, r["kernels_ms"] * 1e3
        what = "the prompts' forward" if prefill else "step"
        ranks = r.get("ranks", 1)
        print(f"\n{name}, B={r['batch']}: {what} {step_us:.0f} us, kernels "
              + (f"(mean of {ranks} ranks) " if ranks > 1 else "")
              + f"{kern_us:.0f} us ({kern_us / step_us:.0%}), GPU idle {step_us - kern_us:.0f} us")
        unit = "us" if prefill else "us per step"
        print(f"| kind | {unit} | % of {what} |\n|---|---:|---:|")
        for kind, us in sorted(r["kinds_us"].items(), key=lambda kv: -kv[1]):
            print(f"| {kind} | {us:.1f} | {us / step_us:.1%} |")
        print(f"| kernel | {unit} | launches{'' if prefill else ' per step'} |\n|---|---:|---:|")
        for kname, us, calls in r["top"]:
            print(f"| `{kname}` | {us:.1f} | {calls:.0f} |")
        if "gemms_us" in r:
            if r["gemms_us"] is None:
                print("(no GEMMs by projection: the forwards' GEMM launches are not 4 a layer and one lm_head)")
                continue
            print(f"| projection | GEMM {unit} | kernels |\n|---|---:|---|")
            for proj, (us, names) in r["gemms_us"].items():
                print(f"| {proj} | {us:.1f} | {', '.join(f'`{n}`' for n in names)} |")


def cmd_measure(args) -> None:
    res = measure(args.model, args.quantization, args.batches, args.prompt, args.steps, args.reps,
                  args.attention_backend, args.tensor_parallel_size, args.profile, args.enable_expert_parallel,
                  args.prefill, args.gpu_memory_utilization)
    Path(args.result).write_text(json.dumps(res))


def cmd_run(args) -> None:
    work = Path(args.workdir)
    names = args.configs or list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_e2e.py run needs a CUDA GPU and vLLM (make runs anywhere)")
    missing = sorted({CONFIGS[n][0] for n in names if not (work / CONFIGS[n][0]).is_dir()})
    if missing:
        raise SystemExit(f"{work}: no {', '.join(missing)}; run `{Path(__file__).name} make {work}` first")
    results = {}
    for name in names:
        sub, quant, env, backend = CONFIGS[name]
        result = work / f"result-{name}.json"
        cmd = [sys.executable, __file__, "measure", str(work / sub), "--result", str(result),
               "--batches", ",".join(map(str, args.batches)), "--prompt", str(args.prompt),
               "--steps", str(args.steps), "--reps", str(args.reps),
               "--gpu-memory-utilization", str(args.gpu_memory_utilization),
               "--tensor-parallel-size", str(args.tensor_parallel_size)] \
            + (["--enable-expert-parallel"] if args.enable_expert_parallel else []) \
            + (["--quantization", quant] if quant else []) + (["--attention-backend", backend] if backend else []) \
            + (["--profile"] if args.cmd == "profile" else []) \
            + (["--prefill"] if getattr(args, "prefill", False) else [])
        log = work / f"log-{name}.txt"
        print(f"{name}: {work / sub}" + (f" --quantization {quant}" if quant else "") +
              (f" --attention-backend {backend}" if backend else "") +
              "".join(f" {k}={v}" for k, v in env.items()) + f" (log {log})", flush=True)
        with open(log, "w") as f:
            r = subprocess.run(cmd, env=dict(os.environ, **env), stdout=f, stderr=subprocess.STDOUT)
        if r.returncode != 0:
            print(f"{name}: FAILED (exit {r.returncode}); last lines of {log}:")
            print("\n".join(log.read_text(errors="replace").splitlines()[-25:]))
            continue
        results[name] = json.loads(result.read_text())
        if args.cmd == "profile":
            print_profile(name, results[name]["rows"], args.prefill)
            continue
        # the kernel choices the engine logged (the load-time timings whole: their figures are the point)
        choices = {line.split("] ", 1)[-1].strip() for line in log.read_text(errors="replace").splitlines()
                   if re.search(r"Using \w+Kernel|cublade: .* run on |cublade: RMSNorm|KV-cache write runs", line)}
        kernels = sorted({t if "measured at load" in t else t[:200] for t in choices})
        for k in kernels:
            print(f"  log: {k}")
        print(f"  startup {results[name]['startup_s']:.0f} s; " + ", ".join(
            f"B={r['batch']} {r['step_ms']:.3f} ms (reps spread {r['spread_ms'] / r['step_ms']:.0%})"
            for r in results[name]["rows"]), flush=True)
        if args.json:  # each configuration's line as it finishes: a run stopped by `timeout` keeps what it measured
            with open(args.json, "a") as f:
                f.write(json.dumps({"configs": {name: results[name]}, "batches": args.batches,
                                    "prompt": args.prompt, "steps": args.steps}) + "\n")
    if args.cmd != "profile":
        report(results, args.batches)


NOISY = 0.05  # a step time whose reps spread (max - min) over this share of their median is flagged in the report


def report(results: dict, batches: list[int]) -> None:
    print("\n| config | " + " | ".join(f"B={b} ms/step (tok/s)" for b in batches) + " | "
          + " | ".join(f"B={b} prompts ms" for b in batches) + " |")
    print("|---|" + "---:|" * 2 * len(batches))
    for name, res in results.items():
        cells = [f"{r['step_ms']:.3f} ({r['tok_s']:.0f})" for r in res["rows"]] + [
            f"{r['prefill_ms']:.1f}" for r in res["rows"]]
        print(f"| {name} | " + " | ".join(cells) + " |")
    noisy = [f"{name} B={r['batch']} ({r['spread_ms']:.3f} ms, {r['spread_ms'] / r['step_ms']:.0%})"
             for name, res in results.items() for r in res["rows"] if r["spread_ms"] > NOISY * r["step_ms"]]
    if noisy:
        print(f"\nreps spread over {NOISY:.0%} of their median (more --reps to settle): " + ", ".join(noisy))
    pairs = [("cublade-fp4-moe", "vllm-marlin-moe"), ("cublade-fp8", "vllm-fp8"), ("cublade-fp8", "cublade-fp8-unfused"),
             ("cublade-fp8-unfused", "vllm-fp8"), ("cublade-fp8-lm-head", "cublade-fp8-lm-head-unfused"),
             ("cublade-fp8-static", "cublade-fp8-static-unfused"), ("cublade-fp8-fuse", "vllm-fp8"),
             ("cublade-fp8-fuse", "cublade-fp8"), ("vllm-fp8-quant-op", "vllm-fp8"),
             ("cublade-fp8", "vllm-fp8-quant-op"),
             ("cublade-fp8-gemm", "cublade-fp8"), ("cublade-fp8-gemm", "vllm-fp8"),
             ("cublade-w4a16-fp8", "cublade-w4a16"), ("cublade-w4a16", "vllm-w4a16-humming"),
             ("cublade-w4a16-machete", "vllm-w4a16"), ("cublade-w4a16-machete", "cublade-w4a16"),
             ("cublade-w4a16-humming", "vllm-w4a16-humming"), ("cublade-w4a16-measured", "vllm-w4a16"),
             ("cublade-w4a16-measured", "vllm-w4a16-humming"), ("cublade-w4a16-measured", "cublade-w4a16"),
             ("cublade-w4a16-measured-fp8", "cublade-w4a16-measured"), ("cublade-w4a16-measured-fp8", "vllm-w4a16"),
             ("cublade-mxfp8", "vllm-mxfp8"), ("cublade-mxfp8", "vllm-mxfp8-humming"),
             ("cublade-mxfp8-measured", "vllm-mxfp8"), ("cublade-mxfp8-measured", "vllm-mxfp8-humming"),
             ("cublade-mxfp8-measured", "cublade-mxfp8"), ("cublade-w4a16", "vllm-w4a16"),
             ("cublade-w4a16", "vllm-w4a16-marlin"), ("cublade-fp8-kv", "cublade-fp8-kv-vllm"),
             ("cublade-fp8-kv-qa", "cublade-fp8-kv-vllm"), ("cublade-fp8-kv-qa", "cublade-fp8-kv"),
             ("cublade-w4a16-lm-head", "cublade-w4a16"), ("cublade-w4a16-lm-head", "vllm-w4a16"),
             ("cublade-fp8-lm-head", "cublade-fp8"), ("cublade-fp8-lm-head", "vllm-fp8"),
             ("cublade-fp8-gemm-bf16", "cublade-fp8-gemm"), ("cublade-fp8-static", "vllm-fp8-static"),
             ("cublade-fp8-gemm-lm-head", "cublade-fp8-lm-head"), ("cublade-fp8-gemm-lm-head", "vllm-fp8"),
             ("cublade-w4a16-measured-lm-head", "cublade-w4a16-measured"),
             ("cublade-w4a16-measured-lm-head", "vllm-w4a16-humming")] + [
                 (n, "bf16") for n in results if n != "bf16"]
    for what, key in (("decode step", "step_ms"), ("the prompts' forward and first step", "prefill_ms")):
        print(f"\nspeed-up, {what} (baseline's time / ours):")
        for ours, base in pairs:
            if ours in results and base in results:
                print(f"  {ours} vs {base}: " + ", ".join(f"B={o['batch']} {b[key] / o[key]:.2f}x" for o, b in
                                                       zip(results[ours]["rows"], results[base]["rows"])))


def cmd_report(args) -> None:
    """The report of `run --json` lines from one or more files, as one run would print it: the configurations of runs
    split over several calls (the device's 10-minute limit holds about four 8B-shaped configurations) in one table
    with their ratios. The lines must share their batch sizes, prompt and steps; a configuration measured twice keeps
    its last line."""
    results: dict = {}
    settings = None
    for path in args.files:
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            d = json.loads(line)
            s = {k: d.get(k) for k in ("batches", "prompt", "steps")}
            if settings is None:
                settings = s
            elif s != settings:
                raise SystemExit(f"{path}:{n}: measured with {s}, the lines before it with {settings}; "
                                 "a report compares runs of the same batches, prompt and steps")
            results.update(d["configs"])
    if not results:
        raise SystemExit(f"no measured configuration in {', '.join(args.files)}")
    report(results, settings["batches"])


def main() -> None:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write the synthetic source checkpoint and its conversions into WORKDIR")
    m.add_argument("workdir")
    m.add_argument("--layers", type=int, default=32, help="decoder layers (Llama-3-8B has 32, -70B 80)")
    m.add_argument("--shape", choices=sorted(SHAPES), default="8b",
                   help="Llama-3-8B (default) or -70B shapes, or Mixtral-8x7B's (8 experts, top-2)")
    m.add_argument("--presets", type=lambda v: [x for x in v.split(",") if x], default=None,
                   help=f"conversions to make (of {','.join(PRESETS)}; default: the shape's, fp4-experts-fp8-dense "
                        f"for mixtral, the others for the Llama shapes)")
    r = sub.add_parser("run", help="time decode steps for each configuration (default: all)")
    pr = sub.add_parser("profile", help="GPU time of a decode step by kernel, for each configuration")
    for q in (r, pr):
        q.add_argument("workdir")
        q.add_argument("configs", nargs="*", help=", ".join(CONFIGS))
        q.add_argument("--json", help="append the results as one JSON line to this file")
    for q in (r, pr, me := sub.add_parser("measure", help="(internal) one configuration, in its own process")):
        batches, steps = ([1], 32) if q is pr else ([1, 16, 64], 128)
        q.add_argument("--batches", type=ints, default=batches,
                       help=f"concurrent requests (default {','.join(map(str, batches))})")
        q.add_argument("--prompt", type=int, default=128, help="prompt tokens per request (default 128)")
        q.add_argument("--steps", type=int, default=steps, help=f"decode steps timed (default {steps})")
        q.add_argument("--reps", type=int, default=3, help="timed pairs per batch size; the median is kept")
        q.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per engine (vLLM's TP size)")
        q.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                       help="vLLM's share of each GPU's memory (default 0.5; more for weights that need it)")
        q.add_argument("--enable-expert-parallel", action="store_true",
                       help="MoE experts split over the GPUs instead of sharded (vLLM's expert parallelism)")
    me.add_argument("model")
    me.add_argument("--quantization")
    me.add_argument("--attention-backend")
    me.add_argument("--result", required=True)
    me.add_argument("--profile", action="store_true", help="kernel times per step (the profile command)")
    for q in (pr, me):
        q.add_argument("--prefill", action="store_true",
                       help="profile the prompts' forward (B x --prompt tokens) instead of a decode step")
    rp = sub.add_parser("report", help="one table and its ratios from the --json lines of one or more runs")
    rp.add_argument("files", nargs="+", help="files `run --json` appended to (same batches, prompt and steps)")
    args = p.parse_args()
    {"make": cmd_make, "run": cmd_run, "profile": cmd_run, "measure": cmd_measure, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
