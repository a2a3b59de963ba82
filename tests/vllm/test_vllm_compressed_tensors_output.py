"""`cublade convert --format compressed-tensors` output in vLLM 0.26 on CPU (cases: tests/test_convert_compressed_tensors.py).

  * without --quantization, vLLM's own compressed-tensors method parses the config, picks the expected scheme for
    every linear (CompressedTensorsW8A8Fp8 / CompressedTensorsWNA16 with the checkpoint's strategy, static input,
    group size and zero points), its model loader loads every tensor (it fails on one left unloaded or unknown)
    and the schemes' process_weights_after_loading runs; the weights it then holds, dequantized the way its
    kernels read them (vLLM's scalar types: uint4b8 is u - 8, uint4 is u - zero point), equal cublade's
    dequantization of the cublade-format checkpoint, and its attention layers hold the checkpoint's KV scales;
  * with --quantization cublade, cublade's methods serve it and compute the cublade-format checkpoint's logits.

vLLM's schemes choose their GEMM among the current platform's kernels, and a CPU machine (UnspecifiedPlatform)
has none: `stock_kernels` stands in a kernel that leaves the processed weights as the scheme made them and is
never applied. FP8 per-tensor weights of fused layers are requantized to the largest shard scale through vLLM's
CUDA op scaled_fp8_quant, replaced here by its static-scale contract (x / scale, saturated, to E4M3).
"""
from __future__ import annotations

import pytest
import torch
from test_convert_compressed_tensors import CASE_IDS, both_formats  # noqa: F401  (a fixture)
from vllm_model import load_vllm, vllm_logits
from test_vllm_model import windows

from cublade.checkpoint import load_all
from cublade.config import Fp8Scheme, W4A16Scheme

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


class _NoFp8Kernel:
    def input_quant_key(self):
        return None

    def process_weights_after_loading(self, layer):
        pass


@pytest.fixture
def stock_kernels(monkeypatch):
    from vllm import _custom_ops
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearKernel
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (compressed_tensors_w8a8_fp8,
                                                                                     compressed_tensors_wNa16)

    class NoMPKernel(MPLinearKernel):
        @classmethod
        def get_min_capability(cls):
            return 0

        @classmethod
        def can_implement(cls, c):
            return True, None

        def process_weights_after_loading(self, layer):
            pass

        def apply_weights(self, layer, x, bias=None):
            raise AssertionError("the CPU stand-in kernel is not for running")

    def scaled_fp8_quant(x, scale=None, **kw):
        assert scale is not None and not kw, "only the static-scale requantization runs here"
        return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale

    monkeypatch.setattr(compressed_tensors_w8a8_fp8, "init_fp8_linear_kernel", lambda **kw: _NoFp8Kernel())
    monkeypatch.setattr(compressed_tensors_wNa16, "choose_mp_linear_kernel", lambda config: NoMPKernel)
    monkeypatch.setattr(_custom_ops, "scaled_fp8_quant", scaled_fp8_quant)


SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
          "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


def vllm_linears(model):
    for i, block in enumerate(model.model.layers):
        for parent, name in ((block.self_attn, "qkv_proj"), (block.self_attn, "o_proj"), (block.mlp, "gate_up_proj"),
                             (block.mlp, "down_proj")):
            where = "self_attn" if parent is block.self_attn else "mlp"
            yield getattr(parent, name), [f"model.layers.{i}.{where}.{s}" for s in SHARDS[name]]


def stock_dequantized(layer) -> torch.Tensor:
    """The [N, K] weight vLLM's compressed-tensors scheme holds after process_weights_after_loading, as its
    kernels read it."""
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (CompressedTensorsW8A8Fp8,
                                                                                     CompressedTensorsWNA16)
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32
    from vllm.scalar_type import scalar_types

    s = layer.scheme
    if isinstance(s, CompressedTensorsW8A8Fp8):  # weight [K, N] after the scheme's transpose
        return layer.weight.t().float() * layer.weight_scale.float().reshape(-1, 1)
    assert isinstance(s, CompressedTensorsWNA16)
    u = unpack_quantized_values_into_int32(layer.weight_packed.data, s.quant_type, packed_dim=1)
    N, K = u.shape
    scale = layer.weight_scale.float()
    if s.symmetric:
        assert s.quant_type == scalar_types.uint4b8
        zero = torch.full_like(scale, s.quant_type.bias)
    else:
        assert s.quant_type == scalar_types.uint4
        zero = unpack_quantized_values_into_int32(layer.weight_zero_point.data, s.quant_type, packed_dim=0)[:N]
    per = K // scale.shape[1]
    return (u - zero.repeat_interleave(per, dim=1)).float() * scale.repeat_interleave(per, dim=1)


@pytest.mark.parametrize("case", CASE_IDS)
def test_vllm_compressed_tensors_method_loads_it(vllm_dist, cpu_attention, stock_kernels, both_formats, case):
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsLinearMethod)
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (CompressedTensorsW8A8Fp8,
                                                                                     CompressedTensorsWNA16)

    ours_dir, ct_dir, policy = both_formats(case)
    model, vc = load_vllm(ct_dir)
    assert vc.model_config.quantization == "compressed-tensors"
    ours = load_all(ours_dir)
    n = 0
    for layer, shards in vllm_linears(model):
        scheme = policy.scheme_for(shards[0])
        assert isinstance(layer.quant_method, CompressedTensorsLinearMethod), shards
        s = layer.scheme
        tensors = [{k[len(m) + 1:]: t for k, t in ours.items() if k.rsplit(".", 1)[0] == m} for m in shards]
        expect = torch.cat([scheme.dequantize(t) for t in tensors])
        if isinstance(scheme, Fp8Scheme):
            assert isinstance(s, CompressedTensorsW8A8Fp8), (shards, s)
            assert s.strategy == scheme.weight_strategy.value and bool(s.is_static_input_scheme) == scheme.static
            if scheme.static:
                assert layer.input_scale == max(t["input_scale"].item() for t in tensors)
            scales = {t["weight_scale"].item() for t in tensors} if not scheme.per_channel else set()
            if len(scales) > 1:  # per-tensor shards requantized to the largest scale: within an E4M3 rounding
                err = (stock_dequantized(layer) - expect).abs()
                assert (err <= expect.abs() * 2**-4 + max(scales) * 2**-9).all(), shards
                n += 1
                continue
        else:
            assert isinstance(scheme, W4A16Scheme)
            assert isinstance(s, CompressedTensorsWNA16), (shards, s)
            assert (s.group_size, s.symmetric, s.num_bits) == (scheme.group_size, scheme.symmetric, 4)
        assert torch.equal(stock_dequantized(layer), expect), shards
        n += 1
    assert n == 4 * len(model.model.layers)
    for i, block in enumerate(model.model.layers if policy.kv_cache is not None else []):
        attn = block.self_attn.attn
        for which in ("k", "v"):
            assert getattr(attn, f"_{which}_scale").item() == ours[f"model.layers.{i}.self_attn.{which}_scale"].item()


@pytest.mark.parametrize("case", CASE_IDS)
def test_cublade_serves_it_with_the_flag(vllm_dist, cpu_attention, both_formats, valid_text, case):
    """--quantization cublade on the compressed-tensors output: the logits of the cublade-format checkpoint."""
    ours_dir, ct_dir, _ = both_formats(case)
    model, vc = load_vllm(ct_dir, quantization="cublade")
    assert vc.model_config.quantization == "cublade"
    ours, _ = load_vllm(ours_dir)
    kv_fp8 = "kv" in case
    for ids in windows(ours_dir, valid_text, n=1):
        assert torch.equal(vllm_logits(model, ids, kv_fp8), vllm_logits(ours, ids, kv_fp8))
