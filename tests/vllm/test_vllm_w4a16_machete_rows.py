"""CUBLADE_W4A16_PREFILL=machete (cublade.vllm.kernels.cublade_w4a16_machete): the token ranges taken from the times
measured at load, the dispatch op that follows them (its two kernels stood in for: they need the GPU), its trace
under torch.compile with the token count dynamic, and when the selection picks the kernel class (GPU mocked:
tests/gpu_mock.py), and how the kernel class wires a layer with vLLM's Machete adapter (both copies kept, each call
to its kernel; the timing, both kernels and Machete's prepack op stood in for). The kernels themselves:
tests/gpu/test_w4a16_machete.py."""
from __future__ import annotations

import pytest
import torch
from vllm.scalar_type import scalar_types
from gpu_mock import mocked_gpu
from stand_in import stand_in_layer
from test_vllm_kernels_by_gpu import choice, loaded_layer
from vllm_layers import KINDS

from cublade.config import W4A16Scheme
from cublade.ops.w4a16_gemm import w4a16_gemm_ref
from cublade.vllm.kernels import cublade_w4a16_machete as km

END = km.NO_END


@pytest.mark.parametrize("times,rows", [
    ({16: (1, 2), 64: (5, 6)}, []),                                              # never faster
    ({16: (1, 2), 128: (10, 9), 256: (20, 18)}, [17, END]),                      # above 16: the next point's choice
    ({16: (1, 2), 128: (10, 9), 160: (10, 11), 224: (10, 9), 4096: (5, 6)}, [17, 129, 161, 225]),
    ({16: (3, 2), 32: (3, 2), 64: (3, 4)}, [16, 33]),                            # adjacent points merged
    ({128: (10, 9)}, [128, END]),                                                # below the first: cublade's
    ({128: (10, 10)}, []),                                                       # a tie stays on cublade's
    ({128: (10, 9.85), 256: (20, 19.7)}, []),                                    # so does a lead within 2%
    ({128: (10, 9.75)}, [128, END]),                                             # a lead past it moves
])
def test_machete_rows_from_the_measured_times(times, rows):
    assert km.machete_rows(times) == rows


def test_rows_read_back():
    rows = km.machete_rows({16: (1, 2), 128: (10, 9), 160: (10, 11), 224: (10, 9), 4096: (5, 6)})
    assert [m for m in (1, 16, 17, 128, 129, 160, 161, 200, 224, 225, 4096, 10**6) if km.on_machete(m, rows)] == [
        17, 128, 161, 200, 224]
    assert km.describe_rows(rows) == "17-128, 161-224" and km.describe_rows([257, END]) == "257+"
    assert km.describe_rows([]) == "none"


@pytest.fixture
def stand_ins(monkeypatch):
    """The op's two kernels replaced by functions that record which ran and return x @ a weight of their own."""
    ran = []

    def cublade(x, packed, group_size, symmetric, size_n):
        ran.append(("cublade", x.shape[0], group_size))
        return x @ packed.t()

    def machete(x, w, s, zp, type_id, group_size):
        ran.append(("machete", x.shape[0], group_size))
        return x @ w.t() * s

    monkeypatch.setattr(km, "_cublade_gemm", cublade)
    monkeypatch.setattr(km, "_machete_mm", machete)
    return ran


def test_the_op_runs_each_call_on_the_kernel_of_its_range(stand_ins):
    K, N = 32, 8
    blob, wm = torch.randn(N, K), torch.randn(N, K)
    rows = [64, 128, 256, END]
    for m in (1, 63, 64, 127, 128, 255, 256, 1000):
        x = torch.randn(m, K)
        y = torch.ops.cublade.w4a16_gemm_or_machete(x, blob, 128, True, N, wm, torch.tensor(2.0), None, 7, -1, rows)
        want = x @ wm.t() * 2.0 if km.on_machete(m, rows) else x @ blob.t()
        assert torch.equal(y, want)
    assert stand_ins == [("cublade", 1, 128), ("cublade", 63, 128), ("machete", 64, -1), ("machete", 127, -1),
                         ("cublade", 128, 128), ("cublade", 255, 128), ("machete", 256, -1), ("machete", 1000, -1)]


def test_the_choice_by_token_count_is_made_at_run_time_not_traced(stand_ins, monkeypatch):
    """vLLM compiles the model with the token count dynamic: the op must not put a guard on it (a guard would
    recompile, or in vLLM fail, at the first call on the other side of a boundary)."""
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    K, N = 32, 8
    blob, wm, s = torch.randn(N, K), torch.randn(N, K), torch.tensor(1.0)

    @torch.compile(fullgraph=True, dynamic=True, backend="eager")
    def step(x):
        return torch.ops.cublade.w4a16_gemm_or_machete(x, blob, 128, True, N, wm, s, None, 7, 128, [100, END])

    for m in (20, 150, 30, 400):
        assert step(torch.randn(m, K)).shape == (m, N)
    assert [k for k, _, _ in stand_ins] == ["cublade", "machete", "cublade", "machete"]


@pytest.mark.parametrize("scheme", [W4A16Scheme(128, True), W4A16Scheme(128, False), W4A16Scheme(-1, True)],
                         ids=lambda s: s.describe())
def test_selected_on_hopper_only_when_asked_for(vllm_ctx, monkeypatch, scheme):
    layer = loaded_layer(scheme, KINDS["qkv"], monkeypatch)
    with mocked_gpu(monkeypatch, 90):
        got, _, skipped = choice(layer)
        assert got == "cublade-w4a16-gemm"
        assert "cublade-w4a16-machete: runs when asked for (CUBLADE_W4A16_PREFILL=machete)" in skipped
        monkeypatch.setenv("CUBLADE_W4A16_PREFILL", "machete")
        got, reason, _ = choice(layer)
        assert got == "cublade-w4a16-machete" and "second, Machete-layout copy" in reason
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
        got, _, skipped = choice(layer)
        assert got == "cublade-w4a16-gemm"
        assert any(s.startswith("cublade-w4a16-machete: VLLM_BATCH_INVARIANT=1") for s in skipped)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    with mocked_gpu(monkeypatch, 89):  # no Machete, and cublade's sm_90a kernels do not run: Marlin as before
        assert choice(layer)[0] == "vllm-marlin"


def test_without_machete_the_layer_keeps_cublades_kernels(vllm_ctx, monkeypatch):
    """Machete takes N % 128 == 0 and K % 64 == 0 per rank: a layer it cannot take stays on cublade's kernels,
    and the reason says why the pair was passed over."""
    layer = loaded_layer(W4A16Scheme(128, True), KINDS["qkv"], monkeypatch)
    layer.output_size_per_partition = 200  # as if a rank held 200 rows
    monkeypatch.setenv("CUBLADE_W4A16_PREFILL", "machete")
    with mocked_gpu(monkeypatch, 90):
        ok, why = km.CubladeW4A16Machete.can_implement(layer)
    assert not ok and why.startswith("needs vLLM's Machete too: ")


@pytest.mark.parametrize("group_size,symmetric", [(128, True), (128, False), (-1, True)])
@pytest.mark.parametrize("machete_wins", [True, False])
def test_the_layer_keeps_both_copies_and_runs_each(vllm_ctx, monkeypatch, group_size, symmetric, machete_wins):
    """The layer as the kernel class leaves it, with vLLM's real Machete adapter (MacheteLinearKernel's weight
    transforms run; only its prepack op, a CUDA op, stood in for by a copy): cublade's blob in place of the
    checkpoint tensors, Machete's copy beside it (dropped when Machete wins no count), each call to its kernel."""
    import vllm._custom_ops as vllm_ops

    scheme, N, K = W4A16Scheme(group_size, symmetric), 256, 512
    tensors = scheme.quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.05)
    layer = stand_in_layer(scheme, {k: v.clone() for k, v in tensors.items()}, N, K, device="cpu")
    machete_calls = []

    def machete(x, w, s, zp, type_id, group):
        machete_calls.append((x.shape[0], w.data_ptr(), s.data_ptr(), None if zp is None else zp.data_ptr(),
                              type_id, group))
        return x.new_full((x.shape[0], N), 7.0)

    def time_rows(kernels, K_, dtype, device):  # each kernel run once, then the times of a GPU where Machete wins
        for f in kernels.values():
            assert f(torch.randn(16, K_, dtype=dtype)).shape == (16, N)
        return {16: [1.0, 2.0], 128: [10.0, 9.0] if machete_wins else [10.0, 11.0]}  # Machete from 17

    monkeypatch.setattr(vllm_ops, "machete_prepack_B", lambda w, a_type, b_type, group_scales_type: w.clone())
    monkeypatch.setattr(km, "time_rows", time_rows)
    monkeypatch.setattr(km, "_measured", {})
    monkeypatch.setattr(km, "_cublade_gemm", w4a16_gemm_ref)
    monkeypatch.setattr(km, "_machete_mm", machete)
    impl = km.CubladeW4A16Machete(layer)

    assert impl.rows == ([17, km.NO_END] if machete_wins else [])
    assert not hasattr(layer, "weight_scale") and not hasattr(layer, "weight_zero_point")  # cublade's blob alone
    kept = {n: tuple(t.shape) for n, t in layer.named_parameters() if n.startswith("machete_")}
    groups = 1 if group_size == -1 else K // group_size
    if machete_wins:  # Machete's layouts: int4 words [K/8, N], scales [groups, N], zero points as -scale x zero
        assert kept == {"machete_weight_packed": (K // 8, N), "machete_weight_scale": (groups, N)} | (
            {} if symmetric else {"machete_weight_zero_point": (groups, N)})
        assert torch.equal(layer.machete_weight_packed, tensors["weight_packed"].t())
        assert (impl.machete_type, impl.machete_group) == (
            (scalar_types.uint4b8 if symmetric else scalar_types.uint4).id, group_size)
    else:
        assert kept == {}
    x = torch.randn(200, K, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for m in (16, 200):
        y = impl.apply(layer, x[:m], None)
        if machete_wins and m > 16:
            assert (y == 7.0).all()
        else:
            assert torch.equal(y, scheme.linear_ref(x[:m], tensors))
    if machete_wins:
        zp = None if symmetric else layer.machete_weight_zero_point.data_ptr()
        assert machete_calls[1:] == [(200, layer.machete_weight_packed.data_ptr(),
                                      layer.machete_weight_scale.data_ptr(), zp, impl.machete_type, group_size)]
    else:
        assert machete_calls[1:] == []
