"""Tensor parallelism 2 and 4 on CPU: 2 or 4 gloo processes build the same vLLM layers with cublade's config and
load the full checkpoint tensors through vLLM's loaders, which shard them. Column-parallel layers (QKV, gate_up):
each rank's output columns equal the single-process reference's, bit for bit. Row-parallel (down_proj): each
rank holds a K slice (its weight columns, group scales, zero points, MX block scales; per-channel scales
replicated), and the all-reduced output equals the sum of the references over the K slices (within bf16
rounding of the partial sums: 1e-2 relative; measured 2.1e-3 to 2.2e-3 at 2 ranks). A quantized lm_head (vLLM's
ParallelLMHead, 200 vocabulary rows padded to 256) splits the vocabulary: each rank's rows of the logits equal the
reference's bit for bit, its padding rows are zero (at 4 ranks the last holds 8 rows and 56 of padding). At 4 ranks
each rank's down_proj K is 64, one group of the g64 scheme and 2 MX blocks."""
from __future__ import annotations

import pytest
import torch
from accuracy import rel_err
from vllm_layers import KINDS, random_weights, single_scheme_config

from cublade.config import Fp8Scheme, MXFP8Scheme, W4A16Scheme

SCHEMES = [Fp8Scheme("tensor", "dynamic-token"), Fp8Scheme("channel", "static-tensor"), W4A16Scheme(64, False),
           W4A16Scheme(-1, True), MXFP8Scheme()]
VOCAB, PADDED = 200, 256  # lm_head rows, and as vLLM pads them (to a multiple of 64)


def lm_head_inputs(scheme):
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(3), dtype=torch.float32).to(torch.bfloat16)
    w = torch.randn(VOCAB, 128, generator=torch.Generator().manual_seed(6), dtype=torch.float32) * 0.05
    tensors = scheme.quantize(w)
    if getattr(scheme, "static", False):
        tensors["input_scale"] = (x.float().abs().amax() / 448.0).reshape(1)
    return x, tensors


def inputs(scheme, kind):
    x = torch.randn(4, kind.K, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    tensors = {m: scheme.quantize(w) for m, w in random_weights(kind, seed=5).items()}
    if getattr(scheme, "static", False):
        for t in tensors.values():
            t["input_scale"] = (x.float().abs().amax() / 448.0).reshape(1)
    return x, tensors


def worker(rank: int, tp: int, init_method: str, out_dir: str) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm_layers import lm_head, load, single_scheme_config
    from vllm_model import cpu_vllm_config

    import cublade.vllm

    cublade.vllm.register()
    with set_current_vllm_config(cpu_vllm_config()):
        init_distributed_environment(tp, rank, init_method, rank, "gloo")
        initialize_model_parallel(tp, 1)
        torch.set_default_dtype(torch.bfloat16)
        results = {}
        for i, scheme in enumerate(SCHEMES):
            for name, kind in KINDS.items():
                x, tensors = inputs(scheme, kind)
                layer = kind.build(single_scheme_config(scheme))
                load(layer, kind, tensors)
                layer.quant_method.process_weights_after_loading(layer)
                xin = x if name != "down" else x.chunk(tp, dim=-1)[rank]  # row-parallel takes its K slice
                results[i, name] = layer(xin)[0]
            x, tensors = lm_head_inputs(scheme)
            head = lm_head(scheme, VOCAB, 128, tensors)
            idx = head.shard_indices
            results[i, "lm_head"] = (head.quant_method.apply(head, x), idx.org_vocab_start_index,
                                     idx.org_vocab_end_index)
        for name, build in REFUSED.items() if tp == 2 else ():  # layers whose per-rank shape breaks a rule
            try:
                build()
            except ValueError as e:
                results[name] = str(e)
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def _row(scheme, K: int, N: int = 128):
    def build():
        from vllm.model_executor.layers.linear import RowParallelLinear

        return RowParallelLinear(K, N, bias=False, quant_config=single_scheme_config(scheme),
                                 prefix="model.layers.0.mlp.down_proj")
    return build


def _qkv_ct_asymmetric():
    """compressed-tensors int4 with zero points: q 64 / k 24 / v 24 rows split over 2 ranks leaves k and v 12 rows."""
    from vllm.model_executor.layers.linear import QKVParallelLinear

    from cublade.config.compressed_tensors import CT_METHOD

    qc = {"quant_method": CT_METHOD, "format": "pack-quantized", "ignore": ["lm_head"],
          "quantization_status": "compressed", "kv_cache_scheme": None,
          "config_groups": {"group_0": {
              "targets": ["Linear"], "input_activations": None, "output_activations": None,
              "weights": {"num_bits": 4, "type": "int", "symmetric": False, "dynamic": False, "strategy": "group",
                          "group_size": 64, "actorder": None}}}}
    return QKVParallelLinear(128, 4, 16, 6, bias=False, quant_config=single_scheme_config(None, qc),
                             prefix="model.layers.0.self_attn.qkv_proj")


def _no_kernel_left():
    """A layer no candidate can run (the reference taken out): the selection's error gives the shape per rank."""
    import os

    scheme, kind = Fp8Scheme(), KINDS["down"]
    layer = kind.build(single_scheme_config(scheme))
    os.environ["CUBLADE_DISABLED_KERNELS"] = "reference"
    try:
        layer.quant_method.process_weights_after_loading(layer)
    except NotImplementedError as e:
        raise ValueError(str(e)) from None
    finally:
        del os.environ["CUBLADE_DISABLED_KERNELS"]


# name -> layer builder whose per-rank shape at TP=2 breaks a rule (or leaves no kernel); the error each rank raises
REFUSED = {
    "w4a16-group": _row(W4A16Scheme(128), 384),
    "w4a16-pack": _row(W4A16Scheme(-1), 2 * 196),
    "mxfp8-block": _row(MXFP8Scheme(), 96),
    "ct-zero-points": _qkv_ct_asymmetric,
    "no-kernel": _no_kernel_left,
}
REFUSALS = {
    "w4a16-group": "model.layers.0.mlp.down_proj: K=192 per rank (in_features 384 at tensor-parallel size 2) breaks a "
                   "rule of scheme w4a16(group_size=128, symmetric=True): in_features per rank must be a multiple of "
                   "the group size 128 (a group and its scale live on one rank)",
    "w4a16-pack": "model.layers.0.mlp.down_proj: K=196 per rank (in_features 392 at tensor-parallel size 2) breaks a "
                  "rule of scheme w4a16(group_size=-1, symmetric=True): in_features per rank must be a multiple of 8 "
                  "(int4 values pack 8 per int32 along K)",
    "mxfp8-block": "model.layers.0.mlp.down_proj: K=48 per rank (in_features 96 at tensor-parallel size 2) breaks a "
                   "rule of scheme mxfp8(scale_rule=rceil): in_features per rank must be a multiple of the MX block 32 "
                   "(a block and its E8M0 scale live on one rank)",
    "ct-zero-points": "model.layers.0.self_attn.qkv_proj: N=[32, 12, 12] per rank (out_features 112 at "
                      "tensor-parallel size 2) breaks a rule of scheme w4a16(group_size=64, symmetric=False): output "
                      "features per rank of each fused shard must be multiples of 8 (compressed-tensors packs zero "
                      "points 8 per int32 along N)",
    "no-kernel": "model.layers.0.mlp.down_proj: no kernel can run scheme fp8(weight_strategy=channel, "
                 "activations=dynamic-token) [N=128, K=128 per rank at tensor-parallel size 2, torch.bfloat16]: "
                 "cublade-fp8-gemm: runs when asked for (CUBLADE_FP8_GEMM=1; not faster than vLLM's CUTLASS where "
                 "measured); cublade-fp8-wgmma: runs when asked for (CUBLADE_FP8_WGMMA=1); "
                 "vllm-cutlass-scaled-mm: needs a CUDA device; "
                 "vllm-marlin-fp8: needs a CUDA device; "
                 "cublade-fp8-w8a16: needs a CUDA device; reference: "
                 "disabled by CUBLADE_DISABLED_KERNELS",
}


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel(tmp_path, tp):
    import torch.multiprocessing as mp
    from vllm_model import dist_init_method

    mp.spawn(worker, args=(tp, dist_init_method(tmp_path), str(tmp_path)), nprocs=tp, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(tp)]
    for i, scheme in enumerate(SCHEMES):
        for name, kind in KINDS.items():
            x, tensors = inputs(scheme, kind)
            if name != "down":
                # vLLM splits each shard (q/k/v, gate/up) by rank along its rows
                refs = [scheme.linear_ref(x, tensors[m]).chunk(tp, dim=-1) for _, m, _ in kind.shards]
                for r in range(tp):
                    expect = torch.cat([ref[r] for ref in refs], dim=-1)
                    assert torch.equal(ranks[r][i, name], expect), (scheme.describe(), name, r)
            else:
                K = kind.K // tp
                ref = sum(scheme.linear_ref(x[:, r * K:(r + 1) * K].float(), slice_k(scheme, t, r, K)).float()
                          for r in range(tp) for t in [tensors[kind.shards[0][1]]])
                for r in range(tp):
                    assert rel_err(ranks[r][i, name], ref) < 1e-2, (scheme.describe(), r)
                    assert torch.equal(ranks[r][i, name], ranks[0][i, name])  # all-reduced
        x, tensors = lm_head_inputs(scheme)
        ref = scheme.linear_ref(x, tensors)
        starts = []
        rows = PADDED // tp
        for r in range(tp):
            y, start, end = ranks[r][i, "lm_head"]
            assert y.shape == (4, rows) and torch.equal(y[:, :end - start], ref[:, start:end]), (scheme.describe(), r)
            assert not y[:, end - start:].any()
            starts.append((start, end))
        assert starts == [(r * rows, min((r + 1) * rows, VOCAB)) for r in range(tp)]
    if tp == 2:
        for r in range(tp):  # vLLM's per-rank sizes reach the rules: the same one-line error on each rank
            assert {k: ranks[r].get(k) for k in REFUSALS} == REFUSALS


def slice_k(scheme, t: dict[str, torch.Tensor], r: int, K: int) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of the K slice [r*K, (r+1)*K) of a [N, 2K] layer."""
    out = dict(t)
    if isinstance(scheme, (Fp8Scheme, MXFP8Scheme)):
        out["weight"] = t["weight"][:, r * K:(r + 1) * K]
    if isinstance(scheme, MXFP8Scheme):
        out["weight_scale"] = t["weight_scale"][:, r * K // 32:(r + 1) * K // 32]
    if isinstance(scheme, W4A16Scheme):
        out["weight_packed"] = t["weight_packed"][:, r * K // 8:(r + 1) * K // 8]
        if scheme.group_size != -1:
            g = K // scheme.group_size
            for s in ("weight_scale", "weight_zero_point"):
                if s in t:
                    out[s] = t[s][:, r * g:(r + 1) * g]
    return out


@pytest.fixture(autouse=True)
def _needs_vllm():
    pytest.importorskip("vllm.model_executor")


# ---- the rules on one rank's shapes, called directly ---------------------------------------------------------

@pytest.mark.parametrize("scheme,parts,K,K_full,tp,ct,rule", [
    # w4a16: K per rank a multiple of 8 (packing) and of the group size
    (W4A16Scheme(128), [4096], 3584, 14336, 4, False, None),
    (W4A16Scheme(128), [4096], 1792, 14336, 8, False, None),
    (W4A16Scheme(128), [4096], 7168 // 2 + 64, 7168 + 128, 2, False, "multiple of the group size 128"),
    (W4A16Scheme(32), [512], 48, 96, 2, False, "multiple of the group size 32"),
    (W4A16Scheme(64, False), [512], 96, 192, 2, False, "multiple of the group size 64"),
    (W4A16Scheme(-1), [512], 100, 200, 2, False, "multiple of 8 (int4 values pack 8 per int32 along K)"),
    (W4A16Scheme(-1), [512], 104, 208, 2, False, None),  # per channel: any K per rank that packs
    # column splits: cublade's own layout has no packing along N; compressed-tensors zero points pack 8 along N
    (W4A16Scheme(64, False), [100, 12], 128, 128, 2, False, None),
    (W4A16Scheme(64, False), [100, 12], 128, 128, 2, True, "compressed-tensors packs zero points 8 per int32"),
    (W4A16Scheme(64, True), [100, 12], 128, 128, 2, True, None),
    # mxfp8: K per rank a multiple of the MX block; any N
    (MXFP8Scheme(), [1000], 48, 96, 2, False, "multiple of the MX block 32"),
    (MXFP8Scheme(), [1000], 2048, 8192, 4, False, None),
    # fp8: no sharding rule (per-rank shapes CUTLASS refuses run on Marlin, which pads: test_vllm_kernels_by_gpu)
    (Fp8Scheme(), [104], 72, 144, 2, False, None),
], ids=lambda v: v.describe() if hasattr(v, "describe") else None)
def test_sharding_rules(scheme, parts, K, K_full, tp, ct, rule):
    from cublade.vllm.linear import check_partition

    N_full = sum(parts) * tp
    if rule is None:
        check_partition(scheme, "m.proj", parts, K, K_full, N_full, tp, ct)
        return
    with pytest.raises(ValueError) as e:
        check_partition(scheme, "m.proj", parts, K, K_full, N_full, tp, ct)
    msg = str(e.value)
    dim = (f"N={parts if len(parts) > 1 else parts[0]} per rank (out_features {N_full}" if "zero points" in rule else
           f"K={K} per rank (in_features {K_full}")
    assert msg.startswith(f"m.proj: {dim} at tensor-parallel size {tp}) breaks a rule of scheme {scheme.describe()}: ")
    assert rule in msg and "\n" not in msg
