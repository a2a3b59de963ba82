"""Where does a grouped FP4 decode call lose its time? (ninth session)

    python benchmarks/tuning/experiments/fp4_grouped_diag.py [--fmt mxfp4] [--graph]

Mixtral expert sizes (w13 K=4096 N=28672, w2 K=14336 N=4096). For each: the dense call (one expert) at M = 1,
and grouped calls of T rows over E experts at every forced split_k, with

  * "E=8": the blob of 8 experts, rows routed to a few of them (the layer's call);
  * "E=act": a blob holding only the experts that have rows (same weights, same rows): what a grid over the
    active experts alone would cost.

Times: median us of do_bench (L2 cleared before each call) or of CUDA-graph replay (--graph). TB/s: FP4 + scale
bytes of the experts with rows. Every grouped output is checked against the fp32 reference experts
(mean |C - ref| / mean |ref| < 1e-2; the split count changes the fp32 summation order, so not bit-equal).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_fp4_gemm import expert_offsets, random_fp4, random_routing  # noqa: E402
from common import bench_us, rel_err, require_op  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fmt", default="mxfp4")
    ap.add_argument("--graph", action="store_true")
    args = ap.parse_args()
    from cublade.ops.fp4_gemm import fp4_dequant_repacked, fp4_repack

    op = require_op("fp4_gemm_diag", "fp4_gemm")
    dev = torch.device("cuda")
    fmt, E = args.fmt, 8
    bench = lambda f: bench_us(f, graph=args.graph, rep_ms=100)  # noqa: E731
    print(f"fmt {fmt}, {'CUDA graph' if args.graph else 'do_bench (L2 flushed)'}; us (TB/s)")
    for K, N in [(4096, 28672), (14336, 4096)]:
        torch.manual_seed(0)
        t = random_fp4(E, N, K, fmt, dev)
        rp = fp4_repack(t["weight_packed"], t["weight_scale"], fmt, t.get("weight_global_scale"))
        w32 = fp4_dequant_repacked(rp.packed, rp.row_scale, fmt, N, K)
        ebytes = N * K // 2 + N * K // (32 if fmt == "mxfp4" else 16)
        x1 = torch.randn(1, K, device=dev).to(torch.bfloat16)
        one_p = rp.packed[:1].contiguous()
        one_r = None if rp.row_scale is None else rp.row_scale[:1].contiguous()
        line = []
        for S in (0, 1, 2, 4, 8):
            us = bench(lambda: op(x1, one_p, one_r, fmt, N, None, 1, S))
            line.append(f"S={S} {us:6.1f} ({ebytes / us / 1e6:4.2f})")
        print(f"{K}x{N} dense M=1: " + "  ".join(line), flush=True)
        for T, experts in [(2, [3, 6]), (8, None), (32, None)]:
            ids = random_routing(E, T // 2, 2, seed=T) if experts is None else torch.tensor(experts)
            counts = torch.bincount(ids, minlength=E)
            act = [e for e in range(E) if counts[e] > 0]
            offs8, offsa = expert_offsets(counts, dev), expert_offsets(counts[act], dev)
            pa = rp.packed[act].contiguous()
            ra = None if rp.row_scale is None else rp.row_scale[act].contiguous()
            x = torch.randn(T, K, device=dev).to(torch.bfloat16)
            o = offs8.tolist()
            ref = torch.cat([x[o[e]:o[e + 1]].float() @ w32[e].t() for e in range(E)])
            mm = int(counts.max())
            nbytes = ebytes * len(act)
            for name, p, r, offs in (("E=8", rp.packed, rp.row_scale, offs8), ("E=act", pa, ra, offsa)):
                line = []
                for S in (0, 1, 2, 4, 8):
                    err = rel_err(op(x, p, r, fmt, N, offs, mm, S), ref)
                    assert err < 1e-2, (K, N, T, name, S, err)
                    us = bench(lambda: op(x, p, r, fmt, N, offs, mm, S))
                    line.append(f"S={S} {us:6.1f} ({nbytes / us / 1e6:4.2f})")
                print(f"{K}x{N} T={T:<3} {len(act)} active {name:>5}: " + "  ".join(line), flush=True)
        del t, rp, w32
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
