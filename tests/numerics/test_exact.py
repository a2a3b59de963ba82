"""cublade.numerics.exact: max |x| without |x|'s copy, bit for bit the same as |x|.amax() (+0 for zeros, NaN and Inf
through), and division by a constant as a true division (what CUDA's tensor / python_scalar is not)."""
import pytest
import torch

from cublade.numerics.exact import abs_amax, div


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous().view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_abs_amax_is_the_amax_of_abs(dtype):
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[1] = 0.0
    x[2] = -0.0
    x[3] = -x[3].abs()
    x[4, 5] = float("inf")
    x[5, 6] = -float("inf")
    x[6, 7] = float("nan")
    for dim in (1, 0):
        got, want = abs_amax(x, dim=dim), x.abs().amax(dim=dim)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(_bits(got[~got.isnan()]), _bits(want[~want.isnan()]))  # +0 for the zero rows too
    assert torch.equal(_bits(abs_amax(x[:6])), _bits(x[:6].abs().amax()))
    assert abs_amax(x).isnan() and abs_amax(x[:4], dim=1, keepdim=True).shape == (4, 1)


def test_div_is_a_true_division():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(1))
    for c in (6.0, 7.0, 15.0, 448.0, 6.0 * 448.0):
        assert torch.equal(div(x, c), (x.double() / c).float())
