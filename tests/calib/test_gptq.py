"""GPTQ on single layers: the checkpoint format it writes, that it reduces to round-to-nearest when there
is nothing to compensate, and that it beats round-to-nearest on correlated held-in inputs."""
from __future__ import annotations

import itertools

import pytest
import torch

from cublade.calib.gptq import GPTQConfig, gptq_quantize, search_group_params, weighted_error
from cublade.config import W4A16Scheme
from cublade.numerics.int4 import group_params, int4_dequant_weight, int4_quant_weight, pack_int4, quantize_groups

PLAIN = GPTQConfig(clip_grid=0, act_order=False)  # the paper's algorithm: abs-max group scales


def _layer(N=48, K=256, tokens=2048, seed=0):
    """A weight and held-in inputs with the structure that makes GPTQ matter: correlated input features
    (a random mixing) and a few outlier channels, as LLM activations have."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(N, K, generator=g) * 0.05
    X = torch.randn(tokens, K, generator=g) @ (torch.eye(K) + 0.3 * torch.randn(K, K, generator=g))
    X[:, :4] *= 8  # outlier channels
    return W, X


def _dequant(t, gs):
    return int4_dequant_weight(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"), gs)


CASES = list(itertools.product((32, 128, -1), (True, False), (False, True)))


@pytest.mark.parametrize("gs,sym,act_order", CASES)
def test_identity_hessian_is_round_to_nearest_bit_exact(gs, sym, act_order):
    # With H = I no column's error feeds any other: GPTQ without the scale search is RTN, bit for bit.
    W, _ = _layer()
    r = gptq_quantize(W, torch.eye(W.shape[1]), gs, sym, GPTQConfig(clip_grid=0, act_order=act_order))
    ref = int4_quant_weight(W, gs, sym)
    assert set(r.tensors) == set(ref)
    for k in ref:
        assert torch.equal(r.tensors[k], ref[k]), k


@pytest.mark.parametrize("gs,sym,act_order", CASES)
def test_format_matches_the_scheme_and_decodes_to_what_gptq_used(gs, sym, act_order):
    W, X = _layer(N=40, K=128)
    r = gptq_quantize(W, X.t() @ X, gs, sym, GPTQConfig(act_order=act_order))
    specs = W4A16Scheme(group_size=gs, symmetric=sym).tensor_specs(*W.shape)
    assert {k: (tuple(v.shape), v.dtype) for k, v in r.tensors.items()} == specs
    # error feedback was computed against exactly the values the checkpoint decodes to
    assert torch.equal(_dequant(r.tensors, gs), r.dequant)


@pytest.mark.parametrize("gs,sym,act_order", CASES)
def test_gptq_output_error_below_rtn_on_held_in_data(gs, sym, act_order):
    W, X = _layer()
    H = X.t() @ X
    rtn = weighted_error(W, _dequant(int4_quant_weight(W, gs, sym), gs), H)
    plain = weighted_error(W, gptq_quantize(W, H, gs, sym, GPTQConfig(clip_grid=0, act_order=act_order)).dequant, H)
    full = weighted_error(W, gptq_quantize(W, H, gs, sym, GPTQConfig(act_order=act_order)).dequant, H)
    # ||X W^T - X Q^T||^2 on the calibration inputs themselves; measured ratios are 0.18 - 0.32
    print(f"\ng={gs} sym={sym} act_order={act_order}: plain GPTQ / RTN {plain / rtn:.3f}, "
          f"GPTQ + range search / RTN {full / rtn:.3f}")
    assert plain < 0.5 * rtn
    assert full < 0.5 * rtn


def test_weighted_error_is_the_output_error():
    W, X = _layer(N=8, K=64, tokens=256)
    Q = _dequant(int4_quant_weight(W, 32, True), 32)
    direct = ((X @ W.t() - X @ Q.t()) ** 2).sum()
    assert weighted_error(W, Q, X.t() @ X) == pytest.approx(direct.item(), rel=1e-4)


def test_dead_inputs_are_rounded_to_nearest_and_pass_no_error():
    # Inputs that are always zero (the padded model's padding) give zero Hessian rows: no NaN, the weights
    # stay (an input dead on the calibration text need not be dead elsewhere), rounded like RTN.
    W, X = _layer(N=16, K=128)
    X[:, 64:] = 0
    r = gptq_quantize(W, X.t() @ X, 64, True, PLAIN)
    assert torch.isfinite(r.dequant).all()
    rtn = _dequant(int4_quant_weight(W, 64, True), 64)
    assert torch.equal(r.dequant[:, 64:], rtn[:, 64:])


def test_all_zero_rows_keep_a_finite_scale():
    W, X = _layer(N=16, K=128)
    W[3] = 0
    r = gptq_quantize(W, X.t() @ X, 32, False, GPTQConfig())
    assert torch.isfinite(r.dequant).all() and (r.dequant[3] == 0).all()
    assert (r.tensors["weight_scale"].float() > 0).all()


def test_range_search_never_worse_than_absmax_on_its_own_objective():
    W, _ = _layer(N=32, K=128)
    s, _ = search_group_params(W, 32, True, GPTQConfig(clip_grid=100, clip_weighted=False, clip_norm=2.0))
    s0, _ = group_params(W, 32, True)

    def group_err(scale):
        q = int4_dequant_weight(pack_int4(quantize_groups(W, scale, None, 32)), scale, None, 32)
        return ((q - W) ** 2).reshape(32, 4, 32).sum(-1)

    assert (group_err(s) <= group_err(s0)).all() and group_err(s).sum() < group_err(s0).sum()
    assert (s.float() <= s0.float()).all()  # it only shrinks the range


def test_bad_inputs_are_refused_by_name():
    W, X = _layer(N=8, K=64, tokens=128)
    H = X.t() @ X
    with pytest.raises(ValueError, match=r"Hessian of layer.x has shape \(32, 32\), expected \(64, 64\)"):
        gptq_quantize(W, H[:32, :32], 32, True, name="layer.x")
    bad = H.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="Hessian of layer.x has NaN/Inf"):
        gptq_quantize(W, bad, 32, True, name="layer.x")
    with pytest.raises(ValueError, match="in_features=64 is not a multiple of group_size=128"):
        gptq_quantize(W, H, 128, True)
    with pytest.raises(ValueError, match="damp_percent"):
        GPTQConfig(damp_percent=0)
    with pytest.raises(ValueError, match="clip_min"):
        GPTQConfig(clip_min=1.5)


def test_rank_deficient_hessian_is_rescued_by_dampening():
    W, X = _layer(N=8, K=64, tokens=16)  # 16 tokens: rank 16 of 64
    r = gptq_quantize(W, X.t() @ X, 32, True, GPTQConfig(damp_percent=1e-6))
    assert torch.isfinite(r.dequant).all() and r.damp > 0
