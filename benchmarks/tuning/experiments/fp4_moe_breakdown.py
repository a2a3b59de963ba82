"""Where the time of cublade's FP4 MoE layer goes, kernel by kernel (tenth session).

    python benchmarks/tuning/experiments/fp4_moe_breakdown.py

The sequence of CubladeFp4MoE.apply (plugin/vllm/moe.py) without vLLM: moe_route, fp4_gemm (w13), silu_mul, fp4_gemm
(w2), moe_finalize, on Mixtral's shapes (8 experts, top-2, H 4096, I 14336; random MXFP4 experts, random routing),
at 256 and 4096 tokens. Prints the whole sequence's median time (do_bench, L2 cleared) and, from torch.profiler over
10 runs, each CUDA kernel's mean time per run.
"""
from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_fp4_gemm import random_fp4, random_routing  # noqa: E402
from common import bench_us, require_op  # noqa: E402

E, K_TOP, H, I = 8, 2, 4096, 14336


def main() -> None:
    from cublade.ops.fp4_gemm import fp4_gemm, fp4_repack
    from cublade.ops.moe_glue import moe_finalize, moe_route, silu_mul

    require_op("fp4_moe_breakdown", "fp4_gemm")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    w13 = random_fp4(E, 2 * I, H, "mxfp4", dev)
    w2 = random_fp4(E, H, I, "mxfp4", dev)
    r13 = fp4_repack(w13["weight_packed"], w13["weight_scale"], "mxfp4")
    r2 = fp4_repack(w2["weight_packed"], w2["weight_scale"], "mxfp4")
    del w13, w2
    for T in (256, 4096):
        x = (torch.randn(T, H, device=dev) * 0.5).to(torch.bfloat16)
        ids = random_routing(E, T, K_TOP, seed=T).reshape(T, K_TOP).to(torch.int32).to(dev)
        w = torch.rand(T, K_TOP, device=dev)
        max_m = min(T, -(-2 * T * K_TOP // E))

        def layer():
            xs, offsets, pos = moe_route(ids, x, E)
            h = fp4_gemm(xs, r13.packed, r13.row_scale, "mxfp4", 2 * I, offsets, max_m)
            y = fp4_gemm(silu_mul(h), r2.packed, r2.row_scale, "mxfp4", H, offsets, max_m)
            return moe_finalize(y, pos, w)

        total = bench_us(layer)
        layer()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                layer()
            torch.cuda.synchronize()
        per = collections.defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name] += e.device_time / 10
        print(f"\nT = {T}: layer {total:.1f} us (do_bench); kernels, us per run (profiler, no L2 clearing):")
        for name, us in sorted(per.items(), key=lambda kv: -kv[1]):
            print(f"  {us:9.1f}  {name[:110]}")
        print(f"  {sum(per.values()):9.1f}  total")


if __name__ == "__main__":
    main()
