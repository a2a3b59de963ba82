"""FP8 KV-cache write: cublade's kernel vs vLLM's reshape_and_cache_flash(kv_cache_dtype="fp8"), on vLLM
0.26's cache layout (one [num_blocks, block_size, H, 2*D] uint8 tensor split into K and V views), key/value
as views of a fused qkv projection output, scattered slots. Llama-8B-like heads: H = 8 KV heads, D = 128,
block 16, bf16. Bytes: 2*T*H*D*2 read + 2*T*H*D written + 8*T (slots). The caches written by both ops are
compared byte for byte in the same run.
Query-aware rows (K rounded against the token's Hq = 32 query heads, a view of the same qkv output): against
vLLM's op and against cublade's nearest-rounding write in the same run; bytes add the query (T*Hq*D*2). K is
compared with the reference (fp8_kv_cache_write_ref) where T <= 64.
    python benchmarks/bench_fp8_kv_cache_write.py
"""
from __future__ import annotations

import torch

from common import Row, bench_us, emit, header, require_gpu, vllm_ops

QA_CHECK_MAX_T = 64  # the CPU reference of the query-aware write is checked up to this many tokens


def main() -> None:
    require_gpu()
    from cublade.ops.fp8_kv_cache_write import fp8_kv_cache_write_ref  # noqa: PLC0415  (loads cublade._C)

    vops, vver = vllm_ops()
    header("fp8_kv_cache_write", vver)
    H, D, bs, Hq = 8, 128, 16, 32
    g = torch.Generator(device="cuda").manual_seed(0)
    for T in (1, 64, 4096, 16384):
        qkv = torch.randn(T, (Hq + 2 * H) * D, device="cuda", generator=g).to(torch.bfloat16)
        query = qkv[:, :Hq * D].view(T, Hq, D)
        key = qkv[:, Hq * D:(Hq + H) * D].view(T, H, D)
        value = qkv[:, (Hq + H) * D:].view(T, H, D)
        nb = max(64, 2 * T // bs)
        kv = torch.zeros(nb, bs, H, 2 * D, dtype=torch.uint8, device="cuda")
        kc, vc = kv[..., :D], kv[..., D:]
        slots = torch.randperm(nb * bs, device="cuda", generator=g)[:T]
        ks, vs = torch.tensor([0.02], device="cuda"), torch.tensor([0.05], device="cuda")
        nbytes = 2 * T * H * D * 2 + 2 * T * H * D + 8 * T
        note = ""
        if vops is not None:
            kv2 = torch.zeros_like(kv)
            torch.ops.cublade.fp8_kv_cache_write(key, value, kc, vc, slots, ks, vs)
            vops.reshape_and_cache_flash(key, value, kv2[..., :D], kv2[..., D:], slots, "fp8", ks, vs)
            n = (kv != kv2).sum().item()
            note = "; cache bytes == vLLM" if n == 0 else f"; DIFFERS from vLLM: {n} bytes"
        qa_bytes = nbytes + T * Hq * D * 2
        qa_note = ""
        if T <= QA_CHECK_MAX_T:
            ref = kv.cpu()
            torch.ops.cublade.fp8_kv_cache_write(key, value, kc, vc, slots, ks, vs, query)
            fp8_kv_cache_write_ref(key.cpu(), value.cpu(), ref[..., :D], ref[..., D:], slots.cpu(), ks.cpu(),
                                   vs.cpu(), query.cpu())
            n = (kv.cpu() != ref).sum().item()
            qa_note = "; cache bytes == reference" if n == 0 else f"; DIFFERS from the reference: {n} bytes"
        for graph in ([False, True] if T <= 256 else [False]):
            cub = bench_us(lambda: torch.ops.cublade.fp8_kv_cache_write(key, value, kc, vc, slots, ks, vs),
                           graph=graph)
            base = None
            if vops is not None:
                base = bench_us(lambda: vops.reshape_and_cache_flash(key, value, kc, vc, slots, "fp8", ks, vs),
                                graph=graph)
            emit(Row("fp8_kv_cache_write", f"T={T} H={H} D={D}", cub, "vLLM reshape_and_cache_flash fp8", base,
                     nbytes, ("graph" if graph else "eager") + note))
            qa = bench_us(lambda: torch.ops.cublade.fp8_kv_cache_write(key, value, kc, vc, slots, ks, vs, query),
                          graph=graph)
            size, mode = f"T={T} H={H} Hq={Hq} D={D}", "graph" if graph else "eager"
            emit(Row("fp8_kv_cache_write query-aware", size, qa, "vLLM reshape_and_cache_flash fp8", base,
                     qa_bytes, mode + qa_note))
            emit(Row("fp8_kv_cache_write query-aware", size, qa, "cublade nearest", cub, qa_bytes, mode))


if __name__ == "__main__":
    main()
