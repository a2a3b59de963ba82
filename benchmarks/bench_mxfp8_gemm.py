"""Benchmark the kernels an MXFP8 linear layer can run on Hopper, in the same run, as the product runs them: each
kernel class of cublade.vllm.kernels (cublade-mxfp8-gemm, vllm-marlin-mxfp8, cublade-mxfp8-dequant-matmul) built on
a stand-in layer holding the checkpoint's tensors (its constructor repacks them, as at load time) and timed through
its `apply`; vLLM's Humming MXFP8 kernel (HummingMxfp8LinearKernel, needs the humming-kernels package) on the same
tensors; plus a bf16 linear of the dequantized weight, and cublade's prefill path alone (mxfp8_dequant_packed +
cuBLAS: where it overtakes the wide kernel sets the op's switch, mxfp8_gemm_prefill_rows in plugin/csrc/w4a16_gemm.h).
bf16 activations, weights MXFP8 (e4m3, one E8M0 scale per 32 along K, rceil) quantized from random normal weights.

    python benchmarks/bench_mxfp8_gemm.py [--shapes 8192x28672,4096x14336,28672x8192]
                                          [--m 1,8,16,32,64,128,256,512,1024,4096] [--graph] [--no-measured]
                                          [--json FILE]

"cublade-mxfp8-measured" is the kernel class CUBLADE_MXFP8_PREFILL=humming selects: cublade's op, and vLLM's Humming
where it measured faster when the layer was built (its timing at load; the ranges are printed per shape).

Times: median of triton.testing.do_bench (L2 cleared before every call: the weights come from HBM); --graph times every
column as one CUDA graph replay (common.graphed), as vLLM's CUDA-graphed decode runs the kernels, so host work
(Humming's Python side at small M) does not count. After the table, the points where cublade's op, and the measured
kernel, are under 0.98x the faster of vLLM's MXFP8 kernels (Marlin, Humming). TB/s: the MXFP8 weight bytes (N*K +
N*K/32) over the time. Accuracy at M=16: mean|C-ref|/mean|ref| against the fp32 product with the dequantized weight
(every kernel multiplies the same exact bf16 weights and sums in fp32). A kernel that cannot run here (no vLLM, no
extension) is reported with its reason and left out.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json

import torch

from common import (bench_us, graphed, humming_linear, measured_linear, print_kernel_table, rel_err, require_op,
                    stand_in_layer, vllm_single_process_state, write_json)

bench = functools.partial(bench_us, rep_ms=100)
KERNELS = ("cublade-mxfp8-gemm", "vllm-marlin-mxfp8", "cublade-mxfp8-dequant-matmul")
VLLM_COLUMNS = ("vllm-marlin-mxfp8", "vllm-humming-mxfp8")  # the floor: cublade's op >= 0.98x the faster of these


def mxfp8_layer(q: torch.Tensor, codes: torch.Tensor) -> torch.nn.Module:
    """A stand-in layer of the mxfp8 scheme holding these tensors."""
    from cublade.config import MXFP8Scheme

    return stand_in_layer({"weight": q, "weight_scale": codes}, MXFP8Scheme(), *q.shape)


def kernel_fns(q: torch.Tensor, codes: torch.Tensor) -> tuple[dict, dict]:
    """{kernel name: fn(x)} for the kernel classes that can run here, and {name: why not} for the others."""
    from cublade.vllm import kernels

    fns, why_not = {}, {}
    for name in KERNELS:
        cls = next(k for k in kernels.CANDIDATES[kernels.MXFP8Scheme] if k.name == name)
        if not cls.own:
            try:
                vllm_single_process_state()
            except ImportError as e:
                why_not[name] = f"vLLM not importable ({e})"
                continue
        layer = mxfp8_layer(q, codes)
        ok, why = cls.can_implement(layer)
        if not ok:
            why_not[name] = why
            continue
        impl = cls(layer)
        fns[name] = functools.partial(impl.apply, layer, bias=None)
    return fns, why_not


def humming_fn(q: torch.Tensor, codes: torch.Tensor):
    """(fn(x), None) for vLLM's Humming MXFP8 kernel on the checkpoint tensors, prepared as vLLM does at load time, or
    (None, why not)."""
    try:
        vllm_single_process_state()
        from vllm.model_executor.kernels.linear.mxfp8.humming import HummingMxfp8LinearKernel
        from vllm.model_executor.kernels.linear.mxfp8.Mxfp8LinearKernel import Mxfp8LinearLayerConfig
    except ImportError as e:
        return None, f"vLLM's Humming MXFP8 kernel not importable ({e})"
    layer = mxfp8_layer(q, codes)
    layer.output_partition_sizes, layer.has_bias = [q.shape[0]], False
    return humming_linear(HummingMxfp8LinearKernel, Mxfp8LinearLayerConfig(), layer, "MXFP8")


def with_measured(q: torch.Tensor, codes: torch.Tensor):
    """(fn(x), its ranges) for the kernel class CUBLADE_MXFP8_PREFILL=humming selects
    (cublade.vllm.kernels.cublade_mxfp8_measured) on a stand-in layer of the checkpoint tensors: cublade's op and vLLM's
    Humming, the shape timed as at load and each call on the faster for its M; (None, why) where it cannot be built."""
    from cublade.numerics.linear import MXFP8_PREFILL_ENV

    layer = mxfp8_layer(q, codes)
    layer.logical_widths, layer.prefix = [q.shape[0]], f"bench.mxfp8.{q.shape[1]}x{q.shape[0]}"
    return measured_linear("cublade.vllm.kernels.cublade_mxfp8_measured", "CubladeMxfp8Measured", MXFP8_PREFILL_ENV,
                           "humming", layer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8192x28672,4096x14336,28672x8192", help="KxN list")
    ap.add_argument("--m", default="1,8,16,32,64,128,256,512,1024,4096", help="token counts")
    ap.add_argument("--graph", action="store_true",
                    help="time each column as one CUDA graph replay (no host launch gaps; L2 still cleared)")
    ap.add_argument("--no-measured", dest="measured", action="store_false",
                    default=importlib.util.find_spec("humming") is not None,
                    help="leave out the measured column (CUBLADE_MXFP8_PREFILL=humming's kernel class; on by default "
                         "where the humming package is installed)")
    ap.add_argument("--json", default=None, help="write all rows here")
    args = ap.parse_args()
    time_us = (lambda fn: bench(graphed(fn))) if args.graph else bench

    quant = require_op("bench_mxfp8_gemm", "mxfp8_quant")
    require_op("bench_mxfp8_gemm", "mxfp8_gemm")
    from cublade.ops.mxfp8_gemm import mxfp8_dequant_packed, mxfp8_repack

    dev = torch.device("cuda")
    rows, why_not = [], {}
    for shape in args.shapes.split(","):
        K, N = (int(v) for v in shape.split("x"))
        g = torch.Generator(device=dev).manual_seed(0)
        q, codes = quant((torch.randn(N, K, device=dev, generator=g) * 0.02).to(torch.bfloat16), True)
        wbf = torch.ops.cublade.mxfp8_dequant(q, codes, torch.bfloat16)
        fns, why_not = kernel_fns(q, codes)
        hfn, why = humming_fn(q, codes)
        if hfn is None:
            why_not["vllm-humming-mxfp8"] = why
        else:
            fns["vllm-humming-mxfp8"] = hfn
        if args.measured:
            mfn, ranges = with_measured(q, codes)
            print(f"{K}x{N}: measured (humming) " + (f"runs {ranges}" if mfn else f"not run ({ranges})"), flush=True)
            if mfn is not None:
                fns["cublade-mxfp8-measured"] = mfn
        packed = mxfp8_repack(q, codes)
        fns["cublade deq+mm"] = lambda x: torch.nn.functional.linear(x, mxfp8_dequant_packed(packed, N, K))
        fns["bf16"] = lambda x: torch.nn.functional.linear(x, wbf)
        wbytes = N * K + N * K // 32
        x16 = torch.randn(16, K, device=dev, generator=g).to(torch.bfloat16)
        ref16 = x16.float() @ wbf.float().t()
        errs = {name: rel_err(fn(x16), ref16) for name, fn in fns.items()}
        for M in (int(m) for m in args.m.split(",")):
            x = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
            r = {"K": K, "N": N, "M": M, "weight_bytes": wbytes, "graph": args.graph, "errors_m16": errs,
                 "us": {name: time_us(functools.partial(fn, x)) for name, fn in fns.items()}}
            rows.append(r)
            print(json.dumps(r), flush=True)
        q = codes = wbf = packed = fns = None  # free the shape's tensors before the next
        torch.cuda.empty_cache()

    write_json(args.json, rows, not_run=why_not)
    for name, why in why_not.items():
        print(f"not run: {name}: {why}")
    print_kernel_table(rows, "cublade-mxfp8-gemm", "MXFP8 linear (e4m3 + E8M0 per 32, bf16 activations"
                       + ("; each call one CUDA graph replay)" if args.graph else ")"), "fp32")
    for ours in ("cublade-mxfp8-gemm", "cublade-mxfp8-measured"):
        if any(ours in r["us"] for r in rows):
            print(floor_line(rows, ours))


def floor_line(rows: list[dict], ours: str) -> str:
    """The points where `ours` is under 0.98x the faster of vLLM's MXFP8 kernels that ran."""
    timed = [(r, min(r["us"][n] for n in VLLM_COLUMNS if n in r["us"])) for r in rows
             if ours in r["us"] and any(n in r["us"] for n in VLLM_COLUMNS)]
    short = [f"{r['K']}x{r['N']} M={r['M']} {best / r['us'][ours]:.2f}x" for r, best in timed
             if best < 0.98 * r["us"][ours]]
    return (f"points where {ours} is under 0.98x the best vLLM MXFP8 kernel: {len(short)} of {len(timed)}"
            + (": " + ", ".join(short) if short else ""))


if __name__ == "__main__":
    main()
