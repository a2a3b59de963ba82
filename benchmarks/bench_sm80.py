"""Benchmark cublade's kernels for Ampere / Ada (cublade._C_sm80) against vLLM's Marlin — the kernels each scheme runs
on sm_80 / 86 / 89 — on the GPU at hand, in the same run. On a Hopper card this is a proxy: cublade's kernels run
through the driver's compilation of their compute_80 PTX and Marlin through its own build; real Ampere / Ada speed
is not measured by it. Each pair is built as the product builds it (the kernel classes of cublade.vllm.kernels on a
stand-in layer holding the checkpoint's tensors, timed through `apply`):

    w4a16 (int4, group 128, symmetric)      cublade-w4a16-gemm-sm80  vs  vllm-marlin
    fp8 (e4m3, per-channel scale) as W8A16  cublade-fp8-w8a16        vs  vllm-marlin-fp8
    mxfp8 (e4m3 + E8M0 per 32)              cublade-mxfp8-gemm-sm80  vs  vllm-marlin-mxfp8

plus a bf16 linear of the same (dequantized) weight. bf16 activations.

    python benchmarks/bench_sm80.py [--shapes 4096x14336,14336x4096,8192x28672] [--m 1,4,8,16,32,48,64,256]
                                    [--formats w4a16,fp8,mxfp8] [--tiles-sweep] [--json FILE]

Times: median of triton.testing.do_bench (L2 cleared before every call: the weights come from HBM). x = Marlin's
time / cublade's (above 1: cublade faster). From 64 tokens cublade's sm_80 ops dequantize the weight and run cuBLAS.
--tiles-sweep also times cublade's kernel alone (kernel_only) with 1, 2 and 4 weight tiles per CTA below 64 tokens
(4 only up to 8 tokens for the 1-byte formats), next to the launcher's own choice: the measurement its rule needs.
A kernel that cannot run here (no vLLM, no extension) is reported with its reason and left out.
"""
from __future__ import annotations

import argparse
import functools
import json

import torch

from common import bench_us, rel_err, stand_in_layer, vllm_single_process_state, write_json

bench = functools.partial(bench_us, rep_ms=100)
PAIRS = {"w4a16": ("cublade-w4a16-gemm-sm80", "vllm-marlin"),
         "fp8": ("cublade-fp8-w8a16", "vllm-marlin-fp8"),
         "mxfp8": ("cublade-mxfp8-gemm-sm80", "vllm-marlin-mxfp8")}


def scheme_of(fmt: str):
    from cublade.config import Fp8Scheme, MXFP8Scheme, W4A16Scheme

    return {"w4a16": lambda: W4A16Scheme(group_size=128, symmetric=True),
            "fp8": lambda: Fp8Scheme("channel", "dynamic-token"),
            "mxfp8": MXFP8Scheme}[fmt]()


def checkpoint(fmt: str, N: int, K: int) -> tuple[dict, torch.Tensor]:
    """The scheme's checkpoint tensors of a random weight (on the GPU), and the fp32 weight they dequantize to."""
    scheme = scheme_of(fmt)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g) * 0.02
    t = scheme.quantize(w)
    return {k: v.cuda() for k, v in t.items()}, scheme.dequantize(t).float().cuda()


def kernel_fn(fmt: str, name: str, t: dict, N: int, K: int):
    """(fn(x), None, the layer as the class left it) for kernel class `name` on the tensors, or (None, why it cannot
    run here, None)."""
    from cublade.vllm import kernels

    cls = next(k for k in kernels.CANDIDATES[type(scheme_of(fmt))] if k.name == name)
    if not cls.own:
        try:
            vllm_single_process_state()
        except ImportError as e:
            return None, f"vLLM not importable ({e})", None
    layer = stand_in_layer(t, scheme_of(fmt), N, K)
    ok, why = cls.can_implement(layer)
    if not ok:
        return None, why, None
    impl = cls(layer)
    return functools.partial(impl.apply, layer, bias=None), None, layer


def kernel_tiles_fn(fmt: str, layer: torch.nn.Module, N: int):
    """fn(x, tiles) running cublade's sm_80 kernel alone with `tiles` tiles per CTA, on the blob (and fp8's row
    scale) its kernel class made of the layer."""
    if fmt == "w4a16":
        return lambda x, tiles: torch.ops.cublade.w4a16_gemm_sm80(x, layer.weight_packed, 128, True, N, True, tiles)
    rs = layer.weight_scale if fmt == "fp8" else None  # mxfp8: the scales are in the blob's records
    return lambda x, tiles: torch.ops.cublade.mxfp8_gemm_sm80(x, layer.weight, rs, N, True, tiles)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x14336,14336x4096,8192x28672", help="KxN list")
    ap.add_argument("--m", default="1,4,8,16,32,48,64,256", help="token counts")
    ap.add_argument("--formats", default=",".join(PAIRS), help="subset of " + ", ".join(PAIRS))
    ap.add_argument("--tiles-sweep", action="store_true", help="also time the kernel alone per tiles per CTA")
    ap.add_argument("--json", default=None, help="write all rows here")
    args = ap.parse_args()

    dev = torch.device("cuda")
    rows, why_not = [], {}
    for fmt in args.formats.split(","):
        ours, marlin = PAIRS[fmt]
        for shape in args.shapes.split(","):
            K, N = (int(v) for v in shape.split("x"))
            t, w32 = checkpoint(fmt, N, K)
            wbf = w32.to(torch.bfloat16)
            fns, ours_layer = {}, None
            for role, name in (("cublade", ours), ("marlin", marlin)):
                fn, why, layer = kernel_fn(fmt, name, t, N, K)
                if fn is None:
                    why_not[f"{fmt} {name}"] = why
                else:
                    fns[role] = fn
                    ours_layer = layer if role == "cublade" else ours_layer
            fns["bf16"] = lambda x: torch.nn.functional.linear(x, wbf)
            tiles_fn = kernel_tiles_fn(fmt, ours_layer, N) if args.tiles_sweep and ours_layer is not None else None
            x16 = torch.randn(16, K, device=dev).to(torch.bfloat16)
            ref16 = x16.float() @ w32.t()
            errs = {role: rel_err(fn(x16), ref16) for role, fn in fns.items()}
            for M in (int(m) for m in args.m.split(",")):
                x = torch.randn(M, K, device=dev).to(torch.bfloat16)
                r = {"format": fmt, "K": K, "N": N, "M": M, "errors_m16": errs,
                     "us": {role: bench(functools.partial(fn, x)) for role, fn in fns.items()}}
                if tiles_fn is not None and M < 64:
                    r["kernel_us"] = {tiles: bench(functools.partial(tiles_fn, x, tiles))
                                      for tiles in (0, 1, 2, 4) if tiles != 4 or fmt == "w4a16" or M <= 8}
                rows.append(r)
                print(json.dumps(r), flush=True)
            t = w32 = wbf = fns = ours_layer = tiles_fn = None
            torch.cuda.empty_cache()

    write_json(args.json, rows, not_run=why_not)
    for name, why in why_not.items():
        print(f"not run: {name}: {why}")
    nan = float("nan")
    print(f"\ncublade's sm_80 kernels vs vLLM's Marlin on {torch.cuda.get_device_name()} (a proxy for Ampere / Ada "
          "when this is a Hopper card); median us (do_bench, L2 cleared); x = Marlin / cublade, bf16 / cublade")
    print(f"{'format':>6} {'K x N':>12} {'M':>4} {'cublade':>8} {'Marlin':>8} {'x':>6} {'bf16':>8} {'x':>6}")
    for r in rows:
        us = r["us"]
        c, m, b = us.get("cublade"), us.get("marlin"), us["bf16"]
        print(f"{r['format']:>6} {r['K']:>5}x{r['N']:<6} {r['M']:>4} {c or nan:>8.1f} {m or nan:>8.1f} "
              f"{(m / c) if c and m else nan:>5.2f}x {b:>8.1f} {(b / c) if c else nan:>5.2f}x")
    slow = [r for r in rows if r["us"].get("cublade") and r["us"].get("marlin")
            and r["us"]["marlin"] < 0.98 * r["us"]["cublade"]]
    print(f"\npoints where cublade is under 0.98x Marlin: {len(slow)} of {len(rows)}" + (
        ": " + ", ".join(f"{r['format']} {r['K']}x{r['N']} M={r['M']}" for r in slow) if slow else ""))
    swept = [r for r in rows if "kernel_us" in r]
    if swept:
        print("\ncublade's kernel alone (kernel_only) by weight tiles per CTA, median us; 0 = the launcher's choice")
        print(f"{'format':>6} {'K x N':>12} {'M':>4} " + " ".join(f"{f'tiles={k}':>9}" for k in (0, 1, 2, 4)))
        for r in swept:
            us = r["kernel_us"]
            print(f"{r['format']:>6} {r['K']:>5}x{r['N']:<6} {r['M']:>4} " +
                  " ".join(f"{us[k]:>9.1f}" if k in us else f"{'':>9}" for k in (0, 1, 2, 4)))
    seen = {}
    for r in rows:
        seen.setdefault((r["format"], r["K"], r["N"]), r["errors_m16"])
    print("accuracy at M=16 (mean|C-ref|/mean|ref| vs the fp32 product with the dequantized weight): " + " | ".join(
        f"{f} {k}x{n}: " + ", ".join(f"{role} {v:.2e}" for role, v in e.items()) for (f, k, n), e in seen.items()))


if __name__ == "__main__":
    main()
