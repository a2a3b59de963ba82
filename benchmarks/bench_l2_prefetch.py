"""A decode step's linear layers back to back, with and without CUBLADE_L2_PREFETCH (cublade.vllm.kernels.prefetch:
after its GEMM each layer asks L2 for the head of the next layer's weight), every kernel class in the same run.

--layers Llama-3-8B layers (qkv 4096x6144, o 4096x4096, gate_up 4096x28672, down 14336x4096), each with its own
random weights, run through the product's kernel classes on stand-in layers, linked in step order as the plugin links
them. The kernels a step runs between the GEMMs, which read little at few tokens, are stood in by spin kernels of the
lengths a B = 1 step's profile gives them (--gaps, us: before qkv the RMSNorm and quantization, before o RoPE, the KV
write and attention, before gate_up the residual add and RMSNorm, before down SiLU-and-mul). Each configuration is
captured as one CUDA graph and replayed; the weights are many times the L2, so every replay reads them from HBM as a
step does.

    python benchmarks/bench_l2_prefetch.py [--m 1,4,16] [--mib 0,1,8,16,24,32] [--layers 16] [--gaps 2.5,12,2.5,2.5]

Rows: per kernel class and token count M, us per decoder layer (GEMMs and spins) at each prefetch size (0: off;
1 MiB: about what the prefetch's extra kernel launch alone costs), the spins alone, and x = the time without
prefetch / with it (> 1: prefetching is faster). Kernel classes that cannot run here are listed with their reason."""
from __future__ import annotations

import argparse
import os
import statistics
from unittest.mock import patch

import torch

from common import graphed, stand_in_layer, versions, vllm_single_process_state, write_json

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # K x N
CLASSES = {  # kernel class -> (scheme kind, environment it needs)
    "vllm-cutlass-scaled-mm": ("fp8", {}),
    "cublade-fp8-gemm": ("fp8", {"CUBLADE_FP8_GEMM": "1"}),
    "cublade-w4a16-gemm": ("w4a16", {}),
}


def tensors(kind: str, N: int, K: int) -> dict[str, torch.Tensor]:
    """Random tensors in cublade's checkpoint layout, made on the GPU (values do not change the time)."""
    if kind == "fp8":
        w = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 50).to(torch.float8_e4m3fn)
        return {"weight": w, "weight_scale": torch.full((N,), 1e-3, device="cuda")}
    packed = torch.randint(-2**31, 2**31 - 1, (N, K // 8), device="cuda", dtype=torch.int32)
    return {"weight_packed": packed, "weight_scale": torch.full((N, K // 128), 1e-2, device="cuda",
                                                                 dtype=torch.bfloat16)}


def replay_us(step, reps: int = 20) -> float:
    """Median time of one replay of step()'s kernels captured as a CUDA graph (common.graphed), CUDA events around it."""
    replay = graphed(step)
    replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def spin_cycles_per_us() -> float:
    """SM clock cycles per microsecond of torch.cuda._sleep."""
    cycles = 2_000_000
    return cycles / replay_us(lambda: torch.cuda._sleep(cycles), reps=5)


def build(cls, kind: str, scheme, n_layers: int, spins: list[int]):
    """([(stand-in layer, its kernel, spin cycles before it)] in step order, None), or (None, why the class cannot run
    here)."""
    layers = []
    for _ in range(n_layers):
        for (K, N), cycles in zip(SHAPES.values(), spins):
            lay = stand_in_layer(tensors(kind, N, K), scheme, N, K)
            ok, why = cls.can_implement(lay)
            if not ok:
                return None, why
            layers.append((lay, cls(lay), cycles))
    return layers, None


def measure(name: str, layers: list, M: int, mibs: list[int], prefetch) -> dict:
    """The step at M tokens, linked for each prefetch size, and the spins alone: us per decoder layer."""
    xs = {K: torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for K, _ in SHAPES.values()}

    def step():
        for lay, k, cycles in layers:
            torch.cuda._sleep(cycles)
            k.apply(lay, xs[lay.input_size_per_partition], None)

    n = len(layers) // len(SHAPES)
    row = {"kernel": name, "M": M, "layers": n, "us_per_layer": {}}
    for mib in mibs:
        prefetch._names.clear()
        prefetch._next.clear()
        prefetch._last[0] = None
        for i, (lay, k, _) in enumerate(layers):
            k.prefetch_name = ""
            prefetch.link(lay, f"bench.{i}", k, mib=mib)
        row["us_per_layer"][mib] = replay_us(step) / n
    row["spins_us_per_layer"] = replay_us(lambda: [torch.cuda._sleep(c) for _, _, c in layers]) / n
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", default="1,4,16", help="token counts")
    p.add_argument("--mib", default="0,1,8,16,24,32",
                   help="prefetch sizes in MiB (0: off; 1: about what the extra launch alone costs)")
    p.add_argument("--layers", type=int, default=16, help="decoder layers (each its own weights)")
    p.add_argument("--gaps", default="2.5,12,2.5,2.5", help="us of spin before qkv, o, gate_up, down")
    p.add_argument("--json", help="write the rows to this file")
    a = p.parse_args()
    Ms = [int(v) for v in a.m.split(",")]
    mibs = [int(v) for v in a.mib.split(",")]
    gaps = [float(v) for v in a.gaps.split(",")]
    vllm_single_process_state()
    from cublade.config import Fp8Scheme, W4A16Scheme
    from cublade.vllm.kernels import CANDIDATES, prefetch

    info = versions()
    print(f"GPU {info['gpu']}, torch {info['torch']}, L2 {torch.cuda.get_device_properties(0).L2_cache_size >> 20} MiB")
    per_us = spin_cycles_per_us()
    spins = [int(g * per_us) for g in gaps]
    print(f"{a.layers} Llama-3-8B layers, spins before qkv / o / gate_up / down: {a.gaps} us ({per_us:.0f} cycles/us)")
    rows, skipped = [], {}
    for name, (kind, env) in CLASSES.items():
        scheme = Fp8Scheme("channel", "dynamic-token") if kind == "fp8" else W4A16Scheme(128, True)
        cls = next(c for c in CANDIDATES[type(scheme)] if c.name == name)
        with patch.dict(os.environ, env):
            layers, why = build(cls, kind, scheme, a.layers, spins)
        if layers is None:
            skipped[name] = why
            continue
        rows += [measure(name, layers, M, mibs, prefetch) for M in Ms]
        del layers
        torch.cuda.empty_cache()
    for name, why in skipped.items():
        print(f"not run: {name}: {why}")
    head = "".join(f" | {m} MiB" if m else " | off" for m in mibs)
    print(f"\nus per decoder layer (its 4 GEMMs and the spins before them; x = off / with)\n| kernel | M{head} | "
          f"spins alone | best x |")
    print("|---|---:|" + "---:|" * (len(mibs) + 2))
    for r in rows:
        t = r["us_per_layer"]
        off = t[mibs[0]] if mibs[0] == 0 else None
        cells = "".join(f" | {t[m]:.1f}" + (f" ({off / t[m]:.3f}x)" if off and m else "") for m in mibs)
        best = max((off / t[m] for m in mibs if m), default=None) if off else None
        print(f"| {r['kernel']} | M={r['M']}{cells} | {r['spins_us_per_layer']:.1f} | "
              f"{'' if best is None else f'{best:.3f}x'} |")
    write_json(a.json, rows, not_run=skipped, gaps_us=gaps)


if __name__ == "__main__":
    main()
