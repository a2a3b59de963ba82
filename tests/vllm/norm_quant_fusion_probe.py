"""Runs cublade's RMSNorm + FP8 quantization fusion pass on traced graphs on the CPU and prints what it did, one
JSON object (tests/vllm/test_norm_quant_fusion.py reads it). Run with CUBLADE_DISABLE_KERNELS=1: the cublade op
schemas are then defined here (those of plugin/csrc/bindings.cpp) with the references as their CPU kernels, so the
patterns trace and the rewritten graphs run without a GPU."""
from __future__ import annotations

import importlib
import json
import logging
import os

import torch
import vllm.ir.ops
from torch._guards import detect_fake_mode
from torch._inductor.virtualized import V
from torch.fx.experimental.proxy_tensor import make_fx
from vllm.config import CompilationConfig, CompilationMode, DeviceConfig, VllmConfig, set_current_vllm_config

SCHEMAS = {
    "fp8_quant_per_token": "fp8_quant_per_token(Tensor x) -> (Tensor, Tensor)",
    "fp8_quant_per_tensor": "fp8_quant_per_tensor(Tensor x, Tensor? scale=None) -> (Tensor, Tensor)",
    "rms_norm_fp8_quant": "rms_norm_fp8_quant(Tensor x, Tensor weight, float eps, Tensor? scale=None) "
                          "-> (Tensor, Tensor)",
    "fused_add_rms_norm_fp8_quant": "fused_add_rms_norm_fp8_quant(Tensor x, Tensor residual, Tensor weight, "
                                    "float eps, Tensor? scale=None) -> (Tensor, Tensor, Tensor)",
}


def define_ops() -> torch.library.Library:
    lib = torch.library.Library("cublade", "DEF")
    R = importlib.import_module("cublade.ops.rms_norm_fp8_quant")
    T = importlib.import_module("cublade.ops.fp8_quant_per_token")
    P = importlib.import_module("cublade.ops.fp8_quant_per_tensor")
    impls = {
        "fp8_quant_per_token": (T.fp8_quant_per_token_ref, T._fp8_quant_per_token_fake),
        "fp8_quant_per_tensor": (P.fp8_quant_per_tensor_ref, P._fp8_quant_per_tensor_fake),
        "rms_norm_fp8_quant": (R.rms_norm_fp8_quant_ref, R._rms_norm_fp8_quant_fake),
        "fused_add_rms_norm_fp8_quant": (R.fused_add_rms_norm_fp8_quant_ref, R._fused_add_rms_norm_fp8_quant_fake),
    }
    for name, (ref, fake) in impls.items():
        lib.define(SCHEMAS[name])
        # an op's outputs must not alias its inputs (the static reference returns a view of the scale)
        lib.impl(name, (lambda f: lambda *a: tuple(t.clone() for t in f(*a)))(ref), "CPU")
        torch.library.register_fake(f"cublade::{name}")(fake)
    return lib


def ops_of(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "getitem" not in str(n.target)]


def run_pass(fusion_pass, fn, args, config) -> dict:
    gm = make_fx(fn, tracing_mode="fake")(*args)
    expected = fn(*args)
    before = ops_of(gm)
    with set_current_vllm_config(config), V.set_fake_mode(detect_fake_mode(
            [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"])):
        fusion_pass(gm.graph)
    gm.recompile()
    got = gm(*args)
    same = all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
               for a, b in zip(expected, got))
    return {"before": before, "after": ops_of(gm), "matched": fusion_pass.matched_count, "outputs_equal": same}


def main() -> None:
    lib = define_ops()  # noqa: F841  (kept alive)
    from cublade.vllm import fusion

    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(config):
        fusion_pass = fusion.NormQuantFusionPass(config)
    cb = torch.ops.cublade
    g = torch.Generator().manual_seed(0)
    K = 64

    def t(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    def decoder(x, res, w, w2, scale):  # a layer's two norms: residual + dynamic, then plain + static
        y, r = vllm.ir.ops.fused_add_rms_norm(x, res, w, 1e-5)
        q, s = cb.fp8_quant_per_token(y)
        q2, s2 = cb.fp8_quant_per_tensor(vllm.ir.ops.rms_norm(r, w2, 1e-6), scale)
        return q, s, r, q2, s2

    def plain_dynamic_fp16(x, w):
        return cb.fp8_quant_per_token(vllm.ir.ops.rms_norm(x, w, 1e-5))

    def residual_static(x, res, w, scale):
        y, r = vllm.ir.ops.fused_add_rms_norm(x, res, w, 1e-6)
        q, s = cb.fp8_quant_per_tensor(y, scale)
        return q, s, r

    def other_epsilon(x, w):  # an epsilon with no pattern: left alone
        return cb.fp8_quant_per_token(vllm.ir.ops.rms_norm(x, w, 1e-3))

    def norm_used_twice(x, w):  # the norm's output also leaves the graph: the fusion would lose it
        y = vllm.ir.ops.rms_norm(x, w, 1e-5)
        q, s = cb.fp8_quant_per_token(y)
        return q, s, y

    def odd_width(x, w):  # K % 8 != 0: not the fused kernel's
        return cb.fp8_quant_per_token(vllm.ir.ops.rms_norm(x, w, 1e-5))

    scale = torch.tensor([0.02])
    cases = {
        "decoder": (decoder, (t(3, K), t(3, K), t(K), t(K), scale)),
        "plain_dynamic_fp16": (plain_dynamic_fp16, (t(2, K, dtype=torch.float16), t(K, dtype=torch.float16))),
        "residual_static": (residual_static, (t(4, K), t(4, K), t(K), scale)),
        "other_epsilon": (other_epsilon, (t(2, K), t(K))),
        "norm_used_twice": (norm_used_twice, (t(2, K), t(K))),
        "odd_width": (odd_width, (t(2, 60), t(60))),
    }
    result = {name: run_pass(fusion_pass, fn, args, config) for name, (fn, args) in cases.items()}

    # install(): where the pass goes, and where it does not
    fusion._kernels_loaded = lambda: True  # the probe's ops stand in for the extension's
    messages: list[str] = []
    log = logging.getLogger("vllm.cublade")
    log.setLevel(logging.INFO)
    log.addHandler(type("H", (logging.Handler,), {"emit": lambda self, r: messages.append(r.getMessage())})())

    def installed(cc: CompilationConfig) -> tuple[bool, object]:
        cfg = VllmConfig(device_config=DeviceConfig(device="cpu"), compilation_config=cc)
        with set_current_vllm_config(cfg):
            ok = fusion.install()
            again = fusion.install()
        held = cfg.compilation_config.inductor_compile_config.get("post_grad_custom_post_pass")
        return ok and again, type(held).__name__, cfg.additional_config

    def switched_off():
        os.environ[fusion.ENV] = "0"
        try:
            return installed(CompilationConfig(mode=CompilationMode.VLLM_COMPILE))
        finally:
            del os.environ[fusion.ENV]

    from vllm.compilation.passes.inductor_pass import InductorPass

    class OtherPass(InductorPass):
        def __call__(self, graph):
            pass

        def uuid(self):
            return "another pass"

    result["install"] = {
        "compile": installed(CompilationConfig(mode=CompilationMode.VLLM_COMPILE)),
        "eager": installed(CompilationConfig(mode=CompilationMode.NONE)),
        "slot_taken": installed(CompilationConfig(mode=CompilationMode.VLLM_COMPILE, inductor_compile_config={
            "post_grad_custom_post_pass": OtherPass()})),
        "no_config": fusion.install(),
        "switched_off": switched_off(),
        "messages": messages,
    }
    import copy
    result["deepcopy_is_self"] = copy.deepcopy(fusion_pass) is fusion_pass
    result["uuid"] = fusion_pass.uuid()
    print("PROBE " + json.dumps(result, default=str))


if __name__ == "__main__":
    main()
