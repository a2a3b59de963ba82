"""CUBLADE_W4A16_PREFILL=machete (cublade.vllm.kernels.cublade_w4a16_machete): the token ranges taken from the times
measured at load, the dispatch op that follows them (its two kernels stood in for: they need the GPU), its trace
under torch.compile with the token count dynamic, and when the selection picks the kernel class (GPU mocked:
tests/gpu_mock.py). The kernels themselves against their references: tests/gpu/test_w4a16_machete.py."""
from __future__ import annotations

import pytest
import torch
from gpu_mock import mocked_gpu
from test_vllm_kernels_by_gpu import choice, loaded_layer
from vllm_layers import KINDS

from cublade.config import W4A16Scheme
from cublade.vllm.kernels import cublade_w4a16_machete as km

END = km.NO_END


@pytest.mark.parametrize("times,rows", [
    ({16: (1, 2), 64: (5, 6)}, []),                                              # never faster
    ({16: (1, 2), 128: (10, 9), 256: (20, 18)}, [128, END]),                     # from 128 on
    ({16: (1, 2), 128: (10, 9), 160: (10, 11), 224: (10, 9), 4096: (5, 6)}, [128, 160, 224, 4096]),
    ({16: (3, 2), 32: (3, 2), 64: (3, 4)}, [16, 64]),                            # adjacent points merged
    ({128: (10, 10)}, []),                                                       # a tie stays on cublade's
])
def test_machete_rows_from_the_measured_times(times, rows):
    assert km.machete_rows(times) == rows


def test_rows_read_back():
    rows = [128, 160, 224, 4096]
    assert [m for m in (1, 127, 128, 159, 160, 223, 224, 4095, 4096, 10**6) if km.on_machete(m, rows)] == [
        128, 159, 224, 4095]
    assert km.describe_rows(rows) == "128-159, 224-4095" and km.describe_rows([256, END]) == "256+"
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
