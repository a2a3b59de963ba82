"""moe_glue's silu_mul (the MoE layer's activation between w13 and w2): cublade's kernel vs vLLM's silu_and_mul
and torch's `F.silu(h[:, :I]) * h[:, I:]` (the two ops cublade's kernel is bit-exact to; vLLM's rounds once, so its
bytes differ).

Sizes: Mixtral's I = 14336 at 1 / 16 / 256 / 4096 tokens x top-2 rows, bf16. Bytes: 2 M I read + M I written, x2
bytes. Eager timings (do_bench, L2 cleared) for every size; CUDA-graph replay (how vLLM runs decode) up to 32 rows.
Baseline column: vLLM's op when importable, else torch's two ops; torch's two ops are timed in the note either way.
    python benchmarks/bench_moe_glue.py
"""
from __future__ import annotations

import torch

from common import Row, bench_us, emit, header, require_gpu, vllm_ops


def main() -> None:
    require_gpu()
    from cublade.ops.moe_glue import silu_mul_ref  # noqa: PLC0415  (loads cublade._C)

    vops, vver = vllm_ops()
    vllm_silu = getattr(torch.ops._C, "silu_and_mul", None) if vops is not None else None
    header("silu_mul", vver)
    op = torch.ops.cublade.silu_mul
    I = 14336
    for M in (2, 32, 512, 8192):
        h = torch.randn(M, 2 * I, device="cuda").to(torch.bfloat16)
        nbytes = 3 * M * I * 2
        assert torch.equal(op(h), silu_mul_ref(h)), "silu_mul differs from F.silu(h1) * h3"
        out = torch.empty(M, I, device="cuda", dtype=torch.bfloat16)
        for graph in ([False, True] if M <= 32 else [False]):
            cub = bench_us(lambda: op(h), graph=graph)
            two_ops = bench_us(lambda: silu_mul_ref(h), graph=graph)
            if vllm_silu is not None:
                base, name = bench_us(lambda: vllm_silu(out, h), graph=graph), "vLLM silu_and_mul"
            else:
                base, name = two_ops, "torch F.silu * mul"
            note = ("graph" if graph else "eager") + f"; torch two ops {two_ops:.1f} us; bytes == torch's two ops"
            emit(Row("silu_mul", f"{M}x{2 * I} bf16", cub, name, base, nbytes, note))


if __name__ == "__main__":
    main()
