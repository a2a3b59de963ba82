"""Shared checks of the FP8 op tests: the E4M3 code table decoded by hand, byte equality with NaN semantics,
and the GPU marker."""
import pytest
import torch

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run on the H200 device)")
FP8 = torch.float8_e4m3fn


def e4m3_table() -> torch.Tensor:
    """fp32 value of every E4M3 code 0..255 (NaN for 0x7F/0xFF), decoded by hand from the bit fields."""
    vals = []
    for c in range(256):
        s, e, m = c >> 7, (c >> 3) & 0xF, c & 7
        v = float("nan") if (e == 15 and m == 7) else (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0**(e - 7))
        vals.append(-v if s else v)
    return torch.tensor(vals, dtype=torch.float32)


def assert_fp8_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    a, b = a.cpu().view(torch.uint8), b.cpu().view(torch.uint8)
    assert a.shape == b.shape
    nan_a, nan_b = (a & 0x7F) == 0x7F, (b & 0x7F) == 0x7F
    assert torch.equal(nan_a, nan_b), f"NaN positions differ at {(nan_a != nan_b).nonzero()[:5].tolist()}"
    diff = (a != b) & ~nan_a
    assert not diff.any(), (f"{int(diff.sum())} bytes differ, first at {diff.nonzero()[:5].tolist()}: "
                            f"{a[diff][:5].tolist()} vs {b[diff][:5].tolist()}")
