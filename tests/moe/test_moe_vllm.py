"""CubladeFp4MoEMethod inside real vLLM 0.26 FusedMoE layers on CPU: create_weights, loading a converted
checkpoint's per-expert FP4 tensors through vLLM's FusedMoE loader, process_weights_after_loading (kernel
choice: the reference on CPU), and apply() through vLLM's MoE runner vs the reference experts.

The checkpoint is the perturbed MoE fixture (experts differ, k-means router) converted with
fp4-experts-fp8-dense: any mix-up of experts, of w1/w3, or of scales between experts changes the output."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

pytest.importorskip("vllm.model_executor")

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers.fused_moe import FusedMoE  # noqa: E402
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig  # noqa: E402

from cublade.config.experts import ExpertLayout  # noqa: E402
from cublade.config.schemes import Fp8Scheme, FP4Scheme, UnsupportedShape  # noqa: E402
from cublade.reference_experts import QuantExpertsRef  # noqa: E402
from cublade.vllm.kernels import ReferenceMoE  # noqa: E402
from cublade.vllm.moe import CubladeFp4MoEMethod  # noqa: E402

PREFIX = "model.layers.{l}.block_sparse_moe.experts"
MIXTRAL = {"model_type": "mixtral", "num_local_experts": 8, "hidden_size": 128, "intermediate_size": 256,
           "num_experts_per_tok": 2}
_ids = iter(range(10**6))


class _OneSchemeConfig(QuantizationConfig):
    """A minimal QuantizationConfig that hands every FusedMoE layer CubladeFp4MoEMethod(scheme) (cublade's
    real config, plugin/vllm/config.py, is tested in tests/vllm)."""

    def __init__(self, scheme):
        super().__init__()
        self.scheme = scheme

    def get_name(self):
        return "cublade"

    def get_supported_act_dtypes(self):
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls):
        return 0

    @staticmethod
    def get_config_filenames():
        return []

    @classmethod
    def from_config(cls, config):
        raise NotImplementedError

    def get_quant_method(self, layer, prefix):
        return CubladeFp4MoEMethod(self.scheme, layer.moe_config, prefix)


def init_vllm_cuda():
    """A VllmConfig on the CUDA device with vLLM's single-rank process groups set up (tests/moe/test_moe_gpu.py
    and benchmarks/bench_fp4_moe.py build FusedMoE layers under it)."""
    import socket

    from vllm.config import DeviceConfig, VllmConfig
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    cfg = VllmConfig(device_config=DeviceConfig(device="cuda"))
    with set_current_vllm_config(cfg):
        if not model_parallel_is_initialized():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "nccl")
        ensure_model_parallel_initialized(1, 1)
    return cfg


def softmax_topk(hidden_states, gating_output, topk, renormalize):
    """Mixtral's routing in plain PyTorch (vLLM's default router calls a CUDA op)."""
    w, ids = torch.topk(torch.softmax(gating_output.float(), dim=-1), topk, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids.to(torch.int32)


def make_layer(cfg, scheme, dtype=torch.bfloat16, hidden=128, inter=256, layer=0):
    with set_current_vllm_config(cfg):
        # A fresh layer name each time: vLLM registers every layer by name in the config.
        prefix = PREFIX.format(l=layer)
        cfg.compilation_config.static_forward_context.pop(prefix, None)
        return FusedMoE(num_experts=8, top_k=2, hidden_size=hidden, intermediate_size=inter, params_dtype=dtype,
                        renormalize=True, quant_config=_OneSchemeConfig(scheme), prefix=prefix,
                        custom_routing_function=softmax_topk, ckpt_names=("w1", "w2", "w3"))


def checkpoint_block(ckpt, l=0) -> dict[str, torch.Tensor]:
    pre = PREFIX.format(l=l) + "."
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        return {k[len(pre):]: f.get_tensor(k) for k in f.keys() if k.startswith(pre)}


def router(ckpt, l=0) -> torch.Tensor:
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        return f.get_tensor(f"model.layers.{l}.block_sparse_moe.gate.weight")


def load(layer, block: dict[str, torch.Tensor]) -> list[str]:
    loaded = list(layer.load_weights(list(block.items())))
    layer.routed_experts.quant_method.process_weights_after_loading(layer.routed_experts)
    return loaded


def forward(cfg, layer, x, logits):
    with set_current_vllm_config(cfg), set_forward_context(None, cfg):
        return layer(x, logits)


@pytest.fixture(scope="module", params=["mxfp4", "nvfp4"])
def fmt(request):
    return request.param


@pytest.fixture(scope="module")
def ckpt(converted, moe_fixture, fmt):
    return converted("fp4-experts-fp8-dense", src=moe_fixture("perturbed", "mixtral"), format=fmt)


def test_create_weights(vllm_cpu, fmt):
    scheme = FP4Scheme(format=fmt)
    re = make_layer(vllm_cpu, scheme).routed_experts
    B = scheme.block
    scale_dtype = torch.uint8 if fmt == "mxfp4" else torch.float8_e4m3fn
    want = {"w13_weight_packed": ((8, 512, 64), torch.uint8), "w2_weight_packed": ((8, 128, 128), torch.uint8),
            "w13_weight_scale": ((8, 512, 128 // B), scale_dtype), "w2_weight_scale": ((8, 128, 256 // B), scale_dtype)}
    if fmt == "nvfp4":
        want |= {"w13_weight_global_scale": ((8, 2), torch.float32), "w2_weight_global_scale": ((8,), torch.float32)}
    got = {n: (tuple(p.shape), p.dtype) for n, p in re.named_parameters()}
    assert got == want
    assert isinstance(re.quant_method, CubladeFp4MoEMethod)


def test_load_places_every_expert_tensor(vllm_cpu, ckpt, fmt):
    """w13[e] = [w1; w3] of expert e, w2[e] = w2 of expert e, scales likewise, nothing left out."""
    layer = make_layer(vllm_cpu, FP4Scheme(format=fmt))
    block = checkpoint_block(ckpt)
    loaded = load(layer, block)
    assert len(loaded) == len(block) == 8 * 3 * (3 if fmt == "nvfp4" else 2)
    re = layer.routed_experts
    assert isinstance(re.quant_method.kernel, ReferenceMoE)
    for e in range(8):
        for suffix in ("weight_packed", "weight_scale"):
            w13 = torch.cat([block[f"{e}.w1.{suffix}"], block[f"{e}.w3.{suffix}"]])
            assert torch.equal(getattr(re, f"w13_{suffix}")[e].view(torch.uint8), w13.view(torch.uint8))
            assert torch.equal(getattr(re, f"w2_{suffix}")[e].view(torch.uint8),
                               block[f"{e}.w2.{suffix}"].view(torch.uint8))
        if fmt == "nvfp4":
            assert re.w13_weight_global_scale[e].tolist() == [block[f"{e}.w1.weight_global_scale"].item(),
                                                              block[f"{e}.w3.weight_global_scale"].item()]
            assert re.w2_weight_global_scale[e].item() == block[f"{e}.w2.weight_global_scale"].item()


def _reference(ckpt, fmt, x, logits):
    """The reference backend's experts (cublade.reference_experts.QuantExpertsRef) on the same checkpoint tensors."""
    layout = ExpertLayout.from_config(MIXTRAL)
    scheme = FP4Scheme(format=fmt)
    t: dict = {}
    for name, v in checkpoint_block(ckpt).items():
        e, proj, suffix = name.split(".")
        t.setdefault((int(e), {"w1": "gate", "w3": "up", "w2": "down"}[proj]), {})[suffix] = v
    ref = QuantExpertsRef(PREFIX.format(l=0), layout, {k: scheme for k in t}, t)
    w, ids = softmax_topk(x, logits, 2, True)
    return ref(x, ids, w)


def test_apply_equals_reference_experts(vllm_cpu, ckpt, fmt):
    """fp32 layer: vLLM's runner + router + this method == the reference experts, bit for bit (same op;
    equal only if every tensor landed where the reference reads it). bf16 layer: within bf16 rounding."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 128, generator=g)  # 37 tokens: not a multiple of anything
    logits = x @ router(ckpt).t()
    want = _reference(ckpt, fmt, x, logits)

    layer = make_layer(vllm_cpu, FP4Scheme(format=fmt), dtype=torch.float32)
    load(layer, checkpoint_block(ckpt))
    got = forward(vllm_cpu, layer, x, logits)
    torch.testing.assert_close(got, want, rtol=0, atol=0)

    layer16 = make_layer(vllm_cpu, FP4Scheme(format=fmt), dtype=torch.bfloat16)
    load(layer16, checkpoint_block(ckpt))
    got16 = forward(vllm_cpu, layer16, x.bfloat16(), logits.bfloat16()).float()
    rel = (got16 - want).abs().mean() / want.abs().mean()
    print(f"\n{fmt}: bf16 layer vs fp32 reference: mean|d|/mean|ref| = {rel:.2e}")
    assert rel < 2e-2  # bf16 activations (8 mantissa bits) through two GEMMs and SiLU

    # A mix-up would show: the same tokens through a layer whose experts 2 and 5 are swapped.
    block = checkpoint_block(ckpt)
    swap = {"2": "5", "5": "2"}
    swapped = {".".join([swap.get(k.split(".")[0], k.split(".")[0]), *k.split(".")[1:]]): v
               for k, v in block.items()}
    assert set(swapped) == set(block) and not torch.equal(swapped["2.w1.weight_packed"], block["2.w1.weight_packed"])
    layer_sw = make_layer(vllm_cpu, FP4Scheme(format=fmt), dtype=torch.float32)
    load(layer_sw, swapped)
    assert (forward(vllm_cpu, layer_sw, x, logits) - want).abs().max() > 1e-3


def test_load_errors_name_the_tensor(vllm_cpu, ckpt, fmt):
    block = checkpoint_block(ckpt)
    scheme = FP4Scheme(format=fmt)
    where = PREFIX.format(l=0)
    bad = dict(block)
    bad["3.w3.weight_scale"] = block["3.w3.weight_scale"][:, :2].contiguous()
    with pytest.raises(ValueError, match=rf"{where}\.3\.w3\.weight_scale: shape \[256, 2\], expected \[256, "
                                         rf"{128 // scheme.block}\]"):
        load(make_layer(vllm_cpu, scheme), bad)
    bad = dict(block)
    bad["6.w2.weight_packed"] = block["6.w2.weight_packed"][:, :64].contiguous()
    with pytest.raises(ValueError, match=rf"{where}\.6\.w2\.weight_packed: shape \[128, 64\], expected \[128, 128\]"):
        load(make_layer(vllm_cpu, scheme), bad)
    bad = {k: v for k, v in block.items() if k != "5.w3.weight_scale"}
    with pytest.raises(ValueError, match=rf"{where}\.5\.w3\.weight_scale: missing from the checkpoint"):
        load(make_layer(vllm_cpu, scheme), bad)
    bad = dict(block)
    bad["0.w1.weight_scale"] = block["0.w1.weight_scale"].float()
    with pytest.raises(ValueError, match=rf"{where}\.0\.w1\.weight_scale: dtype torch.float32, expected"):
        load(make_layer(vllm_cpu, scheme), bad)


def test_bad_scale_values_refused_after_load(vllm_cpu, ckpt, fmt):
    """An E8M0 NaN code (mxfp4) or a zero global scale (nvfp4) is refused, naming the parameter and expert."""
    block = dict(checkpoint_block(ckpt))
    if fmt == "mxfp4":
        s = block["4.w2.weight_scale"].clone()
        s[7, 1] = 255
        block["4.w2.weight_scale"] = s
        match = r"w2_weight_scale: expert 4 has an E8M0 NaN scale"
    else:
        block["4.w3.weight_global_scale"] = torch.zeros_like(block["4.w3.weight_global_scale"])
        match = r"w13_weight_global_scale: every nvfp4 global scale must be finite and > 0"
    with pytest.raises(ValueError, match=match):
        load(make_layer(vllm_cpu, FP4Scheme(format=fmt)), block)


def test_refusals(vllm_cpu, monkeypatch):
    with pytest.raises(NotImplementedError, match=r"experts: cublade serves MoE experts in fp4.*not fp8"):
        make_layer(vllm_cpu, Fp8Scheme())
    with pytest.raises(UnsupportedShape, match=r"^model\.layers\.0\.block_sparse_moe\.experts: intermediate_size "
                                               r"I=200 breaks a rule of scheme fp4\(format=mxfp4, scale_rule=rceil\): "
                                               r"it must be a multiple of the mxfp4 block size 32"):
        make_layer(vllm_cpu, FP4Scheme(), inter=200)
    monkeypatch.setenv("CUBLADE_DISABLED_KERNELS", "reference")
    layer = make_layer(vllm_cpu, FP4Scheme())
    with pytest.raises(NotImplementedError, match=r"no kernel can run MoE experts fp4.*vllm-marlin-moe: needs a "
                                                  r"CUDA device; reference: disabled"):
        layer.routed_experts.quant_method.process_weights_after_loading(layer.routed_experts)


def test_cublade_kernel_passed_over_on_other_gpus(monkeypatch):
    """cublade's extension is built for sm_90a only: on another GPU the selector must pass over cublade-fp4-moe,
    saying why, rather than pick it and fail at the first call (as the linear kernels do)."""
    import types

    from cublade.vllm.kernels import CubladeFp4MoE, base

    monkeypatch.setattr(base, "_capability", lambda device: 80)
    w = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda"))
    ok, why = CubladeFp4MoE.can_implement(types.SimpleNamespace(w13_weight_packed=w), FP4Scheme())
    assert not ok and why == "cublade's kernels are built for sm_90a, this GPU is sm_80"


@pytest.mark.parametrize("fmt_,H,I,tp,refused", [
    ("mxfp4", 128, 48, 2, "intermediate_size I=48 per rank (intermediate_size 96 at tensor-parallel size 2)"),
    ("mxfp4", 128, 16, 4, "intermediate_size I=16 per rank (intermediate_size 64 at tensor-parallel size 4)"),
    ("mxfp4", 80, 64, 1, "hidden_size H=80"),
    ("nvfp4", 128, 48, 2, None), ("nvfp4", 128, 16, 4, None),
    ("nvfp4", 128, 24, 2, "intermediate_size I=24 per rank (intermediate_size 48 at tensor-parallel size 2)"),
    ("mxfp4", 128, 32, 8, None),
])
def test_expert_sharding_rules(fmt_, H, I, tp, refused):
    """The rules on one rank's sizes, called directly: I per rank (and H) a multiple of the FP4 block (32 mxfp4,
    16 nvfp4). nvfp4 at I = 16 or 48 per rank passes these rules; the kernels' own needs (cublade's K % 32, Marlin's
    intermediate % 64) are the selection's (test_kernel_per_gpu)."""
    from cublade.vllm.moe import check_expert_partition

    scheme = FP4Scheme(format=fmt_)
    if refused is None:
        check_expert_partition(scheme, "experts", H, I, tp)
        return
    block = scheme.block
    with pytest.raises(UnsupportedShape) as e:
        check_expert_partition(scheme, "experts", H, I, tp)
    assert str(e.value) == (f"experts: {refused} breaks a rule of scheme {scheme.describe()}: it must be a multiple "
                            f"of the {fmt_} block size {block} (a block and its scale live on one rank; FP4 packs 2 "
                            f"values per byte along K)")


@pytest.mark.parametrize("cap,want", [(80, "vllm-marlin-moe"), (86, "vllm-marlin-moe"), (89, "vllm-marlin-moe"),
                                      (90, "cublade-fp4-moe")])
def test_kernel_per_gpu(vllm_cpu, monkeypatch, fmt, cap, want):
    """FP4 experts on each GPU family (capability mocked, tests/gpu_mock.py): cublade's grouped FP4 GEMM on sm_90,
    vLLM's fused Marlin MoE on sm_80-89; an intermediate size per rank Marlin's tiles do not take (96: not a
    multiple of 64) stops the load there with every candidate's reason, as the fp32 reference runs on a GPU only
    when asked for (CUBLADE_ALLOW_REFERENCE=1)."""
    from gpu_mock import mocked_gpu

    from cublade.vllm.kernels import CANDIDATES, first_runnable, select_moe_kernel

    scheme = FP4Scheme(format=fmt)
    bf16 = make_layer(vllm_cpu, scheme).routed_experts
    odd = make_layer(vllm_cpu, scheme, inter=96).routed_experts
    with mocked_gpu(monkeypatch, cap):
        k, reason, _ = first_runnable(CANDIDATES[FP4Scheme], lambda k: k.can_implement(bf16, scheme))
        assert k.name == want, reason
        k, _, skipped = first_runnable(CANDIDATES[FP4Scheme], lambda k: k.can_implement(odd, scheme))
        if cap == 90:
            assert k.name == "cublade-fp4-moe"
        else:
            assert k is None
            assert skipped[1] == ("vllm-marlin-moe: Marlin MoE tiles need hidden_size % 128 == 0 and intermediate % "
                                  "64 == 0 (H=128, I=96)")
            with pytest.raises(NotImplementedError, match=r"^experts: no kernel can run MoE experts fp4.*\[E=8, "
                                                          r"H=128, I=96, torch.bfloat16\]: cublade-fp4-moe: cublade's "
                                                          r"kernels are built for sm_90a, this GPU is sm_\d\d; "
                                                          r"vllm-marlin-moe: .*; reference: fp32 reference math, on a "
                                                          r"GPU only when asked for"):
                select_moe_kernel(odd, scheme, "experts")


def test_cublade_kernel_grouping_on_cpu(vllm_cpu, ckpt, fmt):
    """The cublade-fp4-moe kernel's host logic (repack once, sort tokens by expert on the device, offsets,
    one grouped GEMM per projection, unsort + weighted sum; ids of other ranks' experts masked), run here with
    cublade.ops.fp4_gemm's CPU reference in place of the CUDA op, against the reference kernel on the same
    layer weights (both bf16 math: one fp32 summation order apart)."""
    from cublade.vllm.kernels import CubladeFp4MoE

    g = torch.Generator().manual_seed(3)
    x = torch.randn(29, 128, generator=g).bfloat16()
    w, ids = softmax_topk(x, x.float() @ router(ckpt).t(), 2, True)
    ids[::5, 1] = -1  # as expert_map marks experts held by another rank
    ref_layer = make_layer(vllm_cpu, FP4Scheme(format=fmt))
    load(ref_layer, checkpoint_block(ckpt))
    re_ref = ref_layer.routed_experts
    want = re_ref.quant_method.kernel.apply(re_ref, x, w, ids)

    layer = make_layer(vllm_cpu, FP4Scheme(format=fmt))
    load(layer, checkpoint_block(ckpt))
    re_ = layer.routed_experts
    kernel = CubladeFp4MoE(re_, FP4Scheme(format=fmt))
    assert not hasattr(re_, "w13_weight_packed") and re_.w13_fp4_packed.dtype == torch.int32  # repacked once
    got = kernel.apply(re_, x, w, ids)
    rel = ((got.float() - want.float()).abs().mean() / want.float().abs().mean()).item()
    assert rel < 2e-3, rel
    assert (got.float() - want.float()).abs().max() < 0.05 * want.float().abs().max()


@pytest.mark.parametrize("mode", ["tp2", "tp4", "ep2", "ep4"])
def test_tensor_and_expert_parallel(converted, moe_fixture, tmp_path, mode):
    """TP = 2 and 4 in as many gloo processes: each rank holds 1/tp of every expert's intermediate rows (w1/w3 rows,
    w2 packed columns and their scales, cut by vLLM's loader; nvfp4 global scales whole); the all-reduced output
    equals the TP=1 reference experts up to fp32 summation order (w2's K is summed in tp slices). EP = 2 and 4
    (--enable-expert-parallel): each rank holds 8 / ep whole experts (vLLM's expert map marks the others), the same
    reference."""
    n = int(mode[2:])
    import os
    import subprocess
    import sys
    from pathlib import Path

    from vllm_model import dist_init_method

    here = Path(__file__).resolve().parent
    ckpts = {f: converted("fp4-experts-fp8-dense", src=moe_fixture("perturbed", "mixtral"), format=f)
             for f in ("mxfp4", "nvfp4")}
    jobs = [a for f, c in ckpts.items() for a in (str(c), f, str(tmp_path / f"{f}.pt"))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")])}
    worker = [sys.executable, str(here / "moe_tp_worker.py")]
    procs = [subprocess.Popen([*worker, str(r), mode, dist_init_method(tmp_path), *jobs],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(n)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 128, generator=g)
    for f, c in ckpts.items():
        want = _reference(c, f, x, x @ router(c).t())
        torch.testing.assert_close(torch.load(tmp_path / f"{f}.pt"), want, rtol=1e-5, atol=1e-6)
    for r in range(n if mode.startswith("tp") else 0):  # vLLM's per-rank intermediate size reaches the rule
        assert (tmp_path / f"refusal-rank{r}.txt").read_text() == (
            f"model.layers.0.block_sparse_moe.experts: intermediate_size I={96 // n} per rank (intermediate_size 96 "
            f"at tensor-parallel size {n}) breaks a rule of scheme fp4(format=mxfp4, scale_rule=rceil): it must be a "
            "multiple of the mxfp4 block size 32 (a block and its scale live on one rank; FP4 packs 2 values per "
            "byte along K)")


def test_marlin_moe_is_found_through_vllms_kernel_loader(monkeypatch):
    """vLLM 0.26 ships its MoE ops as vllm._moe_C_stable_libtorch (namespace torch.ops._moe_C); the Marlin fallback
    looks for the op after vLLM's platform loaded its kernels (it once imported vllm._moe_C, which 0.26 lacks, and
    so never ran). On CPU: without the op the reason names it; with a stand-in op registered the check goes on to
    vLLM's own FP4 Marlin support test (False without a GPU)."""
    import types

    from vllm.platforms import current_platform

    from cublade.vllm.kernels import VllmMarlinMoE

    if hasattr(torch.ops._moe_C, "moe_wna16_marlin_gemm"):
        pytest.skip("vLLM's MoE ops are loaded in this process (tests/moe/test_moe_gpu.py runs Marlin itself)")
    loads = []
    monkeypatch.setattr(current_platform, "import_kernels", lambda: loads.append(1))
    from cublade.vllm.kernels import base

    monkeypatch.setattr(base, "_capability", lambda device: 90)
    layer = types.SimpleNamespace(w13_weight_packed=types.SimpleNamespace(device=torch.device("cpu")),
                                  params_dtype=torch.bfloat16)
    ok, why = VllmMarlinMoE.can_implement(layer, FP4Scheme(format="mxfp4"))
    assert not ok and "moe_wna16_marlin_gemm" in why and loads
    lib = torch.library.Library("_moe_C", "FRAGMENT")
    try:
        lib.define("moe_wna16_marlin_gemm(Tensor x) -> Tensor")
        ok, why = VllmMarlinMoE.can_implement(layer, FP4Scheme(format="mxfp4"))
    finally:
        lib._destroy()
    assert (ok, why) == (False, "vLLM says this GPU has no FP4 Marlin support")
