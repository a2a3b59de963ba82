"""CUBLADE_W4A16_PREFILL=machete,humming (cublade.vllm.kernels.cublade_w4a16_measured): the token ranges taken from
the times measured at load, the layer's wiring (a copy of the weights per vLLM kernel that won a range, each call on
its range's kernel through the one op; the kernels and the timing stood in for: they need the GPU), the op under
torch.compile with the token count dynamic, the op's table of layers, and when the selection picks the kernel class
(GPU mocked: tests/gpu_mock.py). With vLLM's real Machete adapter the copy's layout is checked too (its prepack op
stood in for). The kernels themselves: tests/gpu/test_w4a16_measured.py."""
from __future__ import annotations

import gc

import pytest
import torch
import torch._dynamo
from vllm.scalar_type import scalar_types
from gpu_mock import mocked_gpu
from stand_in import stand_in_layer
from test_vllm_kernels_by_gpu import choice, loaded_layer
from vllm_layers import KINDS

from cublade.config import W4A16Scheme
from cublade.numerics.linear import w4a16_measured_kernels, w4a16_prefill_math
from cublade.ops.w4a16_gemm import w4a16_gemm_ref
from cublade.ops.w4a16_gemm_fp8 import w4a16_gemm_fp8_ref
from cublade.vllm.kernels import cublade_w4a16_measured as km
from cublade.vllm.kernels import measured as mk

END = mk.NO_END


@pytest.mark.parametrize("times,ranges", [
    ({16: [1, 2], 64: [5, 6]}, []),                                                 # never faster
    ({16: [1, 2], 128: [10, 9], 256: [20, 18]}, [(17, END, 1)]),                    # above 16: the next point's
    ({16: [1, 2], 128: [10, 9], 160: [10, 11], 224: [10, 9], 4096: [5, 6]}, [(17, 129, 1), (161, 225, 1)]),
    ({16: [3, 2], 32: [3, 2], 64: [3, 4]}, [(16, 33, 1)]),                          # adjacent points merged
    ({128: [10, 9]}, [(128, END, 1)]),                                              # below the first: cublade's
    ({128: [10, 10]}, []),                                                          # a tie stays on cublade's
    ({128: [10, 9.85], 256: [20, 19.7]}, []),                                       # so does a lead within 2%
    ({128: [10, 9.75]}, [(128, END, 1)]),                                           # a lead past it moves
    ({16: [1, 2, 3], 64: [10, 8, 9], 128: [10, 9, 8], 256: [10, 9, 8.5], 512: [10, 9, 12]},  # the fastest of three
     [(17, 64 + 1, 1), (65, 257, 2), (257, END, 1)]),
    ({64: [10, 12, 9.9], 128: [10, 8, 9.7]}, [(65, END, 1)]),                       # the fastest, if past the margin
])
def test_ranges_from_the_measured_times(times, ranges):
    assert mk.kernel_ranges(times) == ranges


def test_ranges_read_back():
    ranges = [(17, 129, 1), (161, 225, 2), (4000, END, 1)]
    assert [mk.kernel_at(m, ranges) for m in (1, 16, 17, 128, 129, 160, 161, 224, 225, 3999, 4000, 10**6)] == [
        0, 0, 1, 1, 0, 0, 2, 2, 0, 0, 1, 1]
    names = [km.LABELS[n] for n in ("cublade", "machete", "humming")]
    assert mk.describe(ranges, names) == ("vLLM's Machete at 17-128, 4000+ tokens, vLLM's Humming at 161-224 tokens, "
                                          "cublade's kernels at the rest")
    assert mk.describe([], names) == "cublade's kernels at every count"


@pytest.mark.parametrize("value,kernels", [("machete", ("machete",)), ("humming", ("humming",)),
                                           (" Humming, machete ", ("humming", "machete")), ("fp8", ()), ("", ()),
                                           ("fp8,machete", ("fp8", "machete"))])
def test_the_environment_names_the_kernels(monkeypatch, value, kernels):
    monkeypatch.setenv("CUBLADE_W4A16_PREFILL", value)
    assert w4a16_measured_kernels() == kernels
    assert w4a16_prefill_math() == ("measured" if kernels else (value or "bf16"))


@pytest.mark.parametrize("value", ["marlin", "machete,machete", "machete,", "machete;humming", "fp8,fp8", "bf16,fp8",
                                   "machete,bf16"])
def test_the_environment_refuses_what_it_cannot_time(monkeypatch, value):
    monkeypatch.setenv("CUBLADE_W4A16_PREFILL", value)
    with pytest.raises(ValueError, match=r"CUBLADE_W4A16_PREFILL=.*: expected bf16 or fp8, or vLLM kernels to time "
                                         r"against cublade's at load, comma-separated, of machete, humming"):
        w4a16_prefill_math()


class _StandInAdapter:
    """A vLLM kernel's adapter as the kernel class uses it: built on a copy of the layer (whose tensors it reads),
    apply(copy, x, bias). Returns x @ W^T + its own offset, so a call says which kernel ran."""
    built: list = []

    def __init__(self, copy):
        self.offset = float(len(self.built) + 1) * 100
        copy.seen = {n: t.clone() for n, t in copy.named_parameters()}
        self.built.append(self)
        self.calls: list[int] = []

    @classmethod
    def can_implement(cls, layer):
        return True, "stand-in"

    def apply(self, copy, x, bias):
        self.calls.append(x.shape[0])
        return x.new_full((x.shape[0], copy.output_size_per_partition), self.offset)


def stand_in_timing(monkeypatch, kernel_class, adapters: dict, times) -> list:
    """`kernel_class` (a measured kernel class) on the stand-in vLLM kernels `adapters`, with empty tables of timed
    shapes and layers, and a stand-in timing: each kernel run once on the layer's tensors, then `times(K)`, the times
    a GPU gave. Returns the kernels each timing was given, a list per timing."""
    _StandInAdapter.built = []
    monkeypatch.setattr(kernel_class, "vllm_kernels", adapters)
    monkeypatch.setattr(mk, "_measured", {})
    monkeypatch.setattr(mk, "_layers", {})
    timed = []

    def time_rows(kernels, K, dtype, device):
        timed.append(list(kernels))
        for f in kernels.values():  # each kernel runs on the layer's tensors
            f(torch.randn(16, K, dtype=dtype))
        return times(K)
    monkeypatch.setattr(mk, "time_rows", time_rows)
    return timed


@pytest.fixture
def stand_ins(monkeypatch):
    """cublade's op as its reference, two stand-in vLLM kernels, and the times a GPU gave: Machete fastest at 128-256
    tokens, Humming from 512 (k = 1, 2); Humming never wins on a shape of N = 64."""
    monkeypatch.setattr(km, "_cublade_gemm", w4a16_gemm_ref)
    monkeypatch.setenv("CUBLADE_W4A16_PREFILL", "machete,humming")
    return stand_in_timing(monkeypatch, km.CubladeW4A16Measured, {"machete": type("M", (_StandInAdapter,), {}),
                                                                  "humming": type("H", (_StandInAdapter,), {})},
                           lambda K: {16: [1.0, 2.0, 3.0], 128: [10.0, 8.0, 9.0], 256: [20.0, 15.0, 16.0],
                                      512: [40.0, 39.0, 30.0 if K == 256 else 1e9]})


def w4a16_layer(N=128, K=256, scheme=W4A16Scheme(128, True), prefix="model.layers.0.mlp.down_proj", seed=0):
    tensors = scheme.quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05)
    layer = stand_in_layer(scheme, {k: v.clone() for k, v in tensors.items()}, N, K, device="cpu")
    layer.prefix = prefix
    return layer, tensors


def test_each_call_runs_on_its_ranges_kernel_with_its_copy(stand_ins):
    scheme = W4A16Scheme(128, True)
    layer, tensors = w4a16_layer(scheme=scheme)
    impl = km.CubladeW4A16Measured(layer)
    machete, humming = _StandInAdapter.built
    assert stand_ins == [["cublade", "machete", "humming"]]
    assert impl.ranges == [(17, 257, 1), (257, END, 2)]
    for copy in (layer.cublade_machete, layer.cublade_humming):  # each built on the checkpoint's own tensors
        assert all(torch.equal(copy.seen[n], t) for n, t in tensors.items())
    assert not hasattr(layer, "weight_scale")  # the layer itself holds cublade's blob alone
    x = torch.randn(600, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for m in (1, 16, 17, 256, 257, 600):
        y = impl.apply(layer, x[:m], None)
        want = {0: None, 1: 100.0, 2: 200.0}[mk.kernel_at(m, impl.ranges)]
        assert y.shape == (m, 128)
        assert torch.equal(y, scheme.linear_ref(x[:m], tensors)) if want is None else (y == want).all(), m
    assert machete.calls[1:] == [17, 256] and humming.calls[1:] == [257, 600]
    bias, x3 = torch.randn(128).to(torch.bfloat16), x[:300].reshape(100, 3, 256)  # [.., K] in, 300 rows: Humming's
    assert torch.equal(impl.apply(layer, x3, bias), torch.full((100, 3, 128), 200.0, dtype=torch.bfloat16) + bias)


def test_a_kernel_that_wins_nothing_keeps_no_copy(stand_ins):
    layer, _ = w4a16_layer(K=512)  # on K = 512 the stand-in Humming never leads
    impl = km.CubladeW4A16Measured(layer)
    assert impl.ranges == [(17, END, 1)]
    assert isinstance(layer.cublade_machete, torch.nn.Module) and layer.cublade_humming is None
    assert not any(n.startswith("cublade_humming") for n, _ in layer.named_parameters())


def test_the_log_gives_the_bytes_of_each_copy_kept(stand_ins, monkeypatch):
    said = []
    monkeypatch.setattr(mk.logger, "info", lambda msg, *args: said.append(msg % args))
    for K, kept in ((256, ("Machete", "Humming")), (512, ("Machete",))):  # on K = 512 Humming wins nothing
        layer, tensors = w4a16_layer(N=4096, K=K)
        km.CubladeW4A16Measured(layer)
        mib = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20  # the stand-ins keep them as given
        line = [s for s in said if "measured at load" in s][-1]
        assert [n for n in ("Machete", "Humming") if f"vLLM's {n}'s copy {mib:.2f} MiB a layer" in line] == list(kept)
        assert line.count("'s copy") == len(kept), line


def test_the_log_says_where_outputs_are_not_bit_reproducible(stand_ins, monkeypatch):
    said = []
    monkeypatch.setattr(mk.logger, "info", lambda msg, *args: said.append(msg % args))
    mk.say_humming_order.cache_clear()
    km.CubladeW4A16Measured(w4a16_layer(K=512)[0])  # Humming wins nothing here: nothing to say
    assert not any("stream-K" in line for line in said)
    km.CubladeW4A16Measured(w4a16_layer(K=256)[0])
    km.CubladeW4A16Measured(w4a16_layer(K=256, prefix="model.layers.1.mlp.down_proj")[0])
    assert [line for line in said if "stream-K" in line] == [
        "cublade: vLLM's Humming splits K across thread blocks (stream-K) and adds their parts in no fixed order: at "
        "the token counts it runs, outputs can differ in the last bits from run to run"]  # once a process


def test_the_compiled_graph_does_not_depend_on_what_was_measured(stand_ins, monkeypatch):
    """vLLM may load a model compiled in another run (VLLM_USE_AOT_COMPILE), whose timings at load came out
    otherwise: a layer calls the op whatever it measured, cublade's kernels having won every count included."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    monkeypatch.setattr(mk, "time_rows", lambda kernels, K, dtype, device: {16: [1.0, 2.0, 3.0]})
    layer, tensors = w4a16_layer()
    impl = km.CubladeW4A16Measured(layer)
    assert impl.ranges == [] and layer.cublade_machete is None and layer.cublade_humming is None
    x = torch.randn(40, 256).to(torch.bfloat16)
    torch._dynamo.reset()
    y = torch.compile(lambda x: impl.apply(layer, x, None), fullgraph=True, backend=backend)(x)
    assert torch.equal(y, W4A16Scheme(128, True).linear_ref(x, tensors))
    assert torch.ops.cublade.measured_linear in graphs[0]


@pytest.mark.parametrize("K,built", [(256, 6), (512, 4)])
def test_one_timing_per_layer_shape(stand_ins, K, built):
    """Each shape is timed once; the next layers of that shape build only the kernels that won a range on it (on
    K = 512 Humming wins none: 2 adapters for the first layer, then Machete's alone)."""
    impls = [km.CubladeW4A16Measured(w4a16_layer(K=K, prefix=f"model.layers.{i}.mlp.down_proj")[0]) for i in range(3)]
    assert len(stand_ins) == 1 and all(i.ranges == impls[0].ranges for i in impls)
    assert [i.layer_name for i in impls] == [f"model.layers.{i}.mlp.down_proj" for i in range(3)]
    assert len(_StandInAdapter.built) == built


def test_the_ops_table_names_live_layers_apart(stand_ins):
    """The op finds a layer by vLLM's prefix; a second model's layer of the same prefix alive in the same process
    (tests, several engines) gets a name of its own, and a freed layer's name is taken over."""
    a, _ = w4a16_layer(prefix="model.layers.0.mlp.down_proj")
    b, _ = w4a16_layer(prefix="model.layers.0.mlp.down_proj")
    ia, ib = km.CubladeW4A16Measured(a), km.CubladeW4A16Measured(b)
    assert (ia.layer_name, ib.layer_name) == ("model.layers.0.mlp.down_proj", "model.layers.0.mlp.down_proj#1")
    x = torch.randn(300, 256).to(torch.bfloat16)  # Humming's range: each layer's own adapter (the 2nd and 4th built)
    assert (ia.apply(a, x, None) == 200.0).all() and (ib.apply(b, x, None) == 400.0).all()
    del a, ia
    gc.collect()
    c, _ = w4a16_layer(prefix="model.layers.0.mlp.down_proj")
    assert km.CubladeW4A16Measured(c).layer_name == "model.layers.0.mlp.down_proj"


# torch's own patch: monkeypatch's undo would delete the option, and every later compile in the process would fail
@torch._dynamo.config.patch(error_on_recompile=True)
def test_the_choice_by_token_count_is_made_at_run_time_not_traced(stand_ins):
    """vLLM compiles the model with the token count dynamic: the op must not put a guard on it (a guard would
    recompile, or in vLLM fail, at the first call on the other side of a boundary)."""
    layer, _ = w4a16_layer()
    impl = km.CubladeW4A16Measured(layer)
    machete, humming = _StandInAdapter.built

    @torch.compile(fullgraph=True, dynamic=True, backend="eager")
    def step(x):
        return impl.apply(layer, x, None)

    for m in (20, 300, 30, 400, 10):
        assert step(torch.randn(m, 256).to(torch.bfloat16)).shape == (m, 128)
    assert machete.calls[1:] == [20, 30] and humming.calls[1:] == [300, 400]


@pytest.mark.parametrize("scheme", [W4A16Scheme(128, True), W4A16Scheme(128, False), W4A16Scheme(-1, True)],
                         ids=lambda s: s.describe())
def test_selected_on_hopper_only_when_asked_for(vllm_ctx, monkeypatch, scheme):
    layer = loaded_layer(scheme, KINDS["qkv"], monkeypatch)
    with mocked_gpu(monkeypatch, 90):
        got, _, skipped = choice(layer)
        assert got == "cublade-w4a16-gemm"
        assert ("cublade-w4a16-measured: runs when asked for (CUBLADE_W4A16_PREFILL=machete, humming or "
                "machete,humming)") in skipped
        monkeypatch.setenv("CUBLADE_W4A16_PREFILL", "machete")
        got, reason, _ = choice(layer)
        assert got == "cublade-w4a16-measured" and "vLLM's Machete at the token counts where measured" in reason
        monkeypatch.setenv("CUBLADE_W4A16_PREFILL", "machete,humming")  # vLLM's Humming: CUDA only
        got, _, skipped = choice(layer)
        assert got == "cublade-w4a16-gemm"
        assert any(s.startswith("cublade-w4a16-measured: needs vLLM's Humming too: ") for s in skipped)
        monkeypatch.setenv("CUBLADE_W4A16_PREFILL", "machete")
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
        got, _, skipped = choice(layer)
        assert got == "cublade-w4a16-gemm"
        assert any(s.startswith("cublade-w4a16-measured: VLLM_BATCH_INVARIANT=1") for s in skipped)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    with mocked_gpu(monkeypatch, 89):  # no Machete, and cublade's sm_90a kernels do not run: Marlin as before
        assert choice(layer)[0] == "vllm-marlin"


def test_without_machete_the_layer_keeps_cublades_kernels(vllm_ctx, monkeypatch):
    """Machete takes N % 128 == 0 and K % 64 == 0 per rank: a layer it cannot take stays on cublade's kernels,
    and the reason says why the kernel class was passed over."""
    layer = loaded_layer(W4A16Scheme(128, True), KINDS["qkv"], monkeypatch)
    layer.output_size_per_partition = 200  # as if a rank held 200 rows
    monkeypatch.setenv("CUBLADE_W4A16_PREFILL", "machete")
    with mocked_gpu(monkeypatch, 90):
        ok, why = km.CubladeW4A16Measured.can_implement(layer)
    assert not ok and why.startswith("needs vLLM's Machete too: ")


@pytest.mark.parametrize("group_size,symmetric", [(128, True), (128, False), (-1, True)])
@pytest.mark.parametrize("machete_wins", [True, False])
def test_machetes_copy_in_its_layout(vllm_ctx, monkeypatch, group_size, symmetric, machete_wins):
    """With vLLM's real Machete adapter (MacheteLinearKernel's weight transforms run; only its prepack op, a CUDA op,
    stood in for by a copy, and machete_mm): Machete's copy in Machete's layouts beside cublade's blob (dropped when
    Machete wins no count), each call of its range given the copy's tensors."""
    import vllm._custom_ops as vllm_ops

    scheme, N, K = W4A16Scheme(group_size, symmetric), 256, 512
    layer, tensors = w4a16_layer(N, K, scheme)
    machete_calls = []

    def machete_mm(a, b_q, b_type, b_group_zeros=None, b_group_scales=None, b_group_size=None, **kw):
        machete_calls.append((a.shape[0], b_q.data_ptr(), b_group_scales.data_ptr(),
                              None if b_group_zeros is None else b_group_zeros.data_ptr(), b_type.id, b_group_size))
        return a.new_full((a.shape[0], N), 7.0)

    def time_rows(kernels, K_, dtype, device):  # each kernel run once, then the times of a GPU where Machete wins
        for f in kernels.values():
            assert f(torch.randn(16, K_, dtype=dtype)).shape == (16, N)
        return {16: [1.0, 2.0], 128: [10.0, 9.0] if machete_wins else [10.0, 11.0]}  # Machete from 17

    monkeypatch.setattr(vllm_ops, "machete_prepack_B", lambda w, a_type, b_type, group_scales_type: w.clone())
    monkeypatch.setattr(vllm_ops, "machete_mm", machete_mm)
    monkeypatch.setattr(mk, "time_rows", time_rows)
    monkeypatch.setattr(mk, "_measured", {})
    monkeypatch.setattr(km, "_cublade_gemm", w4a16_gemm_ref)
    monkeypatch.setenv("CUBLADE_W4A16_PREFILL", "machete")
    impl = km.CubladeW4A16Measured(layer)

    assert impl.ranges == ([(17, END, 1)] if machete_wins else [])
    assert not hasattr(layer, "weight_scale") and not hasattr(layer, "weight_zero_point")  # cublade's blob alone
    kept = {n: tuple(t.shape) for n, t in layer.named_parameters() if n.startswith("cublade_machete.")}
    groups = 1 if group_size == -1 else K // group_size
    copy = layer.cublade_machete
    if machete_wins:  # Machete's layouts: int4 words [K/8, N], scales [groups, N], zero points as -scale x zero
        assert kept == {"cublade_machete.weight_packed": (K // 8, N), "cublade_machete.weight_scale": (groups, N)} | (
            {} if symmetric else {"cublade_machete.weight_zero_point": (groups, N)})
        assert torch.equal(copy.weight_packed, tensors["weight_packed"].t())
    else:
        assert kept == {} and copy is None
    x = torch.randn(200, K, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for m in (16, 200):
        y = impl.apply(layer, x[:m], None)
        if machete_wins and m > 16:
            assert (y == 7.0).all()
        else:
            assert torch.equal(y, scheme.linear_ref(x[:m], tensors))
    if machete_wins:
        zp = None if symmetric else copy.weight_zero_point.data_ptr()
        wtype = (scalar_types.uint4b8 if symmetric else scalar_types.uint4).id
        assert machete_calls[1:] == [(200, copy.weight_packed.data_ptr(), copy.weight_scale.data_ptr(), zp, wtype,
                                      group_size)]
    else:
        assert machete_calls[1:] == []


def test_a_kernel_that_cannot_be_captured_is_timed_eagerly(monkeypatch):
    """_replay: f(x) as a CUDA graph where it can be captured (the graph's replay, the graph kept alive), else f(x)
    itself, said in the log (the CUDA graph API stood in for: no GPU here)."""
    import contextlib

    said, capturing = [], []
    monkeypatch.setattr(mk.logger, "info", lambda msg, *args: said.append(msg % args))

    class Graph:
        def replay(self):
            return "replayed"

    @contextlib.contextmanager
    def graph(g, capture_error_mode):
        assert capture_error_mode == "thread_local"  # another thread's CUDA calls do not spoil the capture
        capturing.append(g)
        try:
            yield
        finally:
            capturing.remove(g)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    x, calls = torch.ones(2), []

    def capturable(a):
        calls.append(("captured" if capturing else "eager", a))
    call, kept = mk._replay(capturable, x)
    assert isinstance(kept, Graph) and call() == "replayed" and calls == [("captured", x)] and not said

    def uncapturable(a):
        if capturing:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")
        calls.append(("eager", a))
    calls.clear()
    call, kept = mk._replay(uncapturable, x)
    assert kept is None and not calls
    call()
    assert calls == [("eager", x)]
    assert said == ["cublade: a kernel timed without a CUDA graph (CUDA error: operation not permitted when "
                    "stream is capturing)"]


def test_the_fp8_path_is_timed_on_the_layers_own_blob(stand_ins, monkeypatch):
    """"fp8" among the names: cublade's FP8 tensor-core path is a timed column like a vLLM kernel, but runs on the
    layer's own blob (no copy), with min_rows 0 where it won (here the op's reference on CPU: activations rounded to
    E4M3 per 1 x 128)."""
    said = []
    monkeypatch.setattr(mk.logger, "info", lambda msg, *args: said.append(msg % args))
    monkeypatch.setenv("CUBLADE_W4A16_PREFILL", "machete,fp8")
    monkeypatch.setattr(mk, "time_rows", lambda kernels, K, dtype, device: (stand_ins.append(list(kernels)), {
        16: [1.0, 2.0, 3.0], 128: [10.0, 8.0, 9.0], 512: [40.0, 39.0, 30.0]})[1])
    scheme = W4A16Scheme(128, True)
    layer, tensors = w4a16_layer(scheme=scheme)
    impl = km.CubladeW4A16Measured(layer)
    assert stand_ins == [["cublade", "machete", "fp8"]]
    assert impl.ranges == [(17, 129, 1), (129, END, 2)]
    assert impl.said() == ("vLLM's Machete at 17-128 tokens, cublade's FP8 tensor-core path at 129+ tokens, "
                           "cublade's kernels at the rest")
    assert isinstance(layer.cublade_machete, torch.nn.Module) and not hasattr(layer, "cublade_fp8")
    line, = [s for s in said if "measured at load" in s]
    assert "vLLM's Machete's copy" in line and "FP8 tensor-core path's copy" not in line
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y = impl.apply(layer, x, None)
    assert torch.equal(y, w4a16_gemm_fp8_ref(x, layer.weight_packed, 128, True, 128, 0))
    assert not torch.equal(y, scheme.linear_ref(x, tensors))  # the activations' E4M3 rounding: not the bf16 math
    assert torch.equal(impl.apply(layer, x[:16], None), scheme.linear_ref(x[:16], tensors))


@pytest.mark.parametrize("scheme", [W4A16Scheme(128, True), W4A16Scheme(32, True)], ids=lambda s: s.describe())
def test_the_fp8_path_only_where_it_runs(vllm_ctx, monkeypatch, scheme):
    layer = loaded_layer(scheme, KINDS["qkv"], monkeypatch)
    monkeypatch.setenv("CUBLADE_W4A16_PREFILL", "fp8,machete")
    with mocked_gpu(monkeypatch, 90):
        ok, why = km.CubladeW4A16Measured.can_implement(layer)
    if scheme.group_size == 128:
        assert ok and "cublade's FP8 tensor-core path and vLLM's Machete at the token counts" in why, why
    else:
        assert not ok and why == ("needs cublade's FP8 tensor-core path too: needs group size 128 or per channel "
                                  "(1 x 128 block scales), the layer has 32")


@pytest.mark.parametrize("fails_in", ["preparation", "timing"])
def test_a_named_kernel_that_fails_here_stops_the_load_in_one_line(stand_ins, monkeypatch, fails_in):
    """vLLM's Humming compiles its kernels on first use: where that fails on the serving machine (no nvcc, say), the
    load stops with one line naming the setting, the kernel, the layer shape and the error, not inside Humming."""
    class Failing(_StandInAdapter):
        def __init__(self, copy):
            if fails_in == "preparation":
                raise ImportError("no module named humming.jit\n  more lines")
            super().__init__(copy)

        def apply(self, copy, x, bias):
            raise RuntimeError("nvcc not found")
    kernels = dict(km.CubladeW4A16Measured.vllm_kernels, humming=Failing)
    monkeypatch.setattr(km.CubladeW4A16Measured, "vllm_kernels", kernels)
    with pytest.raises(RuntimeError) as e:
        km.CubladeW4A16Measured(w4a16_layer()[0])
    why = "ImportError: no module named humming.jit" if fails_in == "preparation" else "RuntimeError: nvcc not found"
    assert str(e.value) == (
        "cublade: CUBLADE_W4A16_PREFILL='machete,humming' asks for a vLLM kernel that failed on this machine while "
        f"w4a16 layers of N=128, K=256 were prepared for it at load (vLLM's Humming: {why}); leave it out of "
        "CUBLADE_W4A16_PREFILL")
