"""Benchmark cublade's w4a16_gemm against vLLM's Machete, Marlin and Humming (its W4A16 kernels on Hopper) and a
bf16 matmul of the dequantized weight, in the same run. int4 weights, group 128, symmetric (uint4b8), bf16
activations.

    python benchmarks/bench_w4a16_gemm.py [--shapes 8192x28672,4096x14336] [--m 1,4,16,32,64,128,256,1024,4096]
                                          [--sweep] [--graph] [--measured machete,humming] [--json FILE]

"measured" is the kernel class CUBLADE_W4A16_PREFILL=machete,humming (--measured) selects: cublade's op, and vLLM's
Machete / Humming (a copy of the weights each) at the token counts where one was faster when the layer was built; the
ranges it measured are printed per shape.

The op picks its path by M: the streaming decode kernel, or for large M the prefill path (w4a16_dequant into a
bf16 weight, then cuBLAS). Both paths are also timed on their own ("stream": split_k=1 forces the kernel, up to
M=256; "deq+mm": w4a16_dequant + torch's linear) to show where they cross. "fp8-tc" is the opt-in FP8 tensor-core
path (cublade.ops.w4a16_gemm_fp8 with min_rows 0: activations quantized to E4M3 per 1 x 128, the int4 values as
E4M3 codes, a blockwise-scaled FP8 GEMM), timed from M = 64; it changes numerics (its error column).

Times: median of triton.testing.do_bench (it clears L2 before every call, so the weights come from HBM). --graph
times every column as one CUDA graph replay (common.graphed), as vLLM's CUDA-graphed decode runs the kernels: without
it a call's host work counts wherever it outlasts the L2 clear (a Python-side kernel such as Humming's, or the
measured column's op, at small M).
Bandwidth: weight + scale bytes (N*K/2 + N*K/128*2) over the time; % of the 4.28 TB/s
device-to-device copy ceiling measured on the H200. Accuracy: mean|C-ref|/mean|ref| at M=16 against the fp32
product with the dequantized weights. --sweep also times every split_k (warps per 16-row tile) for tuning.
Without vLLM (not importable) the baseline columns say so and the rest still runs. Humming needs the
`humming-kernels` package (vLLM's optional dependency; it compiles its kernels on first use, so the first M of a
shape takes longer to set up, not to time).
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json

import torch

from common import (REFERENCE_COPY_TBPS, bench_us, graphed, measured_linear, rel_err, require_op,
                    vllm_single_process_state, write_json)

bench = functools.partial(bench_us, rep_ms=100)  # median us, do_bench's 100 ms window
G = 128


def vllm_kernels(wp: torch.Tensor, ws: torch.Tensor, N: int, K: int) -> tuple[dict, str]:
    """{name: fn(x)} for vLLM's Machete, Marlin and Humming on the checkpoint tensors (compressed-tensors' int4 layout,
    which is cublade's), set up the way vLLM's MPLinearKernel classes do at load time."""
    try:
        import vllm
        from vllm.model_executor.kernels import linear as vl
        from vllm.model_executor.parameter import GroupQuantScaleParameter, PackedvLLMParameter
        from vllm.scalar_type import scalar_types
    except Exception as e:  # noqa: BLE001  (any import failure means: no baseline)
        return {}, f"baseline: vLLM not importable ({type(e).__name__}: {e})"
    vllm_single_process_state()
    out = {}
    noop = lambda *a, **k: None  # noqa: E731
    cfg = vl.MPLinearLayerConfig(full_weight_shape=(K, N), partition_weight_shape=(K, N),
                                 weight_type=scalar_types.uint4b8, act_type=torch.bfloat16, group_size=G,
                                 zero_points=False, has_g_idx=False)
    for name in ("MacheteLinearKernel", "MarlinLinearKernel", "HummingLinearKernel"):
        cls = getattr(vl, name, None)
        ok, why = cls.can_implement(cfg) if cls else (False, f"vLLM {vllm.__version__} has no {name}")
        if not ok:
            out[name.replace("LinearKernel", "")] = why
            continue
        layer = torch.nn.Module()
        # what vLLM's linear layers carry and Humming's preparation reads
        layer.input_size = layer.input_size_per_partition = K
        layer.output_size = layer.output_size_per_partition = N
        layer.output_partition_sizes = [N]
        layer.params_dtype, layer.has_bias = torch.bfloat16, False
        layer.register_parameter("weight_packed", PackedvLLMParameter(
            data=wp.clone(), input_dim=1, output_dim=0, packed_dim=1, packed_factor=8, weight_loader=noop))
        layer.register_parameter("weight_scale", GroupQuantScaleParameter(
            data=ws.clone(), output_dim=0, input_dim=1, weight_loader=noop))
        k = cls(cfg, w_q_param_name="weight_packed", w_s_param_name="weight_scale")
        k.process_weights_after_loading(layer)
        out[name.replace("LinearKernel", "")] = (lambda kk, ll: (lambda x: kk.apply_weights(ll, x)))(k, layer)
    skipped = "; ".join(f"{k}: {v}" for k, v in out.items() if not callable(v))
    return out, f"baseline: vLLM {vllm.__version__} Machete / Marlin / Humming (MPLinearKernel)" + (
        f"; not run: {skipped}" if skipped else "")


def with_measured(wp: torch.Tensor, ws: torch.Tensor, N: int, K: int, kernels: str):
    """(fn(x), its ranges) for the kernel class CUBLADE_W4A16_PREFILL=`kernels` selects
    (cublade.vllm.kernels.cublade_w4a16_measured), built on a stand-in layer holding the checkpoint tensors: cublade's
    op and the named vLLM kernels, each layer shape timed at load and each call on the fastest for its M. (None, why)
    where it cannot be built (no vLLM, a kernel that cannot take the shape)."""
    from cublade.config import W4A16Scheme
    from cublade.numerics.linear import W4A16_PREFILL_ENV

    layer = torch.nn.Module()
    layer.register_parameter("weight_packed", torch.nn.Parameter(wp.clone(), requires_grad=False))
    layer.register_parameter("weight_scale", torch.nn.Parameter(ws.clone(), requires_grad=False))
    layer.output_size = layer.output_size_per_partition = N
    layer.input_size = layer.input_size_per_partition = K
    layer.logical_widths, layer.prefix = [N], f"bench.{K}x{N}"
    layer.params_dtype, layer.cublade_scheme, layer.bias = torch.bfloat16, W4A16Scheme(G, True), None
    return measured_linear("cublade.vllm.kernels.cublade_w4a16_measured", "CubladeW4A16Measured", W4A16_PREFILL_ENV,
                           kernels, layer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8192x28672,4096x14336", help="KxN list")
    ap.add_argument("--m", default="1,4,16,32,64,128,256,1024,4096", help="token counts")
    ap.add_argument("--sweep", action="store_true", help="also time each split_k (K splits per cluster)")
    ap.add_argument("--measured", default="machete,humming" if importlib.util.find_spec("humming") else "machete",
                    help="the kernels of the measured column (CUBLADE_W4A16_PREFILL's value; default Machete, and "
                         "Humming where installed; add fp8 to time cublade's FP8 tensor-core path too)")
    ap.add_argument("--graph", action="store_true",
                    help="time each column as one CUDA graph replay (no host launch gaps; L2 still cleared)")
    ap.add_argument("--json", default=None, help="write all rows here")
    args = ap.parse_args()
    time_us = (lambda fn: bench(graphed(fn))) if args.graph else bench

    from cublade.ops.w4a16_gemm import w4a16_dequant_repacked, w4a16_repack
    from cublade.ops.w4a16_gemm_fp8 import blockwise_fp8_supported, w4a16_gemm_fp8

    op = require_op("bench_w4a16_gemm", "w4a16_gemm")
    dequant = torch.ops.cublade.w4a16_dequant

    def deq_mm(x, packed, N):
        return torch.nn.functional.linear(x, dequant(packed, G, True, N, x.shape[-1], x.dtype))

    dev = torch.device("cuda")
    rows = []
    note = None
    for shape in args.shapes.split(","):
        K, N = (int(v) for v in shape.split("x"))
        torch.manual_seed(0)
        # random nibbles and positive scales in the checkpoint layout (cublade = compressed-tensors int4)
        wp = torch.randint(-2**31, 2**31, (N, K // 8), dtype=torch.int32, device=dev)
        ws = (torch.rand(N, K // G, device=dev) * 0.01 + 0.002).to(torch.bfloat16)
        rp = w4a16_repack(wp, ws, None, G)
        w32 = w4a16_dequant_repacked(rp.packed, G, True, N, K)
        wbf = w32.to(torch.bfloat16)
        base, note = vllm_kernels(wp, ws, N, K)
        measured, ranges = with_measured(wp, ws, N, K, args.measured) if base else (None, "no vLLM")
        print(f"{K}x{N}: measured ({args.measured}) runs {ranges}" if measured else
              f"{K}x{N}: measured ({args.measured}) not run ({ranges})", flush=True)
        wbytes = N * K // 2 + N * (K // G) * 2
        x16 = torch.randn(16, K, device=dev).to(torch.bfloat16)
        ref16 = x16.float() @ w32.t()
        errs = {"cublade": rel_err(op(x16, rp.packed, G, True, N), ref16),
                "deq+mm": rel_err(deq_mm(x16, rp.packed, N), ref16),
                "bf16": rel_err(torch.nn.functional.linear(x16, wbf), ref16)}
        fp8tc = blockwise_fp8_supported()
        if fp8tc:
            errs["fp8-tc"] = rel_err(w4a16_gemm_fp8(x16, rp.packed, G, True, N, 0), ref16)
        for name, fn in base.items():
            if callable(fn):
                errs[name] = rel_err(fn(x16), ref16)
        del w32
        for M in (int(m) for m in args.m.split(",")):
            x = torch.randn(M, K, device=dev).to(torch.bfloat16)
            r = {"K": K, "N": N, "M": M, "weight_bytes": wbytes, "graph": args.graph}
            r["cublade_us"] = time_us(lambda: op(x, rp.packed, G, True, N))
            r["stream_us"] = time_us(lambda: op(x, rp.packed, G, True, N, 1)) if M <= 256 else None
            r["deq_mm_us"] = time_us(lambda: deq_mm(x, rp.packed, N))
            r["bf16_us"] = time_us(lambda: torch.nn.functional.linear(x, wbf))
            r["fp8tc_us"] = (time_us(lambda: w4a16_gemm_fp8(x, rp.packed, G, True, N, 0)) if fp8tc and M >= 64
                             else None)
            r["measured_us"] = time_us(lambda: measured(x)) if measured else None
            for name, fn in base.items():
                r[f"{name}_us"] = time_us(lambda: fn(x)) if callable(fn) else None
            if args.sweep:
                for s in (1, 2, 4, 8):
                    r[f"split{s}_us"] = time_us(lambda: op(x, rp.packed, G, True, N, s))
            r["errors_m16"] = errs
            rows.append(r)
            print(json.dumps(r), flush=True)
        del wbf, rp, base, measured
        torch.cuda.empty_cache()

    write_json(args.json, rows, baseline=note)
    print(note)
    print(f"\nw4a16_gemm, int4 g128 sym, bf16 activations; median us (do_bench, L2 cleared"
          f"{'; each call one CUDA graph replay' if args.graph else ''}); TB/s = weight+scale "
          f"bytes / time; % of the {REFERENCE_COPY_TBPS} TB/s copy ceiling")
    hdr = f"{'K x N':>12} {'M':>4} {'cublade':>8} {'TB/s':>5} {'%ceil':>5} {'Machete':>8} {'Marlin':>8} " \
          f"{'Humming':>8} {'best vLLM/cublade':>17} {'bf16':>7} {'bf16/cublade':>12} {'stream':>7} {'deq+mm':>7} " \
          f"{'fp8-tc':>7} {'best vLLM/fp8-tc':>16} {'bf16/fp8-tc':>11}"
    print(hdr)
    nan = float("nan")
    vllm_names = ("Machete", "Marlin", "Humming")

    def best_vllm(r):  # the fastest vLLM kernel's time on this point, None when none ran
        return min((r[f"{k}_us"] for k in vllm_names if r.get(f"{k}_us")), default=None)

    for r in rows:
        vl = [r.get(f"{k}_us") for k in vllm_names]
        best = best_vllm(r)
        tbs = r["weight_bytes"] / r["cublade_us"] / 1e6
        print(f"{r['K']:>5}x{r['N']:<6} {r['M']:>4} {r['cublade_us']:>8.1f} {tbs:>5.2f} "
              f"{100 * tbs / REFERENCE_COPY_TBPS:>4.0f}% " + " ".join(f"{v or nan:>8.1f}" for v in vl) +
              f" {(best / r['cublade_us']) if best else nan:>16.2f}x {r['bf16_us']:>7.1f} "
              f"{r['bf16_us'] / r['cublade_us']:>11.2f}x {r['stream_us'] or nan:>7.1f} {r['deq_mm_us']:>7.1f} "
              f"{r['fp8tc_us'] or nan:>7.1f} {(best / r['fp8tc_us']) if best and r['fp8tc_us'] else nan:>15.2f}x "
              f"{(r['bf16_us'] / r['fp8tc_us']) if r['fp8tc_us'] else nan:>10.2f}x")
    losses = [r for r in rows if best_vllm(r) is not None and best_vllm(r) < 0.98 * r["cublade_us"]]
    crossings = []
    for shape in dict.fromkeys((r["K"], r["N"]) for r in rows):
        timed = [r for r in rows if (r["K"], r["N"]) == shape and r["fp8tc_us"]]
        # the smallest M from which the FP8 path is faster than the op's own choice at every larger M measured
        from_m = next((r["M"] for i, r in enumerate(timed)
                       if all(t["fp8tc_us"] < t["cublade_us"] for t in timed[i:])), None)
        crossings.append(f"{shape[0]}x{shape[1]}: {from_m if from_m is not None else 'never'}")
    if any(r["fp8tc_us"] for r in rows):
        print("\nfp8-tc faster than cublade's own choice from M = (rows measured; the op's switch is "
              "W4A16_FP8_MIN_ROWS): " + ", ".join(crossings))
    print(f"\npoints where cublade is under 0.98x the best vLLM kernel: {len(losses)} of {len(rows)}" + (
        ": " + ", ".join(f"{r['K']}x{r['N']} M={r['M']}" for r in losses) if losses else ""))
    timed = [r for r in rows if r["measured_us"] and best_vllm(r) is not None]
    if timed:
        print(f"\nmeasured (CUBLADE_W4A16_PREFILL={args.measured}), best vLLM / it: " + ", ".join(
            f"{r['K']}x{r['N']} M={r['M']} {best_vllm(r) / r['measured_us']:.2f}x" for r in timed))
        short = [r for r in timed if best_vllm(r) < 0.98 * r["measured_us"]]
        print(f"points where measured is under 0.98x the best vLLM kernel: {len(short)} of {len(timed)}" + (
            ": " + ", ".join(f"{r['K']}x{r['N']} M={r['M']}" for r in short) if short else ""))
    if args.sweep:
        print("\nsplit_k sweep (us): " + " | ".join(
            f"{r['K']}x{r['N']} M={r['M']}: " + " ".join(f"{s}:{r[f'split{s}_us']:.1f}" for s in (1, 2, 4, 8))
            for r in rows))
    print("accuracy at M=16 (mean|C-ref|/mean|ref| vs fp32): " + " | ".join(
        f"{r['K']}x{r['N']}: " + ", ".join(f"{k} {v:.2e}" for k, v in r["errors_m16"].items())
        for r in rows if r["M"] == rows[0]["M"]))


if __name__ == "__main__":
    main()
