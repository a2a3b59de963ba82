"""int4 group quantization and packing (the W4A16 checkpoint format): bit layout, known values, round trips."""
import pytest
import torch

from cublade.numerics.int4 import (group_params, int4_dequant_weight, int4_quant_weight, pack_int4, quantize_groups,
                                   unpack_int4)


def test_pack_layout_is_little_endian_nibbles():
    u = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]])
    assert pack_int4(u).item() == int("f7654321", 16) - 2**32  # value j in bits [4j, 4j+4); top nibble sets the sign
    assert torch.equal(unpack_int4(pack_int4(u)), u.to(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64])
@pytest.mark.parametrize("shape", [(8,), (3, 8), (2, 5, 8), (0, 8)])
def test_pack_nibbles_is_the_shift_and_or_of_each_nibble(dtype, shape):
    """The byte-pair packing against the word built nibble by nibble (value j shifted by 4j), as int32."""
    from cublade.numerics.int4 import pack_nibbles

    u = torch.randint(0, 16, shape, generator=torch.Generator().manual_seed(len(shape)), dtype=torch.int64)
    words = sum(u[..., j] << (4 * j) for j in range(8)) if shape[0] else torch.zeros(shape[:-1], dtype=torch.int64)
    expect = (words - ((words >= 2**31).to(torch.int64) << 32)).to(torch.int32)
    got = pack_nibbles(u.to(dtype))
    assert got.dtype == torch.int32 and got.shape == shape[:-1] and torch.equal(got, expect)


@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_group_params_follow_the_formula(group_size, dtype):
    """The module docstring's rule, written out: s = max(amax / 7, MIN) (symmetric), s = max((max - min) / 15, MIN) and
    z = clamp(round(-min / s), 0, 15) with min <= 0 <= max (asymmetric), s rounded to bf16; on random weights, an
    all-zero row, and rows of one sign."""
    from cublade.numerics.constants import MIN_WEIGHT_SCALE

    w = torch.randn(6, 256, generator=torch.Generator().manual_seed(1)) * 0.02
    w[1] = 0.0
    w[2] = w[2].abs()
    w[3] = -w[3].abs()
    w = w.to(dtype)
    wg = w.float().reshape(6, -1, 256 if group_size == -1 else group_size)
    s, z = group_params(w, group_size, True)
    assert z is None and torch.equal(s, (wg.abs().amax(-1) / 7).clamp_min(MIN_WEIGHT_SCALE).to(torch.bfloat16))
    lo, hi = wg.amin(-1).clamp_max(0.0), wg.amax(-1).clamp_min(0.0)
    s, z = group_params(w, group_size, False)
    assert torch.equal(s, ((hi - lo) / 15).clamp_min(MIN_WEIGHT_SCALE).to(torch.bfloat16))
    assert torch.equal(z, torch.round(-lo / s.float()).clamp(0, 15).to(torch.uint8))


def test_pack_round_trip_random_and_refuses_bad_input():
    g = torch.Generator().manual_seed(0)
    u = torch.randint(0, 16, (7, 64), generator=g)
    assert torch.equal(unpack_int4(pack_int4(u)), u.to(torch.uint8))
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(u[:, :60])
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_int4(u + 1)


def test_symmetric_known_values():
    # One group of 8: amax 7 -> scale 1 exactly; q = round(w) (half to even), stored as q + 8.
    w = torch.tensor([[7.0, -7.0, 0.5, 1.5, -2.5, 3.2, 0.0, -8.0]])
    s, z = group_params(w, -1, True)  # amax 8 -> scale 8/7, rounded to bf16
    assert z is None and s.dtype == torch.bfloat16 and s.item() == pytest.approx(8.0 / 7.0, rel=2**-8)
    w[0, 7] = 7.0  # amax 7 -> scale exactly 1
    s, _ = group_params(w, -1, True)
    assert s.item() == 1.0
    u = quantize_groups(w, s, None, -1)
    assert u.tolist() == [[15, 1, 8, 10, 6, 11, 8, 15]]  # 0.5 -> 0, 1.5 -> 2, -2.5 -> -2 (half to even)


def test_asymmetric_known_values():
    w = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 15.0]])  # min 0, max 15 -> scale 1, zero 0
    s, z = group_params(w, -1, False)
    assert s.item() == 1.0 and z.item() == 0
    assert quantize_groups(w, s, z, -1).tolist() == [[0, 1, 2, 3, 4, 5, 6, 15]]
    w = w - 5.0  # min -5 -> zero point 5
    s, z = group_params(w, -1, False)
    assert z.item() == 5
    assert torch.equal(int4_dequant_weight(pack_int4(quantize_groups(w, s, z, -1)), s, z, -1), w)


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("symmetric", [True, False])
def test_round_trip_error_is_bounded(group_size, symmetric):
    """Symmetric: half a step everywhere. Asymmetric: the zero point is rounded to an integer, which shifts
    the grid by up to half a step, so the ends of a group's range may clip by up to one step."""
    g = torch.Generator().manual_seed(group_size + symmetric)
    w = torch.randn(24, 256, generator=g)
    w[3] = 0.0  # all-zero row: finite scale, zeros back
    t = int4_quant_weight(w, group_size, symmetric)
    assert t["weight_packed"].shape == (24, 32) and t["weight_packed"].dtype == torch.int32
    d = int4_dequant_weight(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"), group_size)
    G = 256 if group_size == -1 else group_size
    step = t["weight_scale"].float().repeat_interleave(G, dim=1)
    assert torch.isfinite(d).all() and torch.equal(d[3], torch.zeros(256))
    assert ((d - w).abs() <= step * (0.5 if symmetric else 1.0) + 1e-6).all()


def test_group_size_must_divide_k():
    with pytest.raises(ValueError, match="in_features=100 is not a multiple of group_size=32"):
        int4_quant_weight(torch.randn(4, 100), 32)
