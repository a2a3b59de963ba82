"""Runs cublade's fusion pass (RMSNorm / SiLU-and-mul + FP8 quantization) on traced graphs on the CPU and prints what
it did, one JSON object (tests/vllm/test_norm_quant_fusion.py reads it). Run with CUBLADE_DISABLE_KERNELS=1: the
cublade op schemas are then defined here (those of plugin/csrc/bindings.cpp) with the references as their CPU kernels,
so the patterns trace and the rewritten graphs run without a GPU. SiLU-and-mul graphs are traced with Inductor's
decompositions, as the post-grad graph holds them; two are also compiled by Inductor itself (its CPU backend), the
pass in the post-grad slot, against the same compile without the pass."""
from __future__ import annotations

import importlib
import json
import logging
import os

import torch
import vllm.ir.ops
from torch._guards import detect_fake_mode
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.virtualized import V
from torch.fx.experimental.proxy_tensor import make_fx
from vllm.config import CompilationConfig, CompilationMode, DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.activation import SiluAndMul

SCHEMAS = {
    "fp8_quant_per_token": "fp8_quant_per_token(Tensor x) -> (Tensor, Tensor)",
    "fp8_quant_per_tensor": "fp8_quant_per_tensor(Tensor x, Tensor? scale=None) -> (Tensor, Tensor)",
    "rms_norm_fp8_quant": "rms_norm_fp8_quant(Tensor x, Tensor weight, float eps, Tensor? scale=None) "
                          "-> (Tensor, Tensor)",
    "fused_add_rms_norm_fp8_quant": "fused_add_rms_norm_fp8_quant(Tensor x, Tensor residual, Tensor weight, "
                                    "float eps, Tensor? scale=None) -> (Tensor, Tensor, Tensor)",
    "silu_mul_fp8_quant": "silu_mul_fp8_quant(Tensor x, Tensor? scale=None) -> (Tensor, Tensor)",
}


def define_ops() -> torch.library.Library:
    lib = torch.library.Library("cublade", "DEF")
    R = importlib.import_module("cublade.ops.rms_norm_fp8_quant")
    T = importlib.import_module("cublade.ops.fp8_quant_per_token")
    P = importlib.import_module("cublade.ops.fp8_quant_per_tensor")
    S = importlib.import_module("cublade.ops.silu_mul_fp8_quant")
    impls = {
        "fp8_quant_per_token": (T.fp8_quant_per_token_ref, T._fp8_quant_per_token_fake),
        "fp8_quant_per_tensor": (P.fp8_quant_per_tensor_ref, P._fp8_quant_per_tensor_fake),
        "rms_norm_fp8_quant": (R.rms_norm_fp8_quant_ref, R._rms_norm_fp8_quant_fake),
        "fused_add_rms_norm_fp8_quant": (R.fused_add_rms_norm_fp8_quant_ref, R._fused_add_rms_norm_fp8_quant_fake),
        "silu_mul_fp8_quant": (S.silu_mul_fp8_quant_ref, S._silu_mul_fp8_quant_fake),
    }
    for name, (ref, fake) in impls.items():
        lib.define(SCHEMAS[name])
        # an op's outputs must not alias its inputs (the static reference returns a view of the scale)
        lib.impl(name, (lambda f: lambda *a: tuple(t.clone() for t in f(*a)))(ref), "CPU")
        torch.library.register_fake(f"cublade::{name}")(fake)
    return lib


def ops_of(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "getitem" not in str(n.target)]


def same_outputs(expected, got) -> bool:
    return all(a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                                  b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
               for a, b in zip(expected, got))


def run_pass(fusion_pass, fn, args, config, decompose=False, expect=None) -> dict:
    """decompose: trace with Inductor's decompositions (F.silu becomes its x / (1 + exp(-x)), as in the post-grad
    graph); the norm cases' vLLM IR ops stay whole either way. expect: what the rewritten graph must compute (default
    fn itself, eagerly)."""
    gm = make_fx(fn, select_decomp_table() if decompose else None, tracing_mode="fake")(*args)
    expected = (expect or fn)(*args)
    before = ops_of(gm)
    with set_current_vllm_config(config), V.set_fake_mode(detect_fake_mode(
            [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"])):
        fusion_pass(gm.graph)
    gm.recompile()
    got = gm(*args)
    return {"before": before, "after": ops_of(gm), "matched": fusion_pass.matched_count,
            "outputs_equal": same_outputs(expected, got)}


def run_inductor(fusion_pass, fn, args, config) -> dict:
    """fn compiled by Inductor (CPU) with the pass in the post-grad slot, the token dim dynamic as vLLM marks it,
    against fn compiled without the pass: the pass's matches, whether the two compiled programs' outputs are the same
    bytes, and whether fn run eagerly gives those bytes too. Caches off, so that both compile and the pass runs."""
    import torch._inductor.config as inductor_config

    def compiled(post_pass):
        torch._dynamo.reset()
        for a in args:
            if a.dim() == 2:  # the activations (not the scale)
                torch._dynamo.mark_dynamic(a, 0)
        options = {"post_grad_custom_post_pass": post_pass} if post_pass else {}
        with inductor_config.patch(force_disable_caches=True), set_current_vllm_config(config):
            return torch.compile(fn, backend="inductor", options=options)(*args)

    fusion_pass.matched_count = 0
    got = compiled(fusion_pass)
    matched = fusion_pass.matched_count
    return {"matched": matched, "outputs_equal": same_outputs(compiled(None), got),
            "eager_equal": same_outputs(fn(*args), got)}


def main() -> None:
    # One CPU thread: the Inductor cases compare Inductor's exp with ATen's bit for bit, and on the 2-core CPU machine
    # the first multi-threaded torch.exp of a process came out wrong in its worker thread in about one process in six
    # (tests/ops/test_silu_mul_fp8_quant.py, one_thread).
    torch.set_num_threads(1)
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

    silu_and_mul = SiluAndMul.forward_native  # what vLLM runs with its custom ops off (its default under Inductor)
    # A fused graph computes the fused op's reference: the activation rounded once, as Inductor's compiled code rounds
    # it (run_inductor checks that against Inductor itself), where fn run eagerly rounds the silu too.
    fused_ref = importlib.import_module("cublade.ops.silu_mul_fp8_quant").silu_mul_fp8_quant_ref

    def mlp_dynamic(h):  # a gated MLP's activation, then a per-token fp8 down_proj's quantization
        return cb.fp8_quant_per_token(silu_and_mul(h))

    def mlp_static(h, scale):
        return cb.fp8_quant_per_tensor(silu_and_mul(h), scale)

    def silu_used_twice(h):  # the activation also leaves the graph: the fusion would lose it
        y = silu_and_mul(h)
        q, s = cb.fp8_quant_per_token(y)
        return q, s, y

    def quant_of_other(h):  # the quantization reads a value made from the activation, not the activation
        return cb.fp8_quant_per_token(silu_and_mul(h) * 2)

    def other_split(h):  # gate and up not the two halves of h (a width the kernel takes): other slice bounds
        return cb.fp8_quant_per_token(torch.nn.functional.silu(h[..., :K]) * h[..., K + 16:])

    def silu_dynamic_per_tensor(h):  # dynamic per-tensor quantization (scale None): not the fused op's rule
        return cb.fp8_quant_per_tensor(silu_and_mul(h), None)

    scale = torch.tensor([0.02])
    silu_cases = {  # name: (fn, args, what the graph computes after the pass: None for fn itself)
        "mlp_dynamic": (mlp_dynamic, (t(3, 2 * K),), fused_ref),
        "mlp_static_fp16": (mlp_static, (t(5, 2 * K, dtype=torch.float16), scale), fused_ref),
        "mlp_dynamic_3d": (mlp_dynamic, (t(2, 3, 2 * K),), fused_ref),
        "silu_odd_width": (mlp_dynamic, (t(3, 2 * 60),), None),
        "silu_fp32": (mlp_dynamic, (t(3, 2 * K, dtype=torch.float32),), None),
        "silu_used_twice": (silu_used_twice, (t(3, 2 * K),), None),
        "quant_of_other": (quant_of_other, (t(3, 2 * K),), None),
        "other_split": (other_split, (t(3, 2 * K + 16),), None),
        "silu_dynamic_per_tensor": (silu_dynamic_per_tensor, (t(3, 2 * K),), None),
    }
    cases = {
        "decoder": (decoder, (t(3, K), t(3, K), t(K), t(K), scale)),
        "plain_dynamic_fp16": (plain_dynamic_fp16, (t(2, K, dtype=torch.float16), t(K, dtype=torch.float16))),
        "residual_static": (residual_static, (t(4, K), t(4, K), t(K), scale)),
        "other_epsilon": (other_epsilon, (t(2, K), t(K))),
        "norm_used_twice": (norm_used_twice, (t(2, K), t(K))),
        "odd_width": (odd_width, (t(2, 60), t(60))),
    }
    result = {name: run_pass(fusion_pass, fn, args, config) for name, (fn, args) in cases.items()}
    result.update({name: run_pass(fusion_pass, fn, args, config, decompose=True, expect=expect)
                   for name, (fn, args, expect) in silu_cases.items()})
    result["inductor_mlp_dynamic"] = run_inductor(fusion_pass, mlp_dynamic, (t(16, 2 * K),), config)
    result["inductor_mlp_static"] = run_inductor(fusion_pass, mlp_static, (t(4, 2 * K, dtype=torch.float16), scale),
                                                 config)

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
