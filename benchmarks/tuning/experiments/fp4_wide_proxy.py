"""What would a wgmma kernel give FP4 experts at prefill sizes? A proxy measurement (ninth session).

    python benchmarks/tuning/experiments/fp4_wide_proxy.py

FP4 experts run on the streaming kernel at every batch size (32 tokens per pass, each pass re-reading the
weights). W4A16 with per-channel scales runs, from 17 rows, on the wgmma ("wide") kernel, whose consumers
dequantize much like FP4's (a LOP3 and one packed bf16 op per two weights, no group fold) and accumulate straight
into acc as an FP4 version would. So the int4 per-channel op on one expert's shape is a proxy for an FP4 wide
kernel (FP4's scale records add ~9% bytes). Times both on Mixtral's w13 (K 4096 x N 28672) and w2 (14336 x 4096)
at 16-256 rows: median us of do_bench (L2 flushed), same run.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_fp4_gemm import random_fp4  # noqa: E402
from common import bench_us, require_op  # noqa: E402


def main() -> None:
    from cublade.ops.fp4_gemm import fp4_repack
    from cublade.ops.int4 import int4_quant_weight
    from cublade.ops.w4a16_gemm import w4a16_repack

    fp4 = require_op("fp4_wide_proxy", "fp4_gemm")
    int4 = torch.ops.cublade.w4a16_gemm
    dev = torch.device("cuda")
    print(f"{'K x N':>12} {'M':>4} {'fp4 stream':>10} {'int4 wide':>10} {'stream/wide':>11}")
    for K, N in [(4096, 28672), (14336, 4096)]:
        torch.manual_seed(0)
        t = random_fp4(1, N, K, "mxfp4", dev)
        rp = fp4_repack(t["weight_packed"], t["weight_scale"], "mxfp4")
        q = int4_quant_weight(torch.randn(N, K, device=dev) * 0.02, group_size=-1)
        ip = w4a16_repack(q["weight_packed"], q["weight_scale"].to(torch.bfloat16), None, -1)
        for M in (16, 32, 64, 128, 256):
            x = torch.randn(M, K, device=dev).to(torch.bfloat16)
            a = bench_us(lambda: fp4(x, rp.packed, rp.row_scale, "mxfp4", N), rep_ms=100)
            b = bench_us(lambda: int4(x, ip.packed, -1, True, N, 0), rep_ms=100)
            print(f"{K:>5}x{N:<6} {M:>4} {a:>10.1f} {b:>10.1f} {a / b:>10.2f}x", flush=True)


if __name__ == "__main__":
    main()
