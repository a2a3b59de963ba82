"""MXFP8 quant (both scale rules) and dequant: cublade's kernels vs the PyTorch reference run on the GPU
(vLLM 0.26 has no MXFP8 activation-quant op for Hopper to compare with; the baseline is named as such).

Bytes: quant M*K*elem read + M*K + M*K/32 written; dequant M*K + M*K/32 read + M*K*2 (bf16) written.
    python benchmarks/bench_mxfp8_quant.py
"""
from __future__ import annotations

import torch

from common import Row, bench_us, emit, header, require_gpu, vllm_ops


def main() -> None:
    require_gpu()
    from cublade.ops.mxfp8_quant import mxfp8_dequant_ref, mxfp8_quant_ref  # noqa: PLC0415  (loads cublade._C)

    _, vver = vllm_ops()
    header("mxfp8_quant / mxfp8_dequant", vver)
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = [(M, 8192, torch.bfloat16) for M in (1, 16, 256, 4096, 16384)]
    cases += [(16384, 14336, torch.bfloat16), (16384, 8192, torch.float32)]
    for M, K, dt in cases:
        x = torch.randn(M, K, device="cuda", dtype=torch.float32, generator=g).to(dt)
        graph_modes = [False, True] if M <= 256 else [False]
        for rule in ("rceil", "floor"):
            rceil = rule == "rceil"
            nbytes = M * K * x.element_size() + M * K + M * K // 32
            for graph in graph_modes:
                cub = bench_us(lambda: torch.ops.cublade.mxfp8_quant(x, rceil), graph=graph)
                base = bench_us(lambda: mxfp8_quant_ref(x, rule), graph=graph) if M * K <= 2**27 else None
                emit(Row(f"mxfp8_quant {rule}", f"{M}x{K} {str(dt)[6:]}", cub, "torch reference (GPU, eager ops)",
                         base, nbytes, "graph" if graph else "eager"))
        q, c = torch.ops.cublade.mxfp8_quant(x, True)
        nbytes = M * K + M * K // 32 + M * K * 2
        for graph in graph_modes:
            cub = bench_us(lambda: torch.ops.cublade.mxfp8_dequant(q, c, torch.bfloat16), graph=graph)
            base = bench_us(lambda: mxfp8_dequant_ref(q, c, torch.bfloat16), graph=graph) if M * K <= 2**27 else None
            emit(Row("mxfp8_dequant -> bf16", f"{M}x{K}", cub, "torch reference (GPU, eager ops)", base, nbytes,
                     "graph" if graph else "eager"))


if __name__ == "__main__":
    main()
