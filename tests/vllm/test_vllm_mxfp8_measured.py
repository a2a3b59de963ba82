"""CUBLADE_MXFP8_PREFILL=humming (cublade.vllm.kernels.cublade_mxfp8_measured): the setting read, the layer's wiring
(cublade's blob on the layer, a copy of the checkpoint's MXFP8 tensors for vLLM's Humming where it won a range, each
call on its range's kernel through the one op; Humming and the timing stood in for: they need the GPU), and when the
selection picks the kernel class (GPU mocked: tests/gpu_mock.py). The shared timing and ranges:
tests/vllm/test_vllm_w4a16_measured.py. The kernels themselves: tests/gpu/test_mxfp8_measured.py."""
from __future__ import annotations

import pytest
import torch
from gpu_mock import mocked_gpu
from stand_in import stand_in_layer
from test_vllm_kernels_by_gpu import choice, loaded_layer
from test_vllm_w4a16_measured import _StandInAdapter, stand_in_timing
from vllm_layers import KINDS

from cublade.config import MXFP8Scheme
from cublade.numerics.linear import mxfp8_measured_kernels
from cublade.vllm.kernels import cublade_mxfp8_measured as kx
from cublade.vllm.kernels import measured as mk


@pytest.mark.parametrize("value,kernels", [("humming", ("humming",)), (" Humming ", ("humming",)), ("", ())])
def test_the_environment_names_the_kernels(monkeypatch, value, kernels):
    monkeypatch.setenv("CUBLADE_MXFP8_PREFILL", value)
    assert mxfp8_measured_kernels() == kernels


@pytest.mark.parametrize("value", ["machete", "humming,humming", "fp8", "humming,"])
def test_the_environment_refuses_what_it_cannot_time(monkeypatch, value):
    monkeypatch.setenv("CUBLADE_MXFP8_PREFILL", value)
    with pytest.raises(ValueError, match=r"CUBLADE_MXFP8_PREFILL=.*: expected vLLM kernels to time against cublade's "
                                         r"at load, comma-separated, of humming"):
        mxfp8_measured_kernels()


@pytest.fixture
def stand_in(monkeypatch):
    """A stand-in Humming (tests/vllm/test_vllm_w4a16_measured.py's adapter: returns its offset, 100) and the times a
    GPU gave: Humming faster at 256-512 tokens, by 1% only at 1024 (cublade's there), faster again from 2048."""
    monkeypatch.setenv("CUBLADE_MXFP8_PREFILL", "humming")
    return stand_in_timing(monkeypatch, kx.CubladeMxfp8Measured, {"humming": type("H", (_StandInAdapter,), {})},
                           lambda K: {16: [1.0, 2.0], 128: [10.0, 12.0], 256: [20.0, 15.0], 512: [40.0, 30.0],
                                      1024: [80.0, 79.5], 2048: [160.0, 140.0]})


def mxfp8_layer(N=128, K=256, prefix="model.layers.0.mlp.gate_up_proj"):
    scheme = MXFP8Scheme()
    tensors = scheme.quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.05)
    layer = stand_in_layer(scheme, {k: v.clone() for k, v in tensors.items()}, N, K, device="cpu")
    layer.prefix = prefix
    return layer, tensors


def test_each_call_runs_on_its_ranges_kernel_with_its_copy(stand_in, monkeypatch):
    said = []
    monkeypatch.setattr(mk.logger, "info", lambda msg, *args: said.append(msg % args))
    layer, tensors = mxfp8_layer()
    impl = kx.CubladeMxfp8Measured(layer)
    humming, = _StandInAdapter.built
    assert stand_in == [["cublade", "humming"]]
    assert impl.ranges == [(129, 513, 1), (1025, mk.NO_END, 1)]
    assert impl.said() == "vLLM's Humming at 129-512, 1025+ tokens, cublade's kernels at the rest"
    line, = [s for s in said if "measured at load" in s]
    assert line.startswith("cublade: mxfp8 layers of N=128, K=256 run on vLLM's Humming at 129-512, 1025+ tokens, "
                           "cublade's kernels at the rest; vLLM's Humming's copy ")
    copy = layer.cublade_humming  # built on the checkpoint's own tensors, the layer keeping cublade's blob
    assert all(torch.equal(copy.seen[n].view(torch.uint8), t.view(torch.uint8)) for n, t in tensors.items())
    assert not hasattr(layer, "weight_scale") and layer.weight.dtype == torch.int32  # the blob, scales inside
    x = torch.randn(1100, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for m in (1, 128, 129, 512, 513, 1024, 1025, 1100):
        y = impl.apply(layer, x[:m], None)
        assert y.shape == (m, 128)
        if mk.kernel_at(m, impl.ranges):
            assert (y == 100.0).all(), m
        else:
            assert torch.equal(y, MXFP8Scheme().linear_ref(x[:m], tensors)), m
    assert humming.calls[1:] == [129, 512, 1025, 1100]
    bias = torch.randn(128).to(torch.bfloat16)
    assert torch.equal(impl.apply(layer, x[:300].reshape(100, 3, 256), bias),
                       torch.full((100, 3, 128), 100.0, dtype=torch.bfloat16) + bias)


def test_humming_keeps_no_copy_where_it_wins_nothing(stand_in, monkeypatch):
    monkeypatch.setattr(mk, "time_rows", lambda kernels, K, dtype, device: {16: [1.0, 2.0], 256: [20.0, 19.8]})
    layer, tensors = mxfp8_layer()
    impl = kx.CubladeMxfp8Measured(layer)
    assert impl.ranges == [] and layer.cublade_humming is None and impl.said() == "cublade's kernels at every count"
    x = torch.randn(300, 256).to(torch.bfloat16)
    assert torch.equal(impl.apply(layer, x, None), MXFP8Scheme().linear_ref(x, tensors))


def test_w4a16_and_mxfp8_layers_of_one_shape_are_timed_apart(stand_in):
    """The timing's key holds the scheme: an MXFP8 layer does not take a W4A16 layer's ranges of the same K x N."""
    mk._measured[("w4a16", 256, 128, 128, True, torch.bfloat16, torch.device("cpu"), ("cublade", "humming"))] = []
    kx.CubladeMxfp8Measured(mxfp8_layer()[0])
    assert len(stand_in) == 1


def test_selected_on_hopper_only_when_asked_for(vllm_ctx, monkeypatch):
    import vllm.utils.import_utils as vllm_import_utils
    from vllm.model_executor.kernels.linear.mxfp8.humming import HummingMxfp8LinearKernel

    layer = loaded_layer(MXFP8Scheme(), KINDS["gate_up"], monkeypatch)
    with mocked_gpu(monkeypatch, 90):
        got, _, skipped = choice(layer)
        assert got == "cublade-mxfp8-gemm"
        assert "cublade-mxfp8-measured: runs when asked for (CUBLADE_MXFP8_PREFILL=humming)" in skipped
        monkeypatch.setenv("CUBLADE_MXFP8_PREFILL", "humming")
        monkeypatch.setattr(vllm_import_utils, "has_humming", lambda: False)
        got, _, skipped = choice(layer)
        assert got == "cublade-mxfp8-gemm"
        assert ("cublade-mxfp8-measured: needs vLLM's Humming too: vLLM's Humming needs the humming-kernels package "
                "(pip install humming-kernels)") in skipped
        monkeypatch.setattr(vllm_import_utils, "has_humming", lambda: True)
        monkeypatch.setattr(HummingMxfp8LinearKernel, "is_supported", classmethod(lambda cls, cap=None: (True, None)))
        got, reason, _ = choice(layer)
        assert got == "cublade-mxfp8-measured"
        assert reason == ("cublade's CUDA op mxfp8_gemm, and vLLM's Humming at the token counts where measured faster "
                          "at load (a copy of the MXFP8 weights in each one's layout)")
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
        got, _, skipped = choice(layer)
        assert got == "cublade-mxfp8-gemm"
        assert any(s.startswith("cublade-mxfp8-measured: VLLM_BATCH_INVARIANT=1") for s in skipped)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    with mocked_gpu(monkeypatch, 89):  # cublade's sm_90a kernels do not run there: as before
        assert choice(layer)[0] != "cublade-mxfp8-measured"
