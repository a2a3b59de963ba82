"""The MoE fixture on a GPU (H200 device machine; skipped elsewhere): every FP4 MoE kernel that can run there
against the reference experts, `vllm serve` of the converted fixture, and `cublade ppl --backend vllm` within
0.5% of the reference backend.

Run after `source .device-stage/env.sh` and installing cublade beside vLLM (see tests/gpu/test_serve.py):
    CUBLADE_GPU_RESULTS=$OUT/moe.jsonl python3 -m pytest -s tests/moe/test_moe_gpu.py
Three vLLM engine starts (serve, two ppl runs) + the CPU reference: about 3-4 minutes. Results (kernel errors,
greedy text, losses) print as `RESULT {...}` lines and go to $CUBLADE_GPU_RESULTS when set.
"""
from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 device)")

REPO = Path(__file__).resolve().parents[2]
PPL_REL = 0.005  # vllm vs reference perplexity of the same checkpoint
FORMATS = ["mxfp4", "nvfp4"]


def _serve_helpers():
    """vllm_server / greedy / ppl_vllm / record / tail from tests/gpu/test_serve.py (one implementation)."""
    spec = importlib.util.spec_from_file_location("cublade_gpu_serve", REPO / "tests" / "gpu" / "test_serve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def serve():
    return _serve_helpers()


@pytest.fixture(scope="module")
def vllm_cuda():
    pytest.importorskip("vllm.model_executor",
                        reason="vLLM is not importable here: source .device-stage/env.sh first")
    from test_moe_vllm import init_vllm_cuda

    return init_vllm_cuda()


@pytest.fixture(scope="module")
def moe_ckpt(converted, moe_fixture):
    """format -> the perturbed MoE fixture converted with fp4-experts-fp8-dense."""
    return lambda fmt: converted("fp4-experts-fp8-dense", src=moe_fixture("perturbed", "mixtral"), format=fmt)


def _candidates():
    from cublade.config.schemes import FP4Scheme
    from cublade.vllm.kernels import CANDIDATES

    return [k.name for k in CANDIDATES[FP4Scheme]]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_runnable_moe_kernel_matches_reference(vllm_cuda, moe_ckpt, fmt, monkeypatch, serve):
    """Layer 0 of the converted fixture in a vLLM FusedMoE on the GPU (bf16), once per kernel that can run it
    (the others disabled): apply() vs the fp32 reference experts on CPU. Bound: bf16 activations through two
    GEMMs (the CPU bf16 reference path measured 5.7e-3 mxfp4 / 5.4e-3 nvfp4 on the same data)."""
    from vllm.config import set_current_vllm_config

    from test_moe_vllm import _reference, checkpoint_block, make_layer, router, softmax_topk
    from cublade.config.schemes import FP4Scheme
    from cublade.vllm.kernels import MoEKernel

    ckpt = moe_ckpt(fmt)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(301, 128, generator=g)
    logits = x @ router(ckpt).t()
    want = _reference(ckpt, fmt, x, logits)
    w, ids = softmax_topk(x, logits, 2, True)
    monkeypatch.setenv("CUBLADE_ALLOW_REFERENCE", "1")  # the reference too, which a GPU runs only when asked for
    ran = []
    for name in _candidates():
        monkeypatch.setenv("CUBLADE_DISABLED_KERNELS", ",".join(n for n in _candidates() if n != name))
        with torch.device("cuda"):
            layer = make_layer(vllm_cuda, FP4Scheme(format=fmt), dtype=torch.bfloat16)
        re_ = layer.routed_experts
        list(layer.load_weights(list(checkpoint_block(ckpt).items())))
        try:
            with set_current_vllm_config(vllm_cuda):
                re_.quant_method.process_weights_after_loading(re_)
        except NotImplementedError as e:
            serve.record(test="moe-kernel", format=fmt, kernel=name, ran=False, reason=str(e))
            continue
        assert isinstance(re_.quant_method.kernel, MoEKernel) and re_.quant_method.kernel.name == name
        y = re_.quant_method.apply(re_, x.cuda().bfloat16(), w.cuda(), ids.cuda(), None, None)
        rel = ((y.float().cpu() - want).abs().mean() / want.abs().mean()).item()
        serve.record(test="moe-kernel", format=fmt, kernel=name, ran=True, rel_err=rel)
        assert rel < 1.5e-2, (name, rel)
        ran.append(name)
    assert any(n != "reference" for n in ran), f"only the reference kernel could run {fmt} experts on this GPU"


def test_vllm_serve_moe_fixture(serve, moe_ckpt, tmp_path):
    """vllm serve on the converted MoE (quant_method from config.json) answers, with the experts on a GPU
    kernel (not the reference) and dense layers on FP8; compiled (CUDA graphs) as well."""
    ckpt = moe_ckpt("mxfp4")
    log = tmp_path / "serve-moe.log"
    with serve.vllm_server(ckpt, log) as url:  # compiled + CUDA graphs: the experts' kernel must be capturable
        out = serve.greedy(url)
    text = log.read_text(errors="replace")
    serve.record(test="moe-serve", model="moe-perturbed-fp4-experts-fp8-dense", **out)
    assert out["text"].strip() and len(out["tokens"]) == serve.GREEDY_TOKENS
    m = re.search(r"cublade: MoE experts (\S+\(.*?\)) like .*? run on ([\w-]+)", text)
    assert m, serve.tail(log)
    assert m.group(2) != "reference", m.group(0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_ppl_vllm_within_half_percent_of_reference(serve, moe_ckpt, moe_fixture, valid_text, tmp_path, fmt):
    from cublade.ppl import evaluate

    ckpt = moe_ckpt(fmt)
    v = serve.ppl_vllm(ckpt, valid_text, tmp_path, f"moe-{fmt}")
    r = evaluate(ckpt, valid_text, backend="reference").loss
    base = evaluate(moe_fixture("perturbed", "mixtral"), valid_text, backend="reference").loss
    ratio = math.exp(v) / math.exp(r)
    serve.record(test="moe-ppl", model=f"moe-perturbed-fp4-experts-fp8-dense-{fmt}", vllm_loss=v,
                 reference_loss=r, unquantized_reference_loss=base, ppl_ratio=ratio)
    assert abs(ratio - 1) <= PPL_REL, f"{fmt}: vllm ppl {math.exp(v):.4f} vs reference {math.exp(r):.4f}"
