"""The calibration accuracy bars on the padded stories260K model, end to end through `cublade convert`
and the reference backend (fp32, windows of 512).

Split of the bundled text (19 stories, one per line): calibrate on lines [0:6) (3516 tokens), score on
lines [6:) (12010 tokens); calibration never sees the scored text.
"""
from __future__ import annotations

import pytest
import torch

from cublade.ppl import evaluate
from cublade.reference import load_reference_model
from cublade.text import tokenize, windows

CALIB, EVAL = slice(0, 6), slice(6, None)


@pytest.fixture(scope="module")
def score(valid_text):
    cache = {}

    def get(model_dir) -> float:
        if model_dir not in cache:
            cache[model_dir] = evaluate(model_dir, valid_text, lines=EVAL).loss
        return cache[model_dir]

    return get


@pytest.fixture(scope="module")
def calibrated(converted, valid_text):
    return lambda name, **kw: converted(name, calib_text=valid_text, calib_lines=CALIB, **kw)


def test_gptq_w4a16_g128_recovers_at_least_40_percent_of_rtn_loss(padded_model_dir, converted, calibrated, score):
    base, rtn, gptq = score(padded_model_dir), score(converted("w4a16")), score(calibrated("w4a16"))
    recovered = (rtn - gptq) / (rtn - base)
    print(f"\nbaseline {base:.4f}  RTN g128 {rtn:.4f} ({rtn - base:+.4f})  GPTQ g128 {gptq:.4f} ({gptq - base:+.4f})  "
          f"recovered {recovered:.1%}")
    assert recovered >= 0.40  # measured 67.8%


def test_the_calibration_data_matters_beyond_the_range_search(tmp_path, padded_model_dir, valid_text, converted,
                                                              calibrated, score, monkeypatch):
    # GPTQ's default includes a per-group range search that needs no data. Run it alone (GPTQ with H = I: no
    # error feedback, so plain rounding on the searched grid) to show how much the Hessians add.
    import cublade.calib
    from cublade.config import preset
    from cublade.convert import convert

    gptq = cublade.calib.gptq_quantize
    monkeypatch.setattr(cublade.calib, "gptq_quantize", lambda w, H, *a, **k: gptq(w, torch.eye(H.shape[0]), *a, **k))
    search_only = convert(padded_model_dir, tmp_path / "search-only", preset("w4a16"), calib_text=valid_text,
                          calib_lines=CALIB)
    base, rtn, full, alone = (score(padded_model_dir), score(converted("w4a16")), score(calibrated("w4a16")),
                              score(search_only))
    print(f"\nrecovered of RTN's loss increase: range search alone {(rtn - alone) / (rtn - base):.1%}, "
          f"GPTQ {(rtn - full) / (rtn - base):.1%}")
    assert rtn - alone < 0.6 * (rtn - full)  # measured 33.8% vs 67.8%


def test_gptq_w4a16_g32_and_asymmetric_beat_rtn(padded_model_dir, converted, calibrated, score):
    base = score(padded_model_dir)
    for kw in ({"group_size": 32}, {"symmetric": False}):
        rtn, gptq = score(converted("w4a16", **kw)), score(calibrated("w4a16", **kw))
        recovered = (rtn - gptq) / (rtn - base)
        print(f"\n{kw}: RTN {rtn - base:+.4f}  GPTQ {gptq - base:+.4f}  recovered {recovered:.1%}")
        assert recovered >= 0.40  # measured 73.8% (g32), 49.2% (asymmetric g128)


def test_fp8_static_vs_dynamic(padded_model_dir, converted, calibrated, score):
    base, dyn, static = score(padded_model_dir), score(converted("fp8-dynamic")), score(calibrated("fp8-static"))
    print(f"\nfp8-dynamic {dyn - base:+.4f}  fp8-static (abs-max input scales) {static - base:+.4f}")
    assert static - base <= 0.013  # the foundation's fp8-dynamic bar; measured +0.0096 (dynamic: +0.0100)
    assert abs(static - dyn) <= 0.005


@pytest.fixture(scope="module")
def kv_model(calibrated, valid_text):
    """The fp8-dynamic + FP8 KV checkpoint's reference model, and a scorer that can rescale its k/v scales."""
    ckpt = calibrated("fp8-dynamic", kv_cache="fp8")
    model, _ = load_reference_model(ckpt)
    attn = [m for m in model.modules() if hasattr(m, "cublade_kv_scales")]
    assert len(attn) == 5
    calibrated_scales = [m.cublade_kv_scales for m in attn]
    wins = windows(tokenize(ckpt, valid_text, EVAL), 512)

    def loss(k_mult=1.0, v_mult=1.0) -> float:
        for m, (k, v) in zip(attn, calibrated_scales):
            m.cublade_kv_scales = (k * k_mult, v * v_mult)
        total, n = 0.0, 0
        with torch.inference_mode():
            for w in wins:
                x = torch.tensor([w])
                total += torch.nn.functional.cross_entropy(model(x).logits[0, :-1], x[0, 1:], reduction="sum").item()
                n += len(w) - 1
        return total / n

    return ckpt, loss


def test_fp8_kv_cache_costs_at_most_0_01(converted, calibrated, kv_model, score):
    """The bar, with K rounded query-aware (`--kv-rounding query-aware`); rounded to nearest (vLLM's own cache
    write) K costs nearly four times the bar on this model, whatever the scale (next test, and
    scripts/kv_cache_study.py)."""
    nearest, _ = kv_model
    dyn = score(converted("fp8-dynamic"))
    query_aware = score(calibrated("fp8-dynamic", kv_cache="fp8", kv_rounding="query-aware"))
    print(f"\nfp8-dynamic {dyn:.4f}  + FP8 KV cache, K query-aware {query_aware - dyn:+.4f}, "
          f"K to nearest {score(nearest) - dyn:+.4f}")
    assert query_aware - dyn <= 0.01  # measured +0.0047
    assert score(nearest) - dyn > 0.03  # measured +0.0383: the rounding, not the scales, is the cost


def test_kv_scales_are_the_best_per_tensor_choice(converted, kv_model, score):
    # Why the KV bar is missed: not the calibrated scales. Larger K/V scales only move small values towards
    # E4M3's subnormals (no gain), smaller ones clip the largest keys, which is ruinous: the case for abs-max
    # over a percentile. (Measured separately: the cost is K's; V through FP8 alone moves the loss by -0.0003.)
    ckpt, loss = kv_model
    dyn = score(converted("fp8-dynamic"))
    kv = loss()
    assert kv == pytest.approx(score(ckpt), abs=1e-6)  # the same numbers as `cublade ppl`
    x2, x8, half = loss(2.0, 2.0), loss(8.0, 8.0), loss(0.5, 0.5)
    print(f"\nFP8 KV cost over fp8-dynamic, scales x1 (abs-max) {kv - dyn:+.4f}, x2 {x2 - dyn:+.4f}, "
          f"x8 {x8 - dyn:+.4f}, x0.5 {half - dyn:+.4f}")
    assert min(x2, x8) >= kv - 0.003
    assert half > kv + 0.1
