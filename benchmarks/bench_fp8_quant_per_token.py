"""Dynamic per-token FP8 quant: cublade's kernel vs vLLM's scaled_fp8_quant(use_per_token_if_dynamic=True).

Sizes: M in {1, 16, 256, 4096, 16384} x K in {4096, 8192, 14336}, bf16, plus fp16/fp32 at
16384 x 8192. Bytes: M*K*elem read + M*K written + 4*M (scales). Eager timings for every size; for M <= 256
also CUDA-graph replay (how vLLM runs decode: launch overhead removed, inputs L2-resident). The bytes are
compared with the reference (fp8_quant_per_token_ref) and with vLLM's in the same run (all three divide by the
scale: they must be equal).
    python benchmarks/bench_fp8_quant_per_token.py
"""
from __future__ import annotations

import torch

from common import Row, bench_us, emit, header, require_gpu, vllm_ops


def main() -> None:
    require_gpu()
    from cublade.ops.fp8_quant_per_token import fp8_quant_per_token_ref  # noqa: PLC0415  (loads cublade._C)

    vops, vver = vllm_ops()
    header("fp8_quant_per_token", vver)
    op = torch.ops.cublade.fp8_quant_per_token
    cases = [(M, K, torch.bfloat16) for M in (1, 16, 256, 4096, 16384) for K in (4096, 8192, 14336)]
    cases += [(16384, 8192, torch.float16), (16384, 8192, torch.float32)]
    g = torch.Generator(device="cuda").manual_seed(0)
    for M, K, dt in cases:
        x = torch.randn(M, K, device="cuda", dtype=torch.float32, generator=g).to(dt)
        nbytes = M * K * x.element_size() + M * K + 4 * M
        modes = [False, True] if M <= 256 else [False]
        q, s = op(x)
        rq, rs = fp8_quant_per_token_ref(x)
        same = torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
        note = "bytes == reference" if same else (
            f"DIFFERS from the reference: {(q.view(torch.uint8) != rq.view(torch.uint8)).sum().item()} bytes")
        if vops is not None:
            vq, vs = vops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
            same = torch.equal(q.view(torch.uint8), vq.view(torch.uint8)) and torch.equal(s, vs)
            note += ", == vLLM" if same else (
                f", DIFFERS from vLLM: {(q.view(torch.uint8) != vq.view(torch.uint8)).sum().item()} bytes")
        for graph in modes:
            cub = bench_us(lambda: op(x), graph=graph)
            base = None
            if vops is not None:
                base = bench_us(lambda: vops.scaled_fp8_quant(x, use_per_token_if_dynamic=True), graph=graph)
            emit(Row("fp8_quant_per_token", f"{M}x{K} {str(dt)[6:]}", cub, "vLLM scaled_fp8_quant per-token",
                     base, nbytes, ("graph" if graph else "eager") + f"; {note}"))


if __name__ == "__main__":
    main()
