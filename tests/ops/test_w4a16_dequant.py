"""w4a16_dequant: the repacked int4 blob -> the dense bf16 / fp16 weight (the W4A16 prefill path).

Tolerance class: bit-exact (rtol=0, atol=0, compared as raw 16-bit patterns, so -0 vs +0 counts, and strides
checked). w = (u - z) * s is exact in fp32 (|u - z| <= 15 times a bf16 scale), so the one rounding to the
output dtype is the only one, in the kernel as in the reference (w4a16_dequant_repacked(...).to(dtype)).
The weights are random nibbles (every code), random scales and zero points: no quantization step needed.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cublade.numerics.int4 import int4_dequant_weight, pack_int4
from cublade.ops.w4a16_dequant import _w4a16_dequant_fake, w4a16_dequant, w4a16_dequant_ref
from cublade.ops.w4a16_gemm import w4a16_repack
from accuracy import rel_err

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 device)")
GROUPS = (32, 64, 128, -1)
DTYPES = (torch.bfloat16, torch.float16)
# N: one row, a partial tile (rows g+8 missing), a partial tile group (72 = 64 + 8), 3 groups + 8 rows.
NS = (1, 13, 72, 200)
# K: < 512, and not multiples of 512 (partial last chunk / packet); those a group size does not divide are skipped.
KS = (120, 200, 384, 544, 640, 1000, 1152)


def checkpoint(N: int, K: int, G: int, sym: bool, seed: int = 0, scale: torch.Tensor | None = None):
    """Random checkpoint tensors (cublade.numerics.int4's layout): every nibble value, scales ~0.02, zero points
    0..15."""
    g = torch.Generator().manual_seed(seed)
    ng = 1 if G == -1 else K // G
    wp = pack_int4(torch.randint(0, 16, (N, K), generator=g))
    ws = (torch.randn(N, ng, generator=g) * 0.02).to(torch.bfloat16) if scale is None else scale
    wz = None if sym else torch.randint(0, 16, (N, ng), generator=g).to(torch.uint8)
    return wp, ws, wz


def blob(N: int, K: int, G: int, sym: bool, device: str = "cpu", **kw):
    wp, ws, wz = checkpoint(N, K, G, sym, **kw)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return w4a16_repack(to(wp), to(ws), to(wz), G), (wp, ws, wz)


def assert_bits_equal(out: torch.Tensor, ref: torch.Tensor):
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.device == ref.device
    assert out.is_contiguous()
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), \
        f"{(out.view(torch.int16) != ref.view(torch.int16)).sum().item()} of {out.numel()} elements differ"


def shapes(G: int):
    return [(N, K) for N, K in itertools.product(NS, KS) if G == -1 or K % G == 0]


# ---- CPU: the entry is the reference, and the reference is the checkpoint's dequant rounded once ------------

@pytest.mark.parametrize("G,sym", [(32, False), (128, True), (-1, False)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_entry_is_the_checkpoint_dequant(G, sym, dtype):
    for N, K in [(13, 384), (72, 640)] + ([(200, 1000)] if G == -1 else []):
        rp, (wp, ws, wz) = blob(N, K, G, sym, seed=N + K)
        out = w4a16_dequant(rp.packed, G, sym, N, K, dtype)
        assert_bits_equal(out, int4_dequant_weight(wp, ws, wz, G, dtype))
        assert_bits_equal(out, w4a16_dequant_ref(rp.packed, G, sym, N, K, dtype))


def test_entry_refuses_other_dtypes():
    rp, _ = blob(16, 128, 64, True)
    with pytest.raises(NotImplementedError, match="w4a16_dequant: dtype must be bfloat16 or float16"):
        w4a16_dequant(rp.packed, 64, True, 16, 128, torch.float32)


def test_fake_shape_and_dtype():
    with FakeTensorMode():
        packed = torch.empty((4, 3, 4, 1024 + 32), dtype=torch.int32)
        out = _w4a16_dequant_fake(packed, 128, True, 200, 1152, torch.float16)
    assert out.shape == (200, 1152) and out.dtype == torch.float16 and out.device == packed.device


# ---- GPU: the kernel, bit for bit ----------------------------------------------------------------------

def dequant(rp, dtype):
    return torch.ops.cublade.w4a16_dequant(rp.packed, rp.group_size, rp.symmetric, rp.size_n, rp.size_k, dtype)


def reference(rp, dtype):
    return w4a16_dequant_ref(rp.packed, rp.group_size, rp.symmetric, rp.size_n, rp.size_k, dtype)


@GPU
@pytest.mark.parametrize("G,sym,dtype", list(itertools.product(GROUPS, [True, False], DTYPES)))
def test_kernel_bit_exact(G, sym, dtype):
    for N, K in shapes(G):
        rp, _ = blob(N, K, G, sym, "cuda", seed=N * K)
        assert_bits_equal(dequant(rp, dtype), reference(rp, dtype))


@GPU
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_scales_from_subnormal_to_overflow(dtype):
    """Scales 2^-140 .. 2^127 of both signs: the output has signed zeros, subnormals and infinities (fp16 from
    s ~ 2^12 up; bf16 where (u - z) * s overflows fp32, e.g. s = 2^127), all rounded as the reference rounds."""
    N, K, G = 72, 640, 32
    g = torch.Generator().manual_seed(1)
    s = torch.randn(N, K // G, generator=g) * torch.exp2(torch.randint(-140, 125, (N, K // G), generator=g).float())
    s[:4, 0] = torch.tensor([2.0**127, -(2.0**127), 2.0**-133, -(2.0**-133)])  # bf16's largest power of 2, its least
    for sym in (True, False):
        rp, _ = blob(N, K, G, sym, "cuda", scale=s.to(torch.bfloat16))
        out = dequant(rp, dtype)
        assert_bits_equal(out, reference(rp, dtype))
        assert torch.isinf(out).any() and (out == 0).any() and torch.isfinite(out).any()


@GPU
@pytest.mark.parametrize("G,sym,dtype", [(128, True, torch.bfloat16), (32, False, torch.float16),
                                         (-1, True, torch.float16)])
def test_kernel_real_size(G, sym, dtype):
    rp, _ = blob(1024, 4096, G, sym, "cuda")
    assert_bits_equal(dequant(rp, dtype), reference(rp, dtype))


@GPU
def test_kernel_writes_every_output():
    """The output is fresh memory; fill the allocator's blocks with NaN first so that a skipped element shows."""
    for N, K, G, sym in [(200, 1000, -1, False), (72, 640, 32, True), (13, 120, -1, True)]:
        rp, _ = blob(N, K, G, sym, "cuda")
        for dtype in DTYPES:
            for _ in range(3):
                torch.full((N, K), float("nan"), dtype=dtype, device="cuda")  # freed at once, reused next
                assert_bits_equal(dequant(rp, dtype), reference(rp, dtype))


@GPU
def test_kernel_blob_views():
    """A blob that starts inside a larger allocation: aligned (rows 64.. of a larger layer: a tile-group slice)
    and misaligned by 4 bytes (the wrapper copies it; the kernel reads 16-byte vectors)."""
    rp, _ = blob(200, 640, 64, False, "cuda")
    tail = rp.packed[1:]  # tile groups 1..3: rows 64..199
    assert tail.storage_offset() > 0 and tail.is_contiguous()
    out = torch.ops.cublade.w4a16_dequant(tail, 64, False, 136, 640, torch.bfloat16)
    assert_bits_equal(out, reference(rp, torch.bfloat16)[64:])
    buf = torch.empty(rp.packed.numel() + 1, dtype=torch.int32, device="cuda")
    shifted = buf[1:].view(rp.packed.shape)
    shifted.copy_(rp.packed)
    assert shifted.data_ptr() % 16 != 0
    out = torch.ops.cublade.w4a16_dequant(shifted, 64, False, 200, 640, torch.float16)
    assert_bits_equal(out, reference(rp, torch.float16))


@GPU
def test_kernel_refuses_with_a_message():
    rp, _ = blob(32, 256, 128, True, "cuda")
    op = torch.ops.cublade.w4a16_dequant
    p, bf = rp.packed, torch.bfloat16
    bad_packed = r"w4a16_dequant: packed must be a contiguous int32 "
    cases = [
        (NotImplementedError, "w4a16_dequant: dtype must be bfloat16 or float16", (p, 128, True, 32, 256, torch.float)),
        (ValueError, r"w4a16_dequant: group_size must be 32, 64, 128 or -1 \(per channel\), got 256",
         (p, 256, True, 32, 256, bf)),
        (ValueError, r"w4a16_dequant: size_n must be in \[1, 2\^31\), got 0", (p, 128, True, 0, 256, bf)),
        (ValueError, "w4a16_dequant: size_k=252 must be a positive multiple of 8", (p, 128, True, 32, 252, bf)),
        (ValueError, "w4a16_dequant: size_k=192 is not a multiple of group_size=128", (p, 128, True, 32, 192, bf)),
        (ValueError, bad_packed + r"\[2, 1, 4, 1056\]", (p, 128, True, 80, 256, bf)),
        (ValueError, bad_packed + r"\[1, 2, 4, 1056\]", (p, 128, True, 32, 640, bf)),
        (ValueError, bad_packed + r"\[1, 1, 4, 1088\]", (p, 128, False, 32, 256, bf)),
        (ValueError, bad_packed + r"\[1, 1, 4, 1056\].*got Long",
         (p.long(), 128, True, 32, 256, bf)),
        (ValueError, bad_packed + r"\[1, 1, 4, 1056\]",
         (torch.zeros(1, 1, 1056, 4, dtype=torch.int32, device="cuda").transpose(-1, -2), 128, True, 32, 256, bf)),
    ]
    for exc, msg, args in cases:
        with pytest.raises(exc, match=msg):
            op(*args)


@GPU
def test_opcheck():
    rp, _ = blob(48, 256, 64, False, "cuda")
    for dtype in DTYPES:
        torch.library.opcheck(torch.ops.cublade.w4a16_dequant.default, (rp.packed, 64, False, 48, 256, dtype))


@GPU
def test_torch_compile_fullgraph():
    rp, _ = blob(64, 512, 128, True, "cuda")

    class Layer(torch.nn.Module):  # the prefill path: dequantize, then a dense GEMM
        def forward(self, x):
            w = w4a16_dequant(rp.packed, 128, True, 64, 512, x.dtype)
            return torch.nn.functional.linear(x, w), w * 2

    layer = Layer()
    compiled = torch.compile(layer, fullgraph=True)
    for M in (1, 300):
        x = torch.randn(M, 512, device="cuda").to(torch.bfloat16)
        (y, w2), (y_ref, w2_ref) = compiled(x), layer(x)
        assert_bits_equal(w2, w2_ref)  # doubling is exact: the compiled graph ran the same dequant
        assert rel_err(y, y_ref) < 1e-3  # the GEMMs may differ in layout / algorithm: not held bit-exact


# ---- the FP8 form: E4M3 codes u - z and 1 x 128 block scales ----------------------------------------------

from cublade.ops.w4a16_dequant import w4a16_dequant_fp8, w4a16_dequant_fp8_ref  # noqa: E402


@pytest.mark.parametrize("G,sym", [(128, True), (128, False), (-1, True), (-1, False)])
def test_fp8_form_times_its_scales_is_the_weight(G, sym):
    """codes * scale (per 128-wide block) equals the fp32 dequantized weight exactly: no rounding in the FP8 form."""
    N, K = 72, 640
    rp, (wp, ws, wz) = blob(N, K, G, sym)
    codes, scale = w4a16_dequant_fp8_ref(rp.packed, G, sym, N, K)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (N, K // 128) and scale.stride() == (1, N)
    w = (codes.float().reshape(N, -1, 128) * scale[:, :, None]).reshape(N, K)
    assert torch.equal(w, int4_dequant_weight(wp, ws, wz, G).float())


def test_fp8_form_refuses_small_groups():
    rp, _ = blob(8, 256, 32, True)
    with pytest.raises(NotImplementedError, match="group_size must be 128"):
        w4a16_dequant_fp8(rp.packed, 32, True, 8, 256)


@GPU
@pytest.mark.parametrize("G,sym", [(128, True), (128, False), (-1, True), (-1, False)])
@pytest.mark.parametrize("N,K", [(1, 128), (13, 384), (72, 640), (200, 1152), (4096, 4096)])
def test_fp8_form_kernel_bit_exact(N, K, G, sym):
    rp, _ = blob(N, K, G, sym, device="cuda", seed=N + K)
    codes, scale = w4a16_dequant_fp8(rp.packed, G, sym, N, K)
    rc, rs = w4a16_dequant_fp8_ref(rp.packed.cpu(), G, sym, N, K)
    assert codes.is_contiguous() and scale.stride() == (1, N)
    assert torch.equal(codes.cpu().view(torch.uint8), rc.view(torch.uint8))
    assert torch.equal(scale.cpu(), rs)
