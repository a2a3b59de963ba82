"""w4a16_dequant, the W4A16 prefill path's first half (the repacked int4 blob -> the dense bf16 weight [N, K], which
one cuBLAS GEMM then multiplies): cublade's kernel against a device-to-device copy of the same bytes, the ceiling a
memory-bound op can reach.

Shapes K x N (Llama-3-8B qkv, gate_up, down; Llama-3-70B gate_up, down): 4096x6144, 4096x28672, 14336x4096,
8192x57344, 28672x8192; int4, group 128, symmetric (w4a16_repack of random nibbles and scales), bf16 out. Bytes:
the blob read (weights and scale records) + N*K*2 written. Baseline: a copy of half those bytes (read + written:
the same traffic). Eager timings (do_bench, L2 cleared). The output is checked bit for bit against
w4a16_dequant_ref where the weight has at most 2^27 elements (the fp32 reference of the larger ones is left out).
    python benchmarks/bench_w4a16_dequant.py [--shapes 4096x6144,8192x57344]
"""
from __future__ import annotations

import argparse

import torch

from common import Row, bench_us, emit, header, require_gpu

G = 128
SHAPES = "4096x6144,4096x28672,14336x4096,8192x57344,28672x8192"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="KxN list")
    args = ap.parse_args()

    require_gpu()
    from cublade.ops.w4a16_dequant import w4a16_dequant_ref  # noqa: PLC0415  (loads cublade._C)
    from cublade.ops.w4a16_gemm import w4a16_repack  # noqa: PLC0415

    header("w4a16_dequant (int4 g128 sym -> bf16)", None)
    op = torch.ops.cublade.w4a16_dequant
    dev = torch.device("cuda")
    for shape in args.shapes.split(","):
        K, N = (int(v) for v in shape.split("x"))
        g = torch.Generator(device=dev).manual_seed(0)
        wp = torch.randint(-2**31, 2**31, (N, K // 8), dtype=torch.int32, device=dev, generator=g)
        ws = (torch.rand(N, K // G, device=dev, generator=g) * 0.01 + 0.002).to(torch.bfloat16)
        packed = w4a16_repack(wp, ws, None, G).packed
        del wp, ws
        read, written = packed.numel() * packed.element_size(), N * K * 2
        note = "eager"
        if N * K <= 2**27:
            same = torch.equal(op(packed, G, True, N, K, torch.bfloat16),
                               w4a16_dequant_ref(packed, G, True, N, K, torch.bfloat16))
            note += "; bits == w4a16_dequant_ref" if same else "; DIFFERS from w4a16_dequant_ref"
        cub = bench_us(lambda: op(packed, G, True, N, K, torch.bfloat16))
        src = torch.empty((read + written) // 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        copy = bench_us(lambda: dst.copy_(src))
        del src, dst
        gbps = (read + written) / (cub * 1e-6) / 1e9
        copy_gbps = (read + written) / (copy * 1e-6) / 1e9
        note += f"; {gbps:.0f} GB/s, copy {copy_gbps:.0f} GB/s ({100 * gbps / copy_gbps:.0f}%)"
        emit(Row("w4a16_dequant g128 -> bf16", f"{K}x{N}", cub, "d2d copy, same bytes", copy, read + written, note))
        del packed
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
