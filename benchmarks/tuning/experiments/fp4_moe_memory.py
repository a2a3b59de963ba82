"""Peak GPU memory of one FP4 MoE layer call (eleventh session): cublade's apply as it is (each intermediate dropped
once used), the same apply with the routed rows and w13's output held to the end of the call (as it ran before,
602025a), and vLLM's fused Marlin MoE. Mixtral size (8 experts, top-2, H 4096, I 14336), MXFP4, random routing.

    python benchmarks/tuning/experiments/fp4_moe_memory.py [--tokens 1024,4096,8192]

Needs vLLM (staged on the device). Peak = torch.cuda.max_memory_allocated during the call less what was allocated
before it (weights and inputs excluded), in MiB.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "moe"))
from bench_fp4_moe import E, H, KERNELS, TOPK, build  # noqa: E402


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


@contextlib.contextmanager
def held_intermediates():
    """moe_route's outputs and silu_mul's input stay referenced until the block ends (apply looks both up at call
    time, so it gets these wrappers)."""
    import cublade.ops.moe_glue as glue

    held, route, silu = [], glue.moe_route, glue.silu_mul

    def route_held(*a):
        held.append(route(*a))
        return held[-1]

    def silu_held(h):
        held.append(h)
        return silu(h)

    glue.moe_route, glue.silu_mul = route_held, silu_held
    try:
        yield
    finally:
        glue.moe_route, glue.silu_mul = route, silu
        held.clear()


def measure(cfg, kernel: str, inputs: dict) -> dict:
    """{(kernel, T): peak MiB} and, for cublade's kernel, {("held", T): ...} with the intermediates held."""
    built = build(cfg, "mxfp4", kernel)
    if built is None:
        return {}
    _, moe = built
    rows = {}
    for T, (x, w, ids) in inputs.items():
        def call(x=x, w=w, ids=ids):
            return moe.quant_method.apply(moe, x, w, ids, None, None)
        call()  # warm-up (workspaces, lazy init)
        rows[kernel, T] = peak_mib(call)
        if kernel == KERNELS[0]:
            with held_intermediates():
                rows["held", T] = peak_mib(call)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1024,4096,8192")
    args = ap.parse_args()
    from test_moe_vllm import init_vllm_cuda, softmax_topk

    cfg = init_vllm_cuda()
    g = torch.Generator().manual_seed(1)
    inputs = {}
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        w, ids = softmax_topk(x, torch.randn(T, E, generator=g), TOPK, True)
        inputs[T] = (x.cuda(), w.cuda(), ids.cuda())
    rows = {}
    for kernel in KERNELS:
        rows.update(measure(cfg, kernel, inputs))
        torch.cuda.empty_cache()  # the kernel's layer is gone with measure's frame
    print("FP4 MoE layer (E 8, top-2, H 4096, I 14336, mxfp4): peak MiB allocated during one apply()")
    print(f"{'T':>6} {'cublade':>9} {'held (602025a)':>15} {'Marlin MoE':>11}")
    nan = float("nan")
    for T in inputs:
        print(f"{T:>6} {rows.get((KERNELS[0], T), nan):>9.1f} {rows.get(('held', T), nan):>15.1f} "
              f"{rows.get((KERNELS[1], T), nan):>11.1f}")


if __name__ == "__main__":
    main()
