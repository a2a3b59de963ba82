"""Where should the W4A16 and MXFP8 ops switch from their kernels to the prefill path (dequantize the weight, then
cuBLAS)? The ops switch at w4a16_gemm_prefill_rows / mxfp8_gemm_prefill_rows (plugin/csrc/w4a16_gemm.h), set from
this script's measurements (docs/decisions.md, "Prefill switch").

    python benchmarks/tuning/prefill_switch.py [--ops int4,mxfp8] [--shapes 8192x28672,...] [--m 256,384,512,1024]

For each op, shape and M this times, in one process, median us of triton's do_bench (L2 flushed before every call):
  kernels   the op on successive slices of 256 rows, the passes its launcher makes below the
            switch (each slice is one call of the op, which runs its wide kernel there), then the last slice's rows;
  prefill   the op's prefill path: the dequant op to bf16 and torch's linear (what the op runs from the switch);
  op        the op on all M rows, as it chooses (the switch as built);
the ratio kernels / prefill (< 1: the kernels are faster), and op / the faster of the two (1.00: the switch chose well
at this point; the two paths are timed apart, so about 1 +- 0.03 is a tie). Each op's outputs on the kernel path are
checked against the prefill path's at M = 256 (mean |difference| / mean |prefill| under 4e-3: MXFP8 multiplies the same exact
weights on both; int4's prefill path rounds the scaled weights to bf16, ~2e-3 against the exact product).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import bench_us, rel_err, require_op  # noqa: E402

# rows per wide pass: int4 with bf16 x at group size 128 runs rounded passes of up to 256 (wide::kRoundedPassRows, from
# 160 rows left), MXFP8 passes of 256 from 192 rows left (wide::kMxfp8LargePassRows), so slices of 256 run what one
# call of the op would
PASS = {"int4": 256, "mxfp8": 256}


def int4_case(K: int, N: int, dev):
    from cublade.ops.w4a16_gemm import w4a16_repack

    wp = torch.randint(-2**31, 2**31, (N, K // 8), dtype=torch.int32, device=dev)
    ws = (torch.rand(N, K // 128, device=dev) * 0.01 + 0.002).to(torch.bfloat16)
    rp = w4a16_repack(wp, ws, None, 128)
    op, dequant = torch.ops.cublade.w4a16_gemm, torch.ops.cublade.w4a16_dequant
    kernel = lambda x: op(x, rp.packed, 128, True, N)  # noqa: E731
    prefill = lambda x: torch.nn.functional.linear(x, dequant(rp.packed, 128, True, N, K, x.dtype))  # noqa: E731
    return kernel, prefill


def mxfp8_case(K: int, N: int, dev):
    from cublade.ops.mxfp8_gemm import mxfp8_dequant_packed, mxfp8_repack

    q, codes = torch.ops.cublade.mxfp8_quant((torch.randn(N, K, device=dev) * 0.02).to(torch.bfloat16), True)
    packed = mxfp8_repack(q, codes)
    kernel = lambda x: torch.ops.cublade.mxfp8_gemm(x, packed, N, 0)  # noqa: E731
    prefill = lambda x: torch.nn.functional.linear(x, mxfp8_dequant_packed(packed, N, K))  # noqa: E731
    return kernel, prefill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="int4,mxfp8", help="which ops: int4, mxfp8")
    ap.add_argument("--shapes", default="8192x28672,4096x14336,28672x8192,8192x10240,4096x6144,4096x4096,4096x28672,"
                    "14336x4096", help="KxN list (Llama-3-70B's and Llama-3-8B's layers)")
    ap.add_argument("--m", default="192,256,320,384,448,512,640,768,1024", help="token counts")
    args = ap.parse_args()
    require_op("prefill_switch", "w4a16_gemm")
    require_op("prefill_switch", "mxfp8_gemm")
    dev = torch.device("cuda")
    print(f"{'op':>6} {'K x N':>12} {'M':>5} {'kernels':>9} {'prefill':>9} {'ratio':>6} {'op':>9} {'op/best':>7}")
    cases = {"int4": int4_case, "mxfp8": mxfp8_case}
    for name, case in ((n, cases[n]) for n in args.ops.split(",")):
        for shape in args.shapes.split(","):
            K, N = (int(v) for v in shape.split("x"))
            torch.manual_seed(0)
            kernel, prefill = case(K, N, dev)
            step = PASS[name]
            passes = lambda x: [kernel(x[i:i + step]) for i in range(0, x.shape[0], step)]  # noqa: E731
            x = torch.randn(256, K, device=dev).to(torch.bfloat16)
            err = rel_err(torch.cat(passes(x)), prefill(x).float())
            assert err < 4e-3, f"{name} {shape}: kernel path vs prefill path {err:.2e}"
            for M in (int(m) for m in args.m.split(",")):
                x = torch.randn(M, K, device=dev).to(torch.bfloat16)
                t_k = bench_us(lambda: passes(x), rep_ms=100)
                t_p = bench_us(lambda: prefill(x), rep_ms=100)
                t_o = bench_us(lambda: kernel(x), rep_ms=100)
                print(f"{name:>6} {K:>5}x{N:<6} {M:>5} {t_k:>9.1f} {t_p:>9.1f} {t_k / t_p:>6.2f} {t_o:>9.1f} "
                      f"{t_o / min(t_k, t_p):>7.2f}", flush=True)
            kernel = prefill = passes = None  # free the shape's weights before the next
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
