"""Benchmark cublade's fp4_gemm (FP4 experts, bf16 math) in the same run as vLLM's Marlin FP4 GEMM and its Humming
FP4 linear kernel (dense, per expert; Humming needs the humming-kernels package) and a bf16 matmul of the dequantized
weight.

    python benchmarks/bench_fp4_gemm.py [--fmt mxfp4,nvfp4] [--batches 1,4,16] [--json FILE]

Dense rows: one expert's linear (Mixtral-8x7B sizes: w13 K=4096 N=28672, w2 K=14336 N=4096) at M = 1, 4, 16.
Grouped rows: one call over E=8 experts for a batch of B tokens (--batches; 1, 4, 16: decode) with top-2 routing
(T = 2B rows sorted by expert, random experts), against a bf16 loop over the active experts (what a
dequantize-then-matmul MoE does).
Times: median of triton.testing.do_bench (L2 cleared before each call). TB/s: FP4 + scale bytes of the experts
that have rows, over the time. Accuracy: mean|C-ref|/mean|ref| at M=16 against the fp32 product with the
dequantized weights. Without vLLM (or humming) the baseline columns say so and the rest still runs.
"""
from __future__ import annotations

import argparse
import functools
import json

import torch

from common import bench_us, humming_linear, rel_err, require_op, vllm_single_process_state, write_json

bench = functools.partial(bench_us, rep_ms=100)  # median us, do_bench's 100 ms window


def random_fp4(E: int, N: int, K: int, fmt: str, dev) -> dict:
    """Checkpoint tensors with random codes and realistic scales."""
    t = {"weight_packed": torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device=dev)}
    if fmt == "mxfp4":
        t["weight_scale"] = torch.randint(117, 123, (E, N, K // 32), dtype=torch.uint8, device=dev)
    else:
        t["weight_scale"] = (torch.rand(E, N, K // 16, device=dev) * 200 + 20).to(torch.float8_e4m3fn)
        t["weight_global_scale"] = torch.full((E,), 1e-4, device=dev)
    return t


def random_routing(E: int, tokens: int, k: int, seed: int) -> torch.Tensor:
    """Expert ids [tokens * k]: each token's k distinct experts, drawn with a CPU generator seeded by `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]).flatten()


def expert_offsets(counts: torch.Tensor, dev) -> torch.Tensor:
    """Rows per expert -> fp4_gemm's expert_offsets, int32 [E+1] on dev."""
    return torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32).to(dev)


def marlin_fp4(t: dict, fmt: str, N: int, K: int):
    """vLLM's Marlin FP4 linear for expert 0 (prepare_fp4_layer_for_marlin + apply_fp4_marlin_linear)."""
    try:
        import vllm
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import (
            apply_fp4_marlin_linear, prepare_fp4_layer_for_marlin)
    except Exception as e:  # noqa: BLE001
        return None, f"baseline: vLLM not importable ({type(e).__name__}: {e})"
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(t["weight_packed"][0].clone(), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(t["weight_scale"][0].clone(), requires_grad=False)
    if fmt == "nvfp4":
        layer.weight_global_scale = torch.nn.Parameter(t["weight_global_scale"][:1].clone(), requires_grad=False)
    layer.output_size_per_partition, layer.input_size_per_partition = N, K
    layer.params_dtype = torch.bfloat16
    prepare_fp4_layer_for_marlin(layer)
    gs = layer.weight_global_scale if fmt == "nvfp4" else None
    fn = lambda x: apply_fp4_marlin_linear(x, layer.weight, layer.weight_scale, gs, layer.workspace, N, K)  # noqa
    return fn, f"baseline: vLLM {vllm.__version__} Marlin FP4 (apply_fp4_marlin_linear, one expert)"


def humming_fp4(t: dict, fmt: str, N: int, K: int):
    """(fn(x), None) for vLLM's Humming MXFP4 / NVFP4 linear kernel on expert 0, prepared as vLLM does at load time
    (the layer holding what vLLM's own fp4 schemes hand the kernel), or (None, why not)."""
    try:
        vllm_single_process_state()
        if fmt == "mxfp4":
            from vllm.model_executor.kernels.linear.mxfp4.base import MxFp4LinearLayerConfig as Config
            from vllm.model_executor.kernels.linear.mxfp4.humming import HummingMxFp4LinearKernel as Kernel
        else:
            from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig as Config
            from vllm.model_executor.kernels.linear.nvfp4.humming import HummingNvFp4LinearKernel as Kernel
    except ImportError as e:
        return None, f"vLLM's Humming {fmt} kernel not importable ({e})"
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(t["weight_packed"][0].clone(), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(t["weight_scale"][0].clone(), requires_grad=False)
    if fmt == "nvfp4":  # the scale Marlin is given (the kernel inverts it back, as vLLM's scheme inverted it)
        layer.weight_global_scale = torch.nn.Parameter(t["weight_global_scale"][:1].clone(), requires_grad=False)
    layer.input_size = layer.input_size_per_partition = K
    layer.output_size = layer.output_size_per_partition = N
    layer.output_partition_sizes, layer.params_dtype, layer.has_bias = [N], torch.bfloat16, False
    return humming_linear(Kernel, Config(), layer, fmt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fmt", default="mxfp4,nvfp4")
    ap.add_argument("--batches", default="1,4,16", help="grouped rows' token counts B (default 1,4,16)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from cublade.ops.fp4_gemm import fp4_dequant_repacked, fp4_repack

    op = require_op("bench_fp4_gemm", "fp4_gemm")
    dev = torch.device("cuda")
    rows, note, not_run = [], None, {}
    E = 8
    for fmt in args.fmt.split(","):
        for K, N in [(4096, 28672), (14336, 4096)]:
            torch.manual_seed(0)
            t = random_fp4(E, N, K, fmt, dev)
            rp = fp4_repack(t["weight_packed"], t["weight_scale"], fmt, t.get("weight_global_scale"))
            w32 = fp4_dequant_repacked(rp.packed, rp.row_scale, fmt, N, K)  # [E, N, K]
            wbf = w32.to(torch.bfloat16)
            sbytes = N * K // (32 if fmt == "mxfp4" else 16)
            ebytes = N * K // 2 + sbytes  # one expert
            marlin, note = marlin_fp4(t, fmt, N, K)
            humming, why = humming_fp4(t, fmt, N, K)
            if humming is None:
                not_run[f"humming {fmt}"] = why
            one = rp._replace(packed=rp.packed[:1].contiguous(),
                              row_scale=None if rp.row_scale is None else rp.row_scale[:1].contiguous())
            x16 = torch.randn(16, K, device=dev).to(torch.bfloat16)
            ref16 = x16.float() @ w32[0].t()
            errs = {"cublade": rel_err(op(x16, one.packed, one.row_scale, fmt, N), ref16)}
            if marlin is not None:
                errs["marlin"] = rel_err(marlin(x16), ref16)
            if humming is not None:
                errs["humming"] = rel_err(humming(x16), ref16)
            for M in (1, 4, 16):
                x = torch.randn(M, K, device=dev).to(torch.bfloat16)
                r = {"kind": "dense", "fmt": fmt, "K": K, "N": N, "M": M, "bytes": ebytes}
                r["cublade_us"] = bench(lambda: op(x, one.packed, one.row_scale, fmt, N))
                r["bf16_us"] = bench(lambda: torch.nn.functional.linear(x, wbf[0]))
                r["marlin_us"] = bench(lambda: marlin(x)) if marlin is not None else None
                r["humming_us"] = bench(lambda: humming(x)) if humming is not None else None
                r["errors_m16"] = errs
                rows.append(r)
                print(json.dumps(r), flush=True)
            for B in (int(b) for b in args.batches.split(",")):
                counts = torch.bincount(random_routing(E, B, 2, seed=B), minlength=E)
                offsets = expert_offsets(counts, dev)
                T = 2 * B
                x = torch.randn(T, K, device=dev).to(torch.bfloat16)
                active = [e for e in range(E) if counts[e] > 0]
                o = offsets.tolist()
                r = {"kind": "grouped", "fmt": fmt, "K": K, "N": N, "B": B, "T": T, "active": len(active),
                     "bytes": ebytes * len(active)}
                mm = int(counts.max())
                r["cublade_us"] = bench(lambda: op(x, rp.packed, rp.row_scale, fmt, N, offsets, mm))

                def bf16_loop():
                    y = torch.empty(T, N, device=dev, dtype=torch.bfloat16)
                    for e in active:
                        y[o[e]:o[e + 1]] = torch.nn.functional.linear(x[o[e]:o[e + 1]], wbf[e])
                    return y
                r["bf16_us"] = bench(bf16_loop)
                y = op(x, rp.packed, rp.row_scale, fmt, N, offsets, mm)
                ref = torch.cat([x[o[e]:o[e + 1]].float() @ w32[e].t() for e in range(E)])
                r["error"] = rel_err(y, ref)
                rows.append(r)
                print(json.dumps(r), flush=True)
            w32 = wbf = rp = one = t = humming = marlin = None  # free the shape's tensors before the next
            torch.cuda.empty_cache()

    write_json(args.json, rows, baseline=note, not_run=not_run)
    print(note)
    for name, why in not_run.items():
        print(f"not run: {name}: {why}")
    print("\nfp4_gemm: median us (do_bench, L2 cleared); TB/s = FP4 + scale bytes of the experts with rows / time")
    print(f"{'kind':>7} {'fmt':>5} {'K x N':>12} {'M/T':>4} {'cublade':>8} {'TB/s':>5} {'Marlin':>8} "
          f"{'Marlin/cublade':>14} {'Humming':>8} {'Humming/cublade':>15} {'bf16':>8} {'bf16/cublade':>12}")
    for r in rows:
        tbs = r["bytes"] / r["cublade_us"] / 1e6
        m, h = r.get("marlin_us"), r.get("humming_us")
        print(f"{r['kind']:>7} {r['fmt']:>5} {r['K']:>5}x{r['N']:<6} {r.get('M', r.get('T')):>4} "
              f"{r['cublade_us']:>8.1f} {tbs:>5.2f} {m or float('nan'):>8.1f} "
              f"{(m / r['cublade_us']) if m else float('nan'):>13.2f}x {h or float('nan'):>8.1f} "
              f"{(h / r['cublade_us']) if h else float('nan'):>14.2f}x {r['bf16_us']:>8.1f} "
              f"{r['bf16_us'] / r['cublade_us']:>11.2f}x")
    print("accuracy: " + " | ".join(
        f"{r['fmt']} {r['K']}x{r['N']} " + (", ".join(f"{k} {v:.2e}" for k, v in r["errors_m16"].items())
                                            if r["kind"] == "dense" else f"grouped T={r['T']} {r['error']:.2e}")
        for r in rows if r["kind"] == "grouped" or r["M"] == 1))


if __name__ == "__main__":
    main()
