"""Benchmark FP8 W8A8 linear layers (per-channel E4M3 weights, per-token dynamic activations) on Hopper, every kernel
in the same run, as the product runs them:
  cublade-fp8-gemm        the layer's kernel class (cublade.vllm.kernels): activations quantized by cublade's op,
                          then cublade's fp8_gemm up to FP8_GEMM_MAX_ROWS tokens, vLLM's CUTLASS above
  cublade fp8_gemm        cublade's quantization (bf16 values) + fp8_gemm at every M (where it crosses CUTLASS)
  cublade fp8_gemm f16    the same with fp16 values: fp8_gemm's other decode (one conversion instruction per two
                          codes, fp16 mma's)
  vllm-cutlass-scaled-mm  cublade's quantization (E4M3) + vLLM's CUTLASS scaled-mm (what the layer ran before)
  torch-scaled-mm         cublade's quantization (E4M3) + torch._scaled_mm with row-wise scales (PyTorch's own FP8
                          GEMM on Hopper: one fp32 scale per token and per weight row, as CUTLASS's)
  cublade fp8_gemm_wgmma  cublade's quantization (E4M3) + cublade's wgmma GEMM (cublade.ops.fp8_gemm_wgmma: FP8
                          tensor cores, the numerics of CUTLASS's) at every M
  vllm-humming-fp8        vLLM's Humming FP8 kernel (HummingFP8ScaledMMLinearKernel, needs humming-kernels) on the
                          same tensors
  bf16                    a bf16 linear of the dequantized weight (cuBLAS)
and the GEMM kernels alone (their activations quantized beforehand): "fp8_gemm only", "fp8_gemm f16 only",
"cutlass only", "torch scaled_mm only", "wgmma only", "wgmma unsplit only" (split_k=1: the batch-invariant form);
with
--splits, fp8_gemm alone at each of those K splits too ("fp8_gemm S=2": the split rule's tuning).

    python benchmarks/bench_fp8_gemm.py [--shapes 4096x6144,4096x4096,4096x28672,14336x4096]
                                        [--m 1,2,4,8,16,24,32,48,64,128] [--splits 1,2,4] [--graph] [--json FILE]
                                        [--only 'cutlass only,torch scaled_mm only']

--graph times each of them as one CUDA graph replay (common.graphed), as vLLM's decode runs them: no host launch gaps
between the quantization and the GEMM, so the layer rows are their kernels' GPU time (without it the layer rows,
launched from Python, can be host-bound), and fp8_gemm's start during the quantization (a programmatic dependent
launch) shows as it does in a decode step.

Times: median of triton.testing.do_bench (L2 cleared before every call: the weights come from HBM). TB/s: the weight
bytes (N*K) over the time. x = a kernel's time / cublade-fp8-gemm's (> 1: cublade faster). Accuracy at M=16:
mean|C-ref|/mean|ref| against the fp32 W8A8 reference (fp8_linear_ref in fp32). A kernel that cannot run here is
reported with its reason and left out.
"""
from __future__ import annotations

import argparse
import functools
import json

import torch

from common import (bench_us, graphed, humming_linear, print_kernel_table, rel_err, require_op, stand_in_layer,
                    vllm_single_process_state, write_json)

bench = functools.partial(bench_us, rep_ms=100)
OURS = "cublade-fp8-gemm"


def fp8_layer(w: torch.Tensor, ws: torch.Tensor) -> torch.nn.Module:
    """A stand-in layer of the fp8 scheme (per-channel weights, per-token dynamic activations) holding these tensors."""
    from cublade.config import Fp8Scheme

    return stand_in_layer({"weight": w, "weight_scale": ws}, Fp8Scheme("channel", "dynamic-token"), *w.shape)


def class_fn(name: str, w: torch.Tensor, ws: torch.Tensor):
    """(fn(x), None) for a kernel class of the fp8 scheme, or (None, why not)."""
    from cublade.config import Fp8Scheme
    from cublade.vllm import kernels

    cls = next(k for k in kernels.CANDIDATES[Fp8Scheme] if k.name == name)
    layer = fp8_layer(w, ws)
    ok, why = cls.can_implement(layer)
    if not ok:
        return None, why
    impl = cls(layer)
    return functools.partial(impl.apply, layer, bias=None), None


def humming_fn(w: torch.Tensor, ws: torch.Tensor):
    """(fn(x), None) for vLLM's Humming FP8 kernel on the checkpoint tensors, prepared as vLLM does, or (None, why)."""
    try:
        from vllm.model_executor.kernels.linear.scaled_mm.humming import HummingFP8ScaledMMLinearKernel
        from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import FP8ScaledMMLinearLayerConfig
        from vllm.model_executor.layers.quantization.utils.quant_utils import (kFp8DynamicTokenSym,
                                                                               kFp8StaticChannelSym)
    except ImportError as e:
        return None, f"vLLM's Humming FP8 kernel not importable ({e})"

    class Humming(HummingFP8ScaledMMLinearKernel):  # the layer's parameter names, as vLLM's fp8 layers pass them
        def __init__(self, c):
            super().__init__(c, ["weight", "weight_scale", "input_scale", "input_scale_ub"])

    N, K = w.shape
    layer = fp8_layer(w, ws.reshape(N, 1))
    layer.output_partition_sizes, layer.has_bias = [N], False
    cfg = FP8ScaledMMLinearLayerConfig(weight_quant_key=kFp8StaticChannelSym, activation_quant_key=kFp8DynamicTokenSym,
                                       input_dtype=torch.bfloat16, out_dtype=torch.bfloat16, weight_shape=(N, K))
    return humming_linear(Humming, cfg, layer, "FP8")


def torch_scaled_mm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws_row: torch.Tensor) -> torch.Tensor:
    """x @ w.T on PyTorch's FP8 GEMM with row-wise scales: xs (M, 1) per token, ws_row (1, N) per weight row."""
    return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws_row, out_dtype=torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x6144,4096x4096,4096x28672,14336x4096", help="KxN list")
    ap.add_argument("--m", default="1,2,4,8,16,24,32,48,64,128", help="token counts")
    ap.add_argument("--splits", default="", help="also time fp8_gemm alone at these K splits (tuning), e.g. 1,2,4")
    ap.add_argument("--only", default="",
                    help="time only these columns, comma-separated (e.g. 'cutlass only,torch scaled_mm only')")
    ap.add_argument("--graph", action="store_true",
                    help="time each callable as one CUDA graph replay (no host launch gaps; L2 still cleared)")
    ap.add_argument("--json", default=None, help="write all rows here")
    args = ap.parse_args()
    time_us = (lambda fn: bench(graphed(fn))) if args.graph else bench
    only = {n for n in args.only.split(",") if n}  # empty: every column

    require_op("bench_fp8_gemm", "fp8_gemm")
    vllm_single_process_state()
    from vllm import _custom_ops as vllm_ops

    from cublade.numerics.fp8 import fp8_quant_weight
    from cublade.ops.fp8_gemm import fp8_gemm
    from cublade.ops.fp8_gemm_wgmma import fp8_gemm_wgmma
    from cublade.ops.fp8_quant_per_token import (fp8_quant_per_token, fp8_quant_per_token_bf16,
                                                 fp8_quant_per_token_f16)

    dev = torch.device("cuda")
    rows, why_not = [], {}
    for shape in args.shapes.split(","):
        K, N = (int(v) for v in shape.split("x"))
        g = torch.Generator(device=dev).manual_seed(0)
        w, ws = fp8_quant_weight(torch.randn(N, K, device=dev, generator=g) * 0.02, per_channel=True)
        ws = ws.float().reshape(-1).contiguous()
        wbf = (w.float() * ws.reshape(-1, 1)).to(torch.bfloat16)
        fns = {}
        for name in (OURS, "vllm-cutlass-scaled-mm"):
            fn, why = class_fn(name, w, ws)
            if fn is None:
                why_not[name] = why
            else:
                fns[name] = fn
        hfn, why = humming_fn(w, ws)
        if hfn is None:
            why_not["vllm-humming-fp8"] = why
        else:
            fns["vllm-humming-fp8"] = hfn
        fns["cublade fp8_gemm"] = lambda x: fp8_gemm(*fp8_quant_per_token_bf16(x), w, ws)
        fns["cublade fp8_gemm f16"] = lambda x: fp8_gemm(*fp8_quant_per_token_f16(x), w, ws)
        ws_row = ws.reshape(1, -1)
        fns["torch-scaled-mm"] = lambda x: torch_scaled_mm(*fp8_quant_per_token(x), w, ws_row)
        fns["cublade fp8_gemm_wgmma"] = lambda x: fp8_gemm_wgmma(*fp8_quant_per_token(x), w, ws)
        fns["bf16"] = lambda x: torch.nn.functional.linear(x, wbf)
        x16 = (torch.randn(16, K, device=dev, generator=g) * 2).to(torch.bfloat16)
        xq16, xs16 = fp8_quant_per_token(x16)
        ref16 = (xq16.float() @ w.float().t()) * xs16 * ws.reshape(1, -1)
        errs = {name: rel_err(fn(x16), ref16) for name, fn in fns.items()}
        for M in (int(m) for m in args.m.split(",")):
            x = (torch.randn(M, K, device=dev, generator=g) * 2).to(torch.bfloat16)
            xv, xs = fp8_quant_per_token_bf16(x)
            xq, _ = fp8_quant_per_token(x)
            xh = xv.to(torch.float16)  # the same E4M3 values
            kernels_only = {
                "fp8_gemm only": lambda: fp8_gemm(xv, xs, w, ws),
                "fp8_gemm f16 only": lambda: fp8_gemm(xh, xs, w, ws),
                "cutlass only": lambda: vllm_ops.cutlass_scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws,
                                                                   out_dtype=torch.bfloat16),
                "torch scaled_mm only": lambda: torch_scaled_mm(xq, xs, w, ws_row),
                "wgmma only": lambda: fp8_gemm_wgmma(xq, xs, w, ws),
                "wgmma unsplit only": lambda: fp8_gemm_wgmma(xq, xs, w, ws, 1),
            }
            for S in (int(v) for v in args.splits.split(",") if v):
                kernels_only[f"fp8_gemm S={S}"] = functools.partial(fp8_gemm, xv, xs, w, ws, S)
            us = {name: time_us(functools.partial(fn, x)) for name, fn in fns.items() if not only or name in only}
            us.update({name: time_us(fn) for name, fn in kernels_only.items() if not only or name in only})
            r = {"K": K, "N": N, "M": M, "weight_bytes": N * K, "errors_m16": errs, "us": us, "graph": args.graph}
            rows.append(r)
            print(json.dumps(r), flush=True)
        w = ws = wbf = fns = None
        torch.cuda.empty_cache()

    write_json(args.json, rows, not_run=why_not)
    for name, why in why_not.items():
        print(f"not run: {name}: {why}")
    print_kernel_table(rows, OURS, "FP8 W8A8 linear (per-channel E4M3 weights, per-token activations)",
                       "the fp32 W8A8 reference")


if __name__ == "__main__":
    main()
