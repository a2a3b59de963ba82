"""CUBLADE_L2_PREFETCH (cublade.vllm.kernels.prefetch) on CPU: the setting; the chain (each layer, in the order vLLM
prepares them, becomes what the layer before it prefetches, bytes capped by the setting and the tensor); and the
layers' ops, which after their GEMM ask for the next layer's weight (the op recorded) with outputs unchanged, also
inside a compiled graph, where an op without outputs would have been dropped. The kernel: tests/ops/test_l2_prefetch.py;
the fp8 CUTLASS route and the GPU outputs: tests/gpu/test_l2_prefetch_layers.py."""
from __future__ import annotations

import pytest
import torch

from cublade.vllm.kernels import prefetch
from cublade.vllm.kernels.prefetch import MIB


@pytest.fixture
def chain(monkeypatch):
    """A fresh chain, and the prefetches the ops ask for as (tensor, bytes)."""
    monkeypatch.setattr(prefetch, "_names", {})
    monkeypatch.setattr(prefetch, "_next", {})
    monkeypatch.setattr(prefetch, "_last", [None])
    asked: list[tuple[torch.Tensor, int]] = []
    monkeypatch.setattr(prefetch, "l2_prefetch", lambda t, n: asked.append((t, n)))
    return asked


class Kernel:
    """A kernel as `link` sees one."""

    def __init__(self, streamed="weight", prefetches=True):
        self.streamed, self.prefetches, self.prefetch_name = streamed, prefetches, ""


def layer(nbytes: int) -> torch.nn.Module:
    m = torch.nn.Module()
    m.weight = torch.nn.Parameter(torch.zeros(nbytes, dtype=torch.uint8), requires_grad=False)
    return m


def test_setting(monkeypatch):
    monkeypatch.delenv(prefetch.ENV, raising=False)
    assert prefetch.prefetch_mib() == 0
    monkeypatch.setenv(prefetch.ENV, "24")
    assert prefetch.prefetch_mib() == 24
    monkeypatch.setenv(prefetch.ENV, "on")
    with pytest.raises(ValueError, match=r"^CUBLADE_L2_PREFETCH='on': expected a whole number of MiB \(0: off\)"):
        prefetch.prefetch_mib()


def test_each_layer_prefetches_the_next(chain):
    layers = [layer(n) for n in (30 * MIB, 16 * MIB, 100, 50 * MIB)]
    kernels = [Kernel() for _ in layers]
    for i, (l, k) in enumerate(zip(layers, kernels)):
        prefetch.link(l, f"model.layers.0.p{i}", k, mib=24)
    assert [k.prefetch_name for k in kernels] == [f"model.layers.0.p{i}" for i in range(4)]
    got = [prefetch.next_of(k.prefetch_name) for k in kernels]
    assert got[0][0] is layers[1].weight and got[0][1] == 16 * MIB  # the whole of a smaller weight
    assert got[1][0] is layers[2].weight and got[1][1] == 100
    assert got[2][0] is layers[3].weight and got[2][1] == 24 * MIB  # capped by the setting
    assert got[3] is None  # the last layer: nothing after it (yet)
    prefetch.after(kernels[0].prefetch_name)
    prefetch.after(kernels[3].prefetch_name)
    assert len(chain) == 1 and chain[0][0] is layers[1].weight and chain[0][1] == 16 * MIB


def test_chain_gaps(chain):
    """A layer whose kernel streams nothing cublade knows leaves the one before it without a next; one whose kernel
    does not prefetch is still prefetched by the one before, and prefetches nothing; unset, nothing is linked."""
    a, c, b, d = (layer(MIB) for _ in range(4))
    ka, kc, kb, kd = Kernel(), Kernel(streamed=None), Kernel(prefetches=False), Kernel()
    for i, (l, k) in enumerate(((a, ka), (c, kc), (b, kb), (d, kd))):
        prefetch.link(l, f"l{i}", k, mib=8)
    assert prefetch.next_of("l0") is None  # c: nothing to prefetch
    assert prefetch.next_of("l1")[0] is b.weight  # b is prefetched ...
    assert kb.prefetch_name == ""  # ... but prefetches nothing, so d is not prefetched
    assert kd.prefetch_name == "l3" and list(prefetch._next) == ["l1"]
    e, ke = layer(MIB), Kernel()
    prefetch.link(e, "l4", ke, mib=0)
    assert ke.prefetch_name == "" and prefetch.next_of("l3") is None


def test_names_and_freed_layers(chain):
    """Two live models' layers of one prefix get two names; a freed next layer's weight is not fetched."""
    a, b, ka, kb = layer(MIB), layer(MIB), Kernel(), Kernel()
    prefetch.link(a, "model.layers.0.qkv_proj", ka, mib=8)
    prefetch.link(b, "model.layers.0.qkv_proj", kb, mib=8)
    assert (ka.prefetch_name, kb.prefetch_name) == ("model.layers.0.qkv_proj", "model.layers.0.qkv_proj#1")
    del b
    import gc

    gc.collect()
    prefetch.after(ka.prefetch_name)
    assert chain == []


def w4a16_layers(n: int):
    from cublade.config import W4A16Scheme
    from cublade.vllm.kernels.cublade_w4a16_gemm import CubladeW4A16Gemm
    from stand_in import stand_in_layer

    scheme = W4A16Scheme(128, True)
    out = []
    for i in range(n):
        tensors = scheme.quantize(torch.randn(256, 512, generator=torch.Generator().manual_seed(i)) * 0.05)
        lay = stand_in_layer(scheme, tensors, 256, 512, device="cpu")
        k = CubladeW4A16Gemm(lay)  # on CPU its op is the reference
        prefetch.link(lay, f"w4a16.{i}", k, mib=24)
        out.append((lay, k))
    return out


def test_w4a16_layer_op(vllm_ctx, chain):
    (l0, k0), (l1, _) = w4a16_layers(2)
    x = torch.randn(3, 512, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(9))
    y = k0.apply(l0, x, None)
    k0.prefetch_name = ""
    assert torch.equal(y, k0.apply(l0, x, None))  # the same op output without the prefetch
    assert len(chain) == 1 and chain[0][0] is l1.weight_packed
    assert chain[0][1] == l1.weight_packed.numel() * l1.weight_packed.element_size()


def test_prefetch_survives_compile(vllm_ctx, chain):
    """Under torch.compile (fullgraph, as vLLM compiles) the prefetch runs at every call: it is inside the layer's op,
    whose output the graph needs."""
    (l0, k0), (l1, _) = w4a16_layers(2)
    fn = torch.compile(lambda x: k0.apply(l0, x, None), backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 512, dtype=torch.bfloat16)
    fn(x)
    fn(x)
    assert [t is l1.weight_packed for t, _ in chain] == [True, True]


def test_fp8_layer_op(vllm_ctx, chain):
    """cublade::fp8_linear (cublade-fp8-gemm's op) with a layer name: the reference's output and the next weight."""
    from cublade.config import Fp8Scheme
    from cublade.numerics.linear import fp8_linear_ref
    from cublade.vllm.kernels.cublade_fp8_gemm import fp8_linear

    scheme = Fp8Scheme("channel", "dynamic-token")
    w, ws = (scheme.quantize(torch.randn(64, 256) * 0.05)[k] for k in ("weight", "weight_scale"))
    ws = ws.float().reshape(-1)
    nxt, k0, k1 = layer(3 * MIB), Kernel(), Kernel()
    prefetch.link(layer(1), "fp8.0", k0, mib=2)
    prefetch.link(nxt, "fp8.1", k1, mib=2)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    assert torch.equal(fp8_linear(x, w, ws, 16, "f16", k0.prefetch_name), fp8_linear_ref(x, w, ws))
    assert len(chain) == 1 and chain[0][0] is nxt.weight and chain[0][1] == 2 * MIB
