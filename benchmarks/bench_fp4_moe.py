"""Benchmark cublade's FP4 MoE kernel against vLLM's fused Marlin MoE and a bf16 loop over the dequantized experts,
one vLLM FusedMoE layer per kernel, same weights.

    python benchmarks/bench_fp4_moe.py [--fmt mxfp4,nvfp4] [--tokens 1,16,64,256,1024,4096] [--graph] [--json FILE]

The layer: Mixtral-8x7B's MoE block (8 experts, top-2, hidden 4096, intermediate 14336), bf16 activations, random
FP4 codes and realistic block scales (as bench_fp4_gemm.py), built as tests/moe/test_moe_vllm.py builds its layers
(vLLM's FusedMoE with cublade's CubladeFp4MoEMethod) once per kernel, the other kernel disabled through
CUBLADE_DISABLED_KERNELS. Timed: the method's apply() (w13 GEMM, SiLU-and-mul, w2 GEMM, the top-k weighted sum)
for T tokens routed by a fixed random top-2; median of triton.testing.do_bench (L2 cleared before each call).
The bf16 baseline: the experts dequantized once (cublade.ops.fp4_gemm.fp4_dequant_repacked, exact) to bf16, then
per expert x[rows] @ w13^T, SiLU-and-mul, @ w2^T, weighted into the output (what a dequantize-then-matmul MoE does;
host-side row selection). Marlin needs vLLM's `_moe_C` extension; where vLLM lacks it (the device machine's staged
vLLM does) its column says so. --graph adds both kernels' apply() replayed from a CUDA graph (do_bench_cudagraph:
launch gaps gone, inputs L2-resident), as vLLM runs decode batches; the bf16 loop syncs with the host and has none.
Accuracy: mean|a - b|/mean|b| of cublade's output against the bf16 loop's.
Needs vLLM (../shared/device/README.md) and a GPU.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch

from common import bench_us, rel_err, write_json

bench = functools.partial(bench_us, rep_ms=100)  # median us, do_bench's 100 ms window
E, TOPK, H, I = 8, 2, 4096, 14336
KERNELS = ("cublade-fp4-moe", "vllm-marlin-moe")


def build(cfg, fmt: str, kernel: str):
    """A FusedMoE layer with random FP4 experts (seeded: the same weights for every kernel) on `kernel`, or None
    (with the reason printed) when the layer cannot run it here."""
    from vllm.config import set_current_vllm_config

    from cublade.config.schemes import FP4Scheme
    from test_moe_vllm import make_layer

    os.environ["CUBLADE_DISABLED_KERNELS"] = ",".join(k for k in KERNELS if k != kernel)
    with torch.device("cuda"):
        layer = make_layer(cfg, FP4Scheme(format=fmt), dtype=torch.bfloat16, hidden=H, inter=I)
    moe = layer.routed_experts
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, p in moe.named_parameters():
        if name.endswith("weight_packed"):
            p.data.copy_(torch.randint(0, 256, p.shape, generator=g, device="cuda", dtype=torch.uint8))
        elif name.endswith("weight_global_scale"):
            p.data.fill_(1e-4)
        elif name.endswith("weight_scale") and fmt == "mxfp4":
            p.data.copy_(torch.randint(117, 123, p.shape, generator=g, device="cuda", dtype=torch.uint8))
        elif name.endswith("weight_scale"):
            p.data.copy_((torch.rand(p.shape, generator=g, device="cuda") * 200 + 20).to(p.dtype))
    with set_current_vllm_config(cfg):
        moe.quant_method.process_weights_after_loading(moe)  # no tensors came through the loader: no checks
    got = moe.quant_method.kernel.name
    if got != kernel:
        print(f"{fmt}: {kernel} cannot run here (the layer chose {got}; vLLM's log above says why)")
        return None
    return layer, moe


def bf16_loop(moe, fmt: str):
    """The bf16 baseline from a cublade-built layer's repacked experts: apply(x, w, ids) like the kernels'."""
    import torch.nn.functional as F

    from cublade.ops.fp4_gemm import fp4_dequant_repacked

    def dense(w, N, K):
        rs = getattr(moe, f"{w}_fp4_row_scale", None)
        return fp4_dequant_repacked(getattr(moe, f"{w}_fp4_packed"), rs, fmt, N, K).to(torch.bfloat16)

    w13, w2 = dense("w13", 2 * I, H), dense("w2", H, I)

    def apply(x, w, ids):
        y = torch.zeros(x.shape[0], H, device=x.device, dtype=torch.float32)
        for e in range(E):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel():
                h = x[tok] @ w13[e].t()
                a = F.silu(h[:, :I]) * h[:, I:]
                y.index_add_(0, tok, (a @ w2[e].t()).float() * w[tok, slot, None])
        return y.to(x.dtype)

    return apply


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fmt", default="mxfp4,nvfp4")
    ap.add_argument("--tokens", default="1,16,64,256,1024,4096", help="batch sizes T (default 1,16,64,256,1024,4096)")
    ap.add_argument("--graph", action="store_true", help="also time the kernels' apply() from a CUDA graph")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:
        import vllm
    except ImportError as e:
        sys.exit(f"bench_fp4_moe: needs vLLM ({e}); stage it first (../shared/device/README.md)")
    if not torch.cuda.is_available():
        sys.exit("bench_fp4_moe: needs a CUDA GPU")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "moe"))
    from test_moe_vllm import init_vllm_cuda, softmax_topk

    cfg = init_vllm_cuda()
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for fmt in args.fmt.split(","):
        g = torch.Generator().manual_seed(1)
        inputs = {}
        for T in tokens:
            x = torch.randn(T, H, generator=g).to(torch.bfloat16)
            w, ids = softmax_topk(x, torch.randn(T, E, generator=g), TOPK, True)
            inputs[T] = (x.cuda(), w.cuda(), ids.cuda())
        times, outs = {}, {}
        for kernel in KERNELS:
            built = build(cfg, fmt, kernel)
            if built is None:
                continue
            layer, moe = built
            runs = {kernel: lambda x, w, ids, moe=moe: moe.quant_method.apply(moe, x, w, ids, None, None)}
            if kernel == KERNELS[0]:
                runs["bf16"] = bf16_loop(moe, fmt)
            for name, run in runs.items():
                for T, (x, w, ids) in inputs.items():
                    fn = functools.partial(run, x, w, ids)
                    outs[name, T] = fn().float()
                    times[name, T] = bench(fn)
                    if args.graph and name != "bf16":
                        times[name, "graph", T] = bench(fn, graph=True)
            del layer, moe, runs
            torch.cuda.empty_cache()
        for T in tokens:
            r = {"fmt": fmt, "E": E, "top_k": TOPK, "H": H, "I": I, "T": T,
                 "cublade_us": times[KERNELS[0], T], "marlin_us": times.get((KERNELS[1], T)),
                 "bf16_us": times["bf16", T], "rel_err_vs_bf16": rel_err(outs[KERNELS[0], T], outs["bf16", T]),
                 "cublade_graph_us": times.get((KERNELS[0], "graph", T)),
                 "marlin_graph_us": times.get((KERNELS[1], "graph", T))}
            rows.append(r)
            print(json.dumps(r), flush=True)
    write_json(args.json, rows, vllm=vllm.__version__)
    print(f"\nGPU {torch.cuda.get_device_name()}, torch {torch.__version__}, vLLM {vllm.__version__}")
    print(f"FP4 MoE layer (E={E}, top-{TOPK}, H={H}, I={I}), apply(): median us (do_bench, L2 cleared); "
          "Marlin = vLLM's fused_marlin_moe (nan: not available); bf16 = the dequantized experts' loop; "
          "err = mean|cublade - bf16| / mean|bf16|")
    print(f"{'fmt':>5} {'T':>5} {'cublade':>9} {'Marlin':>9} {'Marlin/cublade':>14} {'bf16':>9} {'bf16/cublade':>12} "
          f"{'err':>8} {'cublade graph':>13} {'Marlin graph':>12}")
    for r in rows:
        m = r["marlin_us"] or float("nan")
        print(f"{r['fmt']:>5} {r['T']:>5} {r['cublade_us']:>9.1f} {m:>9.1f} {m / r['cublade_us']:>13.2f}x "
              f"{r['bf16_us']:>9.1f} {r['bf16_us'] / r['cublade_us']:>11.2f}x {r['rel_err_vs_bf16']:>8.1e} "
              f"{r['cublade_graph_us'] or float('nan'):>13.1f} {r['marlin_graph_us'] or float('nan'):>12.1f}")


if __name__ == "__main__":
    main()
