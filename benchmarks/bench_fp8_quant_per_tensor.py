"""Per-tensor FP8 quant, dynamic (two passes: abs-max, then cast; scale stays on the GPU) and static:
cublade's kernels vs vLLM's scaled_fp8_quant (dynamic: scale=None; static: the scale given).

Bytes counted once: M*K*elem read + M*K written (+4); the dynamic path really reads the tensor twice (the
two-pass floor at 16384 x 8192 bf16 is (2*268 + 134) MB / 4.28 TB/s = 157 us). The bytes and scale are compared
with the reference (fp8_quant_per_tensor_ref) and with vLLM's in the same run.
    python benchmarks/bench_fp8_quant_per_tensor.py
"""
from __future__ import annotations

import torch

from common import Row, bench_us, emit, header, require_gpu, vllm_ops


def main() -> None:
    require_gpu()
    from cublade.ops.fp8_quant_per_tensor import fp8_quant_per_tensor_ref  # noqa: PLC0415  (loads cublade._C)

    vops, vver = vllm_ops()
    header("fp8_quant_per_tensor", vver)
    op = torch.ops.cublade.fp8_quant_per_tensor
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = [(M, 8192, torch.bfloat16) for M in (1, 16, 256, 4096, 16384)]
    cases += [(16384, 14336, torch.bfloat16), (16384, 8192, torch.float16), (16384, 8192, torch.float32)]
    for M, K, dt in cases:
        x = torch.randn(M, K, device="cuda", dtype=torch.float32, generator=g).to(dt)
        scale = torch.tensor([0.01], device="cuda")
        nbytes = M * K * x.element_size() + M * K + 4
        for kind, args, vargs in (("dynamic", (x, None), (x,)), ("static", (x, scale), (x, scale))):
            q, s = op(*args)
            rq, rs = fp8_quant_per_tensor_ref(*args)
            same = torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
            note = "; bytes == reference" if same else (
                f"; DIFFERS from the reference: {(q.view(torch.uint8) != rq.view(torch.uint8)).sum().item()} bytes")
            if vops is not None:
                vq, vs = vops.scaled_fp8_quant(*vargs)
                same = torch.equal(q.view(torch.uint8), vq.view(torch.uint8)) and torch.equal(s, vs.reshape(1))
                note += ", == vLLM" if same else (
                    f", DIFFERS from vLLM: {(q.view(torch.uint8) != vq.view(torch.uint8)).sum().item()} bytes")
            for graph in ([False, True] if M <= 256 else [False]):
                cub = bench_us(lambda: op(*args), graph=graph)
                base = bench_us(lambda: vops.scaled_fp8_quant(*vargs), graph=graph) if vops is not None else None
                emit(Row(f"fp8_quant_per_tensor {kind}", f"{M}x{K} {str(dt)[6:]}", cub,
                         f"vLLM scaled_fp8_quant {kind}", base, nbytes, ("graph" if graph else "eager") + note))


if __name__ == "__main__":
    main()
