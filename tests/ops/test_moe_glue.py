"""moe_route / moe_finalize / silu_mul (the glue around the grouped FP4 experts): the references on CPU, the kernels
on the GPU against them (bit-exact rows, sums and activations; the place of a row inside its expert's range is free,
so route is checked by what it means: ranges, a permutation, each placed row equal to its token's)."""
from __future__ import annotations

import pytest
import torch

from cublade.ops.moe_glue import moe_finalize, moe_finalize_ref, moe_route, moe_route_ref, silu_mul, silu_mul_ref

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 device)")


def routing(T: int, k: int, E: int, seed: int, drop: float = 0.0, dtype=torch.int64):
    """Top-k distinct experts per token; a fraction `drop` of the entries replaced by -1 or E (other ranks')."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if k <= E else \
        torch.randint(0, E, (T, k), generator=g)
    if drop:
        mask = torch.rand(T, k, generator=g) < drop
        ids = torch.where(mask, torch.where(torch.rand(T, k, generator=g) < 0.5, -1, E), ids)
    return ids.to(dtype)


def check_route(ids, x, E, xs, offsets, pos):
    """xs / offsets / pos mean what moe_route promises (whatever the order inside a range)."""
    flat = ids.reshape(-1).long().cpu()
    k = ids.shape[1]
    valid = (flat >= 0) & (flat < E)
    counts = torch.bincount(flat[valid], minlength=E)
    want = torch.zeros(E + 1, dtype=torch.int64)
    want[1:] = counts.cumsum(0)
    assert offsets.dtype == torch.int32 and offsets.cpu().long().tolist() == want.tolist()
    p = pos.cpu().long()
    assert pos.dtype == torch.int32 and (p[~valid] == -1).all()
    placed = p[valid]
    assert sorted(placed.tolist()) == list(range(int(valid.sum())))  # a permutation of the routed places
    e = flat[valid]
    assert ((placed >= want[e]) & (placed < want[e + 1])).all()  # each row inside its expert's range
    rows = torch.nonzero(valid).squeeze(1)
    assert torch.equal(xs[placed.to(xs.device)], x[(rows // k).to(x.device)])


# ---- CPU: the references ------------------------------------------------------------------------------------

@pytest.mark.parametrize("T,k,E,drop", [(1, 2, 8, 0.0), (5, 2, 8, 0.3), (40, 4, 16, 0.1), (9, 1, 3, 0.0)])
def test_route_reference(T, k, E, drop):
    ids = routing(T, k, E, seed=T, drop=drop)
    x = torch.randn(T, 24).to(torch.bfloat16)
    xs, offsets, pos = moe_route_ref(ids, x, E)
    check_route(ids, x, E, xs, offsets, pos)
    flat = ids.reshape(-1)
    for e in range(E):  # the reference keeps token order inside a range
        assert pos[flat == e].tolist() == sorted(pos[flat == e].tolist())


def test_finalize_reference_is_the_weighted_sum():
    T, k, N = 4, 2, 16
    ids = routing(T, k, 8, seed=1, drop=0.25)
    x = torch.randn(T, N).to(torch.bfloat16)
    xs, offsets, pos = moe_route_ref(ids, x, 8)
    w = torch.rand(T, k)
    out = moe_finalize_ref(xs, pos, w)  # y = xs: each token's rows are x[t]
    for t in range(T):
        acc = torch.zeros(N)
        for j in range(k):
            if pos[t * k + j] >= 0:
                acc = acc + x[t].float() * w[t, j]
        assert torch.equal(out[t], acc.to(torch.bfloat16))


# ---- GPU: the kernels ---------------------------------------------------------------------------------------

@GPU
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("T,k,E,drop", [(1, 2, 8, 0.0), (3, 2, 8, 0.5), (300, 2, 8, 0.0), (5000, 2, 8, 0.05),
                                        (257, 8, 256, 0.1), (64, 6, 1024, 0.0), (33, 1, 1, 0.0), (7, 2, 64, 1.0)])
def test_route_kernel(ids_dtype, T, k, E, drop):
    ids = routing(T, k, E, seed=T + k, drop=drop, dtype=ids_dtype).cuda()
    x = torch.randn(T, 136, device="cuda").to(torch.bfloat16)
    xs, offsets, pos = torch.ops.cublade.moe_route(ids, x, E)
    assert xs.shape == (T * k, 136) and offsets.shape == (E + 1,) and pos.shape == (T * k,)
    check_route(ids, x, E, xs, offsets, pos)


@GPU
def test_route_kernel_strided_fp16_input():
    ids = routing(20, 2, 8, seed=3).cuda()
    x = torch.randn(20, 300, device="cuda").to(torch.float16)[:, 4:260]  # row stride 300: not 16-byte rows
    xs, offsets, pos = moe_route(ids, x, 8)
    check_route(ids, x, 8, xs, offsets, pos)


@GPU
@pytest.mark.parametrize("ydt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,k,N,drop", [(1, 2, 4096, 0.0), (17, 2, 136, 0.3), (1000, 4, 64, 0.1), (3, 1, 8, 0.0)])
def test_finalize_kernel_bit_exact(ydt, wdt, T, k, N, drop):
    ids = routing(T, k, 16, seed=T, drop=drop).cuda()
    _, _, pos = torch.ops.cublade.moe_route(ids, torch.zeros(T, 8, device="cuda", dtype=ydt), 16)
    y = torch.randn(T * k, N, device="cuda").to(ydt)
    y[int((pos >= 0).sum()):] = float("nan")  # the rows past the routed ones (no token points at them): never read
    w = torch.rand(T, k, device="cuda").to(wdt)
    out = torch.ops.cublade.moe_finalize(y, pos, w)
    assert out.dtype == ydt and out.shape == (T, N)
    assert torch.equal(out, moe_finalize_ref(y, pos, w))
    assert torch.equal(moe_finalize(y, pos, w), out)  # the entry takes the kernel


def test_silu_mul_reference_is_the_two_torch_ops():
    h = torch.randn(5, 32).to(torch.bfloat16)
    assert torch.equal(silu_mul(h), torch.nn.functional.silu(h[:, :16]) * h[:, 16:])


@GPU
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,I", [(1, 14336), (7, 8), (300, 1024), (4096, 136)])
def test_silu_mul_kernel_bit_exact(dt, M, I):
    g = torch.Generator(device="cuda").manual_seed(M + I)
    h = (torch.randn(M, 2 * I, device="cuda", generator=g) * 4).to(dt)
    specials = torch.tensor([0.0, -0.0, 1e4, -1e4, 80.0, -80.0, 100.0, -100.0, float("inf"), float("-inf"),
                             float("nan"), 1e-30], device="cuda").to(dt)
    h.view(-1)[: specials.numel()] = specials  # gate values of row 0 (and up values when I < 12)
    y = torch.ops.cublade.silu_mul(h)
    assert y.shape == (M, I) and y.dtype == dt and y.is_contiguous()
    torch.testing.assert_close(y, silu_mul_ref(h), rtol=0, atol=0, equal_nan=True)


@GPU
def test_silu_mul_kernel_strided_rows():
    big = torch.randn(9, 3 * 64, device="cuda").to(torch.bfloat16)
    h = big[:, 16:16 + 2 * 64]  # rows 384 bytes apart, starting 32 bytes in
    torch.testing.assert_close(torch.ops.cublade.silu_mul(h), silu_mul_ref(h), rtol=0, atol=0)


@GPU
def test_no_tokens():
    ids = torch.zeros(0, 2, device="cuda", dtype=torch.int64)
    x = torch.zeros(0, 64, device="cuda", dtype=torch.bfloat16)
    xs, offsets, pos = torch.ops.cublade.moe_route(ids, x, 8)
    assert xs.shape == (0, 64) and offsets.tolist() == [0] * 9 and pos.shape == (0,)
    out = torch.ops.cublade.moe_finalize(xs, pos, torch.zeros(0, 2, device="cuda"))
    assert out.shape == (0, 64)


@GPU
def test_refusals_name_the_op():
    x = torch.zeros(2, 16, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(2, 2, device="cuda", dtype=torch.int32)
    cases = [
        (ValueError, "moe_route: num_experts must be in", lambda: torch.ops.cublade.moe_route(ids, x, 2000)),
        (NotImplementedError, "moe_route: hidden size 12 must be a multiple of 8",
         lambda: torch.ops.cublade.moe_route(ids, x[:, :12], 4)),
        (ValueError, "moe_route: topk_ids must be int32 or int64",
         lambda: torch.ops.cublade.moe_route(ids.float(), x, 4)),
        (NotImplementedError, "moe_route: x must be bfloat16 or float16",
         lambda: torch.ops.cublade.moe_route(ids, x.float(), 4)),
        (ValueError, r"moe_finalize: y must be \[4, N\]",
         lambda: torch.ops.cublade.moe_finalize(x, ids.reshape(-1), torch.ones(2, 2, device="cuda"))),
        (ValueError, "moe_finalize: pos must be int32",
         lambda: torch.ops.cublade.moe_finalize(torch.cat([x, x]), ids.reshape(-1).long(),
                                                torch.ones(2, 2, device="cuda"))),
        (NotImplementedError, "silu_mul: h must be bfloat16 or float16", lambda: torch.ops.cublade.silu_mul(x.float())),
        (ValueError, r"silu_mul: h must be 2-D \[rows, 2 \* I\]", lambda: torch.ops.cublade.silu_mul(x[:, :15])),
        (NotImplementedError, "silu_mul: I=6 must be a multiple of 8", lambda: torch.ops.cublade.silu_mul(x[:, :12])),
    ]
    for exc, msg, call in cases:
        with pytest.raises(exc, match=msg):
            call()


@GPU
def test_opcheck():
    ids = torch.tensor([[0, 3], [5, 1]], device="cuda", dtype=torch.int32)  # one row per expert: order is fixed
    x = torch.randn(2, 64, device="cuda").to(torch.bfloat16)
    torch.library.opcheck(torch.ops.cublade.moe_route.default, (ids, x, 8))
    _, _, pos = torch.ops.cublade.moe_route(ids, x, 8)
    y = torch.randn(4, 64, device="cuda").to(torch.bfloat16)
    torch.library.opcheck(torch.ops.cublade.moe_finalize.default, (y, pos, torch.rand(2, 2, device="cuda")))
    torch.library.opcheck(torch.ops.cublade.silu_mul.default, (y,))
