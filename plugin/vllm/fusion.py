"""cublade's compile pass: the FP8 quantization of cublade's fp8 layers, fused into the kernel before it.

vLLM's own quantization fusions (RMSNormQuantFusionPass, ActivationQuantFusionPass) match vLLM's quant ops only, so
a norm or a SiLU-and-mul feeding one of cublade's fp8 layers runs as two kernels: Inductor's, then cublade's
fp8_quant_per_token (or, static, fp8_quant_per_tensor). This pass replaces each such pair in the compiled graph,
before vLLM lowers its IR ops, by one cublade kernel:
  * RMSNorm: rms_norm_fp8_quant / fused_add_rms_norm_fp8_quant (cublade.ops.rms_norm_fp8_quant), with a residual add
    (every norm of a decoder layer but the first) or without one (the first layer's input_layernorm);
  * SiLU-and-mul: silu_mul_fp8_quant (cublade.ops.silu_mul_fp8_quant), a gated MLP's activation in front of its down
    projection, as vLLM compiles it with its custom ops off (its default under Inductor): SiluAndMul.forward_native,
    which the post-grad graph holds as Inductor's silu decomposition (x / (1 + exp(-x)) between two dtype casts)
    times the up half. With `+silu_and_mul` (vLLM's CUDA op) the pair is left alone;
per token or per tensor with a static scale.

It is installed, once per model, when the first fp8 layer is created under vLLM's compile mode (`vllm serve` with
its defaults), as Inductor's `post_grad_custom_post_pass`, which vLLM's pass manager runs after its own fusion
passes (vllm/compilation/backends.py, configure_post_pass). That slot takes one pass: where a user has put another
there, cublade leaves it and logs so. CUBLADE_FUSE_NORM_QUANT=0 turns the pass off (the two kernels again, at every
norm and every SiLU-and-mul)."""
from __future__ import annotations

import logging
import os

import torch
import torch._inductor.pattern_matcher as pm
from torch._inductor.pattern_matcher import PatternMatcherPass
from vllm.compilation.passes.inductor_pass import enable_fake_mode
from vllm.compilation.passes.vllm_inductor_pass import VllmInductorPass, VllmPatternMatcherPass

logger = logging.getLogger("vllm.cublade")

ENV = "CUBLADE_FUSE_NORM_QUANT"
_SLOT = "post_grad_custom_post_pass"
_EPSILONS = (1e-5, 1e-6)  # vLLM's fusion patterns' values; the model's own rms_norm_eps joins them


def wanted() -> bool:
    return os.environ.get(ENV, "1") != "0"


def _kernels_loaded() -> bool:
    from cublade.ops import _dispatch

    return _dispatch.extension_loaded() and {"rms_norm_fp8_quant", "fused_add_rms_norm_fp8_quant",
                                             "silu_mul_fp8_quant", "fp8_quant_per_token",
                                             "fp8_quant_per_tensor"} <= _dispatch._CUDA_OPS


def install() -> bool:
    """Put the pass in the current vLLM config's Inductor config, where it applies: vLLM compiles the model with
    Inductor, cublade's kernels are loaded, the slot is free. Returns whether the pass is (now) there."""
    from vllm.config import CompilationMode, get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None or not wanted() or not _kernels_loaded():
        return False
    cc = config.compilation_config
    if cc.mode != CompilationMode.VLLM_COMPILE or cc.backend not in ("", "inductor"):
        return False
    held = cc.inductor_compile_config.get(_SLOT)
    if isinstance(held, NormQuantFusionPass):
        return True
    if held is not None:
        logger.info("cublade: Inductor's %s already holds %r; cublade's RMSNorm / SiLU-and-mul + FP8 quantization "
                    "fusion is off", _SLOT, held)
        return False
    cc.inductor_compile_config[_SLOT] = NormQuantFusionPass(config)
    logger.info("cublade: RMSNorm + FP8 quantization and SiLU-and-mul + FP8 quantization fused by cublade's compile "
                "pass (%s=0 turns it off)", ENV)
    from cublade.vllm.kernels import add_to_compile_key

    add_to_compile_key("rms_norm_fp8_quant-fusion")
    add_to_compile_key("silu_mul_fp8_quant-fusion")
    return True


def _device() -> str:
    from vllm.platforms import current_platform

    return current_platform.device_type or "cpu"


def _empty(*shape, dt=torch.bfloat16) -> torch.Tensor:
    """A pattern's example input (its values are never read; the traced patterns keep no dtype: see __init__)."""
    return torch.empty(*shape, dtype=dt, device=_device())


def _fits_kernel(match) -> bool:
    """The matched norm's x and weight are what the fused kernel takes (same 16-bit dtype, K % 8 == 0, K <= 16384)."""
    from cublade.ops.rms_norm_fp8_quant import kernel_takes

    for node in match.nodes:
        if node.target in (torch.ops.vllm_ir.rms_norm.default, torch.ops.vllm_ir.fused_add_rms_norm.default):
            x = node.args[0]
            w = node.args[1] if node.target == torch.ops.vllm_ir.rms_norm.default else node.args[2]
            if not (isinstance(x, torch.fx.Node) and isinstance(w, torch.fx.Node)):
                return False
            return kernel_takes(x.meta["val"], w.meta["val"])
    return False


def _register(patterns, epsilon: float, static: bool) -> None:
    """The two patterns (with and without the residual add) for one epsilon and scale kind. The pattern
    matcher traces functions of named tensors, so each scale kind has its own four."""
    import vllm.ir.ops

    cb = torch.ops.cublade

    if static:
        def add_pattern(x, weight, residual, scale):
            y, new_residual = vllm.ir.ops.fused_add_rms_norm(x, residual, weight, epsilon)
            q, s = cb.fp8_quant_per_tensor.default(y, scale)
            return q, s, new_residual

        def add_replacement(x, weight, residual, scale):
            q, s, new_residual = cb.fused_add_rms_norm_fp8_quant.default(x, residual, weight, epsilon, scale)
            return q, s, new_residual

        def pattern(x, weight, scale):
            q, s = cb.fp8_quant_per_tensor.default(vllm.ir.ops.rms_norm(x, weight, epsilon), scale)
            return q, s

        def replacement(x, weight, scale):
            q, s = cb.rms_norm_fp8_quant.default(x, weight, epsilon, scale)
            return q, s

        scale_in = [_empty(1, dt=torch.float32)]
    else:
        def add_pattern(x, weight, residual):
            y, new_residual = vllm.ir.ops.fused_add_rms_norm(x, residual, weight, epsilon)
            q, s = cb.fp8_quant_per_token.default(y)
            return q, s, new_residual

        def add_replacement(x, weight, residual):
            q, s, new_residual = cb.fused_add_rms_norm_fp8_quant.default(x, residual, weight, epsilon, None)
            return q, s, new_residual

        def pattern(x, weight):
            q, s = cb.fp8_quant_per_token.default(vllm.ir.ops.rms_norm(x, weight, epsilon))
            return q, s

        def replacement(x, weight):
            q, s = cb.rms_norm_fp8_quant.default(x, weight, epsilon, None)
            return q, s

        scale_in = []
    # the residual form first: the plain norm's ops are a subset of it
    pm.register_replacement(add_pattern, add_replacement, [_empty(5, 16), _empty(16), _empty(5, 16), *scale_in],
                            pm.fwd_only, patterns, extra_check=_fits_kernel)
    pm.register_replacement(pattern, replacement, [_empty(5, 16), _empty(16), *scale_in],
                            pm.fwd_only, patterns, extra_check=_fits_kernel)


def _silu_mul_fits_kernel(match) -> bool:
    """The matched SiLU-and-mul's x is what the fused kernel takes (16-bit dtype, a static last dim 2K with K % 8 == 0,
    K <= MAX_K). Which slices are gate and up needs no check here: register_replacement matches again with the pattern
    traced at x's own shapes, whose slice bounds are the halves of x's last dim (the probe's other_split case)."""
    from cublade.ops.silu_mul_fp8_quant import kernel_takes

    x = match.kwargs.get("x")
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    return (isinstance(val, torch.Tensor) and val.dim() >= 1 and type(val.shape[-1]) is int
            and kernel_takes(val))


def _register_silu_mul(patterns, static: bool) -> None:
    """The SiLU-and-mul pattern for one scale kind: vLLM's native SiluAndMul traced with Inductor's decompositions
    (pm.fwd_only), as the post-grad graph holds it, feeding cublade's quantization."""
    from vllm.model_executor.layers.activation import SiluAndMul

    cb = torch.ops.cublade
    silu_and_mul = SiluAndMul.forward_native

    if static:
        def pattern(x, scale):
            q, s = cb.fp8_quant_per_tensor.default(silu_and_mul(x), scale)
            return q, s

        def replacement(x, scale):
            q, s = cb.silu_mul_fp8_quant.default(x, scale)
            return q, s

        scale_in = [_empty(1, dt=torch.float32)]
    else:
        def pattern(x):
            q, s = cb.fp8_quant_per_token.default(silu_and_mul(x))
            return q, s

        def replacement(x):
            q, s = cb.silu_mul_fp8_quant.default(x, None)
            return q, s

        scale_in = []
    pm.register_replacement(pattern, replacement, [_empty(5, 32), *scale_in], pm.fwd_only, patterns,
                            extra_check=_silu_mul_fits_kernel)


class NormQuantFusionPass(VllmPatternMatcherPass):
    """RMSNorm (vLLM's IR op) or SiLU-and-mul (vLLM's native form) + cublade's FP8 quantization -> cublade's fused op
    (module docstring)."""

    @enable_fake_mode
    def __init__(self, config) -> None:
        super().__init__(config)
        self.patterns = PatternMatcherPass(pass_name="cublade_fp8_quant_fusion")
        hf = getattr(config.model_config, "hf_text_config", None) if config.model_config else None
        model_eps = getattr(hf, "rms_norm_eps", None)
        self.epsilons = tuple(dict.fromkeys(
            ([float(model_eps)] if isinstance(model_eps, float) else []) + list(_EPSILONS)))
        for epsilon in self.epsilons:  # the traced patterns hold no dtype: one set serves bf16 and fp16 models
            for static in (False, True):
                _register(self.patterns, epsilon, static)
        for static in (False, True):  # (the matcher ignores the casts' dtypes too)
            _register_silu_mul(self.patterns, static)

    @VllmInductorPass.time_and_log
    def __call__(self, graph: torch.fx.Graph) -> None:
        self.matched_count = self.patterns.apply(graph)
        logger.debug("cublade: fused %d RMSNorm / SiLU-and-mul + FP8 quantization pairs", self.matched_count)

    def __deepcopy__(self, memo):
        # vLLM's backend deep-copies Inductor's config (this pass in it), then runs the config's own object; the
        # patterns hold traced graphs, which need no copy
        return self

    def uuid(self) -> str:
        return self.hash_source(self, _register, _fits_kernel, _register_silu_mul, _silu_mul_fits_kernel,
                                repr(self.epsilons))
