"""E8M0 block scales (shared by MXFP8 and MXFP4): both rules, exact exponents, special blocks."""
import pytest
import torch

from cublade.numerics.mx import block_scales, e8m0_exponent, e8m0_to_float


@pytest.mark.parametrize("amax,floor_e,rceil_e", [
    (448.0, 0, 0),          # exactly the E4M3 max: both rules give scale 1
    (449.0, 0, 1),          # floor keeps 2^0 and saturates 449 -> 448; rceil moves up to 2^1
    (256.0, 0, 0),          # floor(log2 256) - 8 = 0; ceil(log2(256/448)) = 0
    (255.9, -1, 0),
    (1.0, -8, -8),          # ceil(log2(1/448)) = ceil(-8.807) = -8
    (3.5, -7, -7),
    (2.0**-130, -127, -127),  # clamped to the smallest E8M0 exponent
    (3.0e38, 119, 120),
])
def test_e4m3_exponents_by_hand(amax, floor_e, rceil_e):
    a = torch.tensor([amax], dtype=torch.float32)
    assert e8m0_exponent(a, "floor", 448.0, 8).item() == floor_e
    assert e8m0_exponent(a, "rceil", 448.0, 8).item() == rceil_e


def test_special_blocks_zero_nan_inf():
    x = torch.zeros(3, 32)
    x[1, 4] = float("nan")
    x[2, 7] = float("inf")
    codes, scale = block_scales(x, 32, "rceil", 448.0, 8)
    assert codes.flatten().tolist() == [0, 255, 254]  # zero block: 2^-127; NaN block: NaN code; Inf: top code
    assert scale[0].item() == 2.0**-127 and torch.isnan(scale[1]).all()


def test_e8m0_decode_is_exact_powers_of_two():
    codes = torch.arange(0, 255, dtype=torch.uint8)
    v = e8m0_to_float(codes)
    assert torch.equal(v, torch.tensor([2.0**(c - 127) for c in range(255)], dtype=torch.float32))
    assert torch.isnan(e8m0_to_float(torch.tensor([255], dtype=torch.uint8))).all()


def test_unknown_rule_and_bad_k():
    with pytest.raises(ValueError, match="unknown MX scale rule 'ceil'"):
        e8m0_exponent(torch.ones(1), "ceil", 448.0, 8)
    with pytest.raises(ValueError, match="not a multiple of the block size 32"):
        block_scales(torch.ones(2, 48), 32, "rceil", 448.0, 8)


def test_rceil_amax_underflowing_the_division_takes_the_smallest_exponent():
    a = torch.tensor([2.0**-149, 448 * 2.0**-149], dtype=torch.float32)  # a / 448 underflows to 0, resp. 2^-149
    assert e8m0_exponent(a, "rceil", 448.0, 8).tolist() == [-127, -127]
