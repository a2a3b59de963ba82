"""Benchmark an MXFP8 linear layer's two paths on Hopper, in the same run: cublade's own (`mxfp8_dequant` to a
bf16 weight, then torch's linear: cublade-mxfp8-dequant-matmul) and vLLM's MXFP8 Marlin GEMM (W8A16, the
vllm-marlin-mxfp8 fallback), with a bf16 linear of the dequantized weight for reference. bf16 activations,
weights MXFP8 (e4m3, one E8M0 scale per 32 along K, rceil) quantized from random normal weights.

    python benchmarks/bench_mxfp8_linear.py [--shapes 8192x28672,4096x14336,28672x8192] [--m 1,16,64,256,1024,4096]
                                            [--json FILE]

Times: median of triton.testing.do_bench (L2 cleared before every call: the weights come from HBM). TB/s: the
MXFP8 weight bytes (N*K + N*K/32) over the time. Accuracy at M=16: mean|C-ref|/mean|ref| against the fp32 product
with the dequantized weight (both paths multiply the same exact bf16 weights and sum in fp32).
Without vLLM (not importable) the Marlin column says so and the rest still runs.
"""
from __future__ import annotations

import argparse
import functools
import json

import torch

from common import REFERENCE_COPY_TBPS, bench_us, rel_err, require_op, vllm_single_process_state

bench = functools.partial(bench_us, rep_ms=100)


def vllm_marlin(q: torch.Tensor, codes: torch.Tensor):
    """fn(x) running vLLM's MarlinMxfp8LinearKernel on the checkpoint tensors (e4m3 [N, K], E8M0 [N, K/32]),
    set up as at load time; or the reason there is none."""
    try:
        import vllm
        from vllm.model_executor.kernels.linear import MarlinMxfp8LinearKernel, Mxfp8LinearLayerConfig
    except Exception as e:  # noqa: BLE001  (any import failure means: no baseline)
        return f"vLLM not importable ({type(e).__name__}: {e})", None
    vllm_single_process_state()
    ok, why = MarlinMxfp8LinearKernel.is_supported()
    if not ok:
        return f"vLLM's MarlinMxfp8LinearKernel: {why}", None
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(q.clone(), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(codes.clone(), requires_grad=False)
    layer.output_size_per_partition, layer.input_size_per_partition = q.shape
    layer.bias = None
    k = MarlinMxfp8LinearKernel(Mxfp8LinearLayerConfig())
    k.process_weights_after_loading(layer)
    return f"vLLM {vllm.__version__} MarlinMxfp8LinearKernel", lambda x: k.apply_weights(layer, x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8192x28672,4096x14336,28672x8192", help="KxN list")
    ap.add_argument("--m", default="1,16,64,256,1024,4096", help="token counts")
    ap.add_argument("--json", default=None, help="write all rows here")
    args = ap.parse_args()

    quant = require_op("bench_mxfp8_linear", "mxfp8_quant")
    dequant = torch.ops.cublade.mxfp8_dequant

    def cublade_path(x, q, codes):  # what cublade-mxfp8-dequant-matmul's apply runs
        return torch.nn.functional.linear(x, dequant(q, codes, x.dtype))

    dev = torch.device("cuda")
    rows, note = [], ""
    for shape in args.shapes.split(","):
        K, N = (int(v) for v in shape.split("x"))
        g = torch.Generator(device=dev).manual_seed(0)
        q, codes = quant((torch.randn(N, K, device=dev, generator=g) * 0.02).to(torch.bfloat16), True)
        wbf = dequant(q, codes, torch.bfloat16)
        note, marlin = vllm_marlin(q, codes)
        wbytes = N * K + N * K // 32
        x16 = torch.randn(16, K, device=dev, generator=g).to(torch.bfloat16)
        ref16 = x16.float() @ wbf.float().t()
        errs = {"cublade": rel_err(cublade_path(x16, q, codes), ref16)}
        if marlin is not None:
            errs["marlin"] = rel_err(marlin(x16), ref16)
        for M in (int(m) for m in args.m.split(",")):
            x = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
            r = {"K": K, "N": N, "M": M, "weight_bytes": wbytes, "errors_m16": errs}
            r["cublade_us"] = bench(lambda: cublade_path(x, q, codes))
            r["marlin_us"] = bench(lambda: marlin(x)) if marlin is not None else None
            r["bf16_us"] = bench(lambda: torch.nn.functional.linear(x, wbf))
            rows.append(r)
            print(json.dumps(r), flush=True)
        q = codes = wbf = marlin = None  # free the shape's tensors before the next
        torch.cuda.empty_cache()

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "baseline": note,
                       "rows": rows}, f, indent=1)
    print(f"baseline: {note}")
    print("\nMXFP8 linear (e4m3 + E8M0 per 32, bf16 activations); median us (do_bench, L2 cleared); TB/s = MXFP8 "
          f"weight bytes / time, % of the {REFERENCE_COPY_TBPS} TB/s copy ceiling")
    print(f"{'K x N':>12} {'M':>4} {'cublade':>8} {'TB/s':>5} {'Marlin':>8} {'TB/s':>5} {'cublade/Marlin':>14} "
          f"{'bf16':>8} {'bf16/Marlin':>11}")
    nan = float("nan")
    for r in rows:
        mar = r["marlin_us"] or nan
        tbs, mtbs = r["weight_bytes"] / r["cublade_us"] / 1e6, r["weight_bytes"] / mar / 1e6
        print(f"{r['K']:>5}x{r['N']:<6} {r['M']:>4} {r['cublade_us']:>8.1f} {tbs:>5.2f} {mar:>8.1f} {mtbs:>5.2f} "
              f"{r['cublade_us'] / mar:>13.2f}x {r['bf16_us']:>8.1f} {r['bf16_us'] / mar:>10.2f}x")
    print("accuracy at M=16 (mean|C-ref|/mean|ref| vs fp32): " + " | ".join(
        f"{r['K']}x{r['N']}: " + ", ".join(f"{k} {v:.2e}" for k, v in r["errors_m16"].items())
        for r in rows if r["M"] == rows[0]["M"]))


if __name__ == "__main__":
    main()
