"""How much does the grouped FP4 GEMM's max_m (the bound on any expert's rows, which picks the tokens per pass: 8 /
16 / 32) cost at MoE decode? (ninth session)

    python benchmarks/tuning/experiments/fp4_moe_maxm.py

The MoE method passes max_m = T (no expert can have more rows than tokens), which at T = 16 runs 16-token passes
although a balanced top-2 over 8 experts gives ~4 rows an expert. This times, for Mixtral's w13 / w2 and T tokens
routed top-2 at random, max_m = the true largest count, 2 x the mean (ceil(2 T k / E)), and T; us of do_bench (L2
flushed) and of CUDA-graph replay. Each output is checked against the fp32 reference experts.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_fp4_gemm import expert_offsets, random_fp4, random_routing  # noqa: E402
from common import bench_us, rel_err, require_op  # noqa: E402


def main() -> None:
    op = require_op("fp4_moe_maxm", "fp4_gemm")
    for K, N in [(4096, 28672), (14336, 4096)]:
        one_shape(op, K, N)
        torch.cuda.empty_cache()


def one_shape(op, K: int, N: int) -> None:
    from cublade.ops.fp4_gemm import fp4_dequant_repacked, fp4_repack

    dev, fmt, E, k = torch.device("cuda"), "mxfp4", 8, 2
    torch.manual_seed(0)
    t = random_fp4(E, N, K, fmt, dev)
    rp = fp4_repack(t["weight_packed"], t["weight_scale"], fmt, t.get("weight_global_scale"))
    w32 = fp4_dequant_repacked(rp.packed, rp.row_scale, fmt, N, K)
    for T in (4, 8, 16, 32, 64):
        counts = torch.bincount(random_routing(E, T, k, seed=T), minlength=E)
        offs = expert_offsets(counts, dev)
        x = torch.randn(T * k, K, device=dev).to(torch.bfloat16)
        o = offs.tolist()
        ref = torch.cat([x[o[e]:o[e + 1]].float() @ w32[e].t() for e in range(E)])
        line = []
        for name, mm in (("true", int(counts.max())), ("2x mean", -(-2 * T * k // E)), ("T", T)):
            assert rel_err(op(x, rp.packed, rp.row_scale, fmt, N, offs, mm), ref) < 1e-2
            a = bench_us(lambda: op(x, rp.packed, rp.row_scale, fmt, N, offs, mm), rep_ms=100)
            b = bench_us(lambda: op(x, rp.packed, rp.row_scale, fmt, N, offs, mm), graph=True, rep_ms=100)
            line.append(f"{name} (max_m {mm:2d}) {a:6.1f} / {b:6.1f}")
        print(f"{K}x{N} T={T:<3} max count {int(counts.max()):2d}: " + "   ".join(line), flush=True)


if __name__ == "__main__":
    main()
