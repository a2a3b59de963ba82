"""benchmarks/bench_e2e.py's baseline checkpoint: cublade's w4a16 checkpoint relabelled as compressed-tensors must be
the same tensors (hard links) plus the `weight_shape` entries that format has, under a config vLLM's own
compressed-tensors method reads as int4 group-128 symmetric weight-only (its WNA16 scheme: Machete / Marlin)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench_e2e(script):
    return script(REPO / "benchmarks" / "bench_e2e.py")


def tensors(d):
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for f in sorted(set(index.values())):
        with safe_open(str(d / f), "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return index, out


def shrunk(bench_e2e, monkeypatch, shape: str) -> dict:
    """`shape` made small (hidden 128, MLP 256, 4 / 2 heads of 32, vocab 512) for the test: its config."""
    small = dict(bench_e2e.SHAPES[shape], hidden_size=128, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=512)
    monkeypatch.setitem(bench_e2e.SHAPES, shape, small)
    return small


def test_ct_w4a16_is_cublade_checkpoint_relabelled(bench_e2e, converted, tmp_path):
    src = converted("w4a16")  # the converter always writes an index
    dst = tmp_path / "ct-w4a16"
    bench_e2e.make_ct_w4a16(src, dst)
    assert not (tmp_path / "ct-w4a16.tmp").exists()

    src_index, src_t = tensors(src)
    dst_index, dst_t = tensors(dst)
    for name, f in src_index.items():
        assert dst_index[name] == f and os.path.samefile(src / f, dst / f)
    packed = [n for n in src_t if n.endswith(".weight_packed")]
    assert packed, "no int4 layer in the w4a16 fixture"
    extra = set(dst_t) - set(src_t)
    assert extra == {n.replace(".weight_packed", ".weight_shape") for n in packed}
    for n in packed:
        rows, k8 = src_t[n].shape
        assert dst_t[n.replace("packed", "shape")].tolist() == [rows, 8 * k8]

    pytest.importorskip("vllm.model_executor")
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig)

    q = json.loads((dst / "config.json").read_text())["quantization_config"]
    cfg = CompressedTensorsConfig.from_config(q)
    scheme = cfg.target_scheme_map["Linear"]
    w = scheme["weights"]
    assert (w.num_bits, w.strategy, w.group_size, w.symmetric) == (4, "group", 128, True)
    assert cfg._is_wNa16_group_channel(w, scheme.get("input_activations"))


@pytest.mark.parametrize("rounding", ["nearest", "query-aware"])
def test_fp8_kv_is_cublade_fp8_checkpoint_with_kv_scales(bench_e2e, converted, tmp_path, rounding):
    """The KV configurations' checkpoint: cublade's fp8-dynamic tensors (hard links), one k_scale / v_scale per
    layer, and a kv_cache the reference backend loads (so does vLLM: it reads the same config and tensors)."""
    from cublade.reference import load_reference_model

    src = converted("fp8-dynamic")
    dst = tmp_path / "kv"
    bench_e2e.make_fp8_kv(src, dst, rounding)
    src_index, src_t = tensors(src)
    dst_index, dst_t = tensors(dst)
    for name, f in src_index.items():
        assert dst_index[name] == f and os.path.samefile(src / f, dst / f)
    extra = set(dst_t) - set(src_t)
    assert extra == {f"model.layers.{i}.self_attn.{n}" for i in range(5) for n in ("k_scale", "v_scale")}
    assert all(dst_t[n].item() == pytest.approx(bench_e2e.KV_SCALE) for n in extra)
    _, policy = load_reference_model(dst)
    assert policy.kv_cache.rounding == rounding


def test_70b_shape_layer_shapes(bench_e2e):
    shapes = bench_e2e.layer_shapes(bench_e2e.SHAPES["70b"], 3)
    assert shapes["model.layers.3.self_attn.q_proj.weight"] == (8192, 8192)
    assert shapes["model.layers.3.self_attn.k_proj.weight"] == (1024, 8192)
    assert shapes["model.layers.3.mlp.gate_proj.weight"] == (28672, 8192)
    assert shapes["model.layers.3.mlp.down_proj.weight"] == (8192, 28672)


def test_make_refuses_unknown_presets(bench_e2e, tmp_path):
    import argparse

    (tmp_path / "src").mkdir()  # no source made: the preset check comes first
    with pytest.raises(SystemExit, match=r"--presets: unknown \['w8a8'\]"):
        bench_e2e.cmd_make(argparse.Namespace(workdir=str(tmp_path), layers=1, shape="8b", presets=["w8a8"]))


def test_make_mixtral_shape_writes_the_moe_source_and_its_fp4_conversion(bench_e2e, tmp_path, monkeypatch):
    """make --shape mixtral (shrunk here to hidden 128, experts of 256): Mixtral's tensor names for 8 experts and the
    router, a MixtralForCausalLM config, and the fp4-experts-fp8-dense conversion its two configurations serve."""
    import argparse

    from safetensors import safe_open

    small = shrunk(bench_e2e, monkeypatch, "mixtral")
    shapes = bench_e2e.layer_shapes(small, 0)
    moe = "model.layers.0.block_sparse_moe."
    assert shapes[moe + "gate.weight"] == (8, 128)
    assert shapes[moe + "experts.7.w1.weight"] == (256, 128) and shapes[moe + "experts.7.w2.weight"] == (128, 256)
    assert not any(".mlp." in n for n in shapes)
    bench_e2e.cmd_make(argparse.Namespace(workdir=str(tmp_path), layers=1, shape="mixtral", presets=None))
    cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["num_local_experts"] == 8
    out = tmp_path / "cublade-fp4-experts-fp8-dense"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cublade-fp4-experts-fp8-dense", "src"]
    for config in ("cublade-fp4-moe", "vllm-marlin-moe"):
        assert bench_e2e.CONFIGS[config][0] == out.name
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(out / index[moe + "experts.0.w1.weight_packed"]), "pt") as f:
        assert f.get_slice(moe + "experts.0.w1.weight_packed").get_shape() == [256, 64]  # 2 FP4 codes a byte
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "cublade"


def test_report_flags_step_times_whose_reps_spread(bench_e2e, capsys):
    """The report names every step time whose reps spread over NOISY of their median, so a ratio built on one is not
    read as settled (a TP = 2 run gave 0.26 ms of spread on a 1.85 ms step)."""
    def row(b, step, spread, prefill=5.0):
        return {"batch": b, "step_ms": step, "tok_s": b / step * 1e3, "spread_ms": spread, "prefill_ms": prefill}

    results = {"cublade-w4a16": {"rows": [row(1, 1.845, 0.261), row(16, 1.711, 0.05, prefill=8.0)]},
               "vllm-w4a16": {"rows": [row(1, 1.713, 0.067), row(16, 1.901, 0.126, prefill=10.0)]}}
    bench_e2e.report(results, [1, 16])
    out = capsys.readouterr().out
    flagged = out.split("reps spread over 5% of their median")[1].splitlines()[0]
    assert "cublade-w4a16 B=1 (0.261 ms, 14%)" in flagged and "vllm-w4a16 B=16 (0.126 ms, 7%)" in flagged
    assert "cublade-w4a16 B=16" not in flagged and "vllm-w4a16 B=1 " not in flagged
    decode, prompts = out.split("speed-up, decode step")[1].split("speed-up, the prompts")
    assert "cublade-w4a16 vs vllm-w4a16: B=1 0.93x, B=16 1.11x" in decode
    assert "cublade-w4a16 vs vllm-w4a16: B=1 1.00x, B=16 1.25x" in prompts  # the prompts' times, not the steps'


def test_run_writes_each_configuration_as_it_finishes(bench_e2e, tmp_path, monkeypatch, capsys):
    """`run --json` appends one line per configuration as soon as it is measured, so a run stopped by `timeout`
    before its last configuration keeps the ones it finished (a 70B-shaped run lost all three that way); the
    printed line gives each step time's reps spread. (The measuring subprocess stood in for: it writes a result;
    the second configuration's is stopped.)"""
    import argparse
    import subprocess

    for sub in ("cublade-w4a16", "ct-w4a16"):
        (tmp_path / sub).mkdir()

    def fake_run(cmd, env, stdout, stderr):
        result = Path(cmd[cmd.index("--result") + 1])
        if "ct-w4a16" in cmd[3]:
            raise KeyboardInterrupt  # what a timeout's signal does to the run mid-way
        rows = [{"batch": 1, "step_ms": 2.0, "tok_s": 500.0, "spread_ms": 0.1, "prefill_ms": 5.0}]
        result.write_text(json.dumps({"startup_s": 90.0, "rows": rows}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bench_e2e.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_e2e.subprocess, "run", fake_run)
    out = tmp_path / "e2e.jsonl"
    args = argparse.Namespace(cmd="run", workdir=str(tmp_path), configs=["cublade-w4a16", "vllm-w4a16"],
                              batches=[1], prompt=128, steps=32, reps=5, gpu_memory_utilization=0.5,
                              tensor_parallel_size=1, enable_expert_parallel=False, json=str(out))
    with pytest.raises(KeyboardInterrupt):
        bench_e2e.cmd_run(args)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [list(line["configs"]) for line in lines] == [["cublade-w4a16"]]
    assert lines[0]["configs"]["cublade-w4a16"]["rows"][0]["step_ms"] == 2.0
    assert "B=1 2.000 ms (reps spread 5%)" in capsys.readouterr().out


def test_make_with_the_lm_head_quantized(bench_e2e, tmp_path, monkeypatch):
    """make --presets w4a16-lm-head,fp8-dynamic-lm-head (shrunk to hidden 128, vocab 512): the conversions with
    `--quantize-lm-head`, served as configurations cublade-w4a16-lm-head and cublade-fp8-lm-head."""
    import argparse

    shrunk(bench_e2e, monkeypatch, "8b")
    bench_e2e.cmd_make(argparse.Namespace(workdir=str(tmp_path), layers=1, shape="8b",
                                          presets=["w4a16-lm-head", "fp8-dynamic-lm-head"]))
    out = tmp_path / "cublade-w4a16-lm-head"
    assert bench_e2e.CONFIGS["cublade-w4a16-lm-head"][0] == out.name
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight_packed" in index and "lm_head.weight" not in index
    assert "model.embed_tokens.weight" in index
    out = tmp_path / "cublade-fp8-dynamic-lm-head"
    assert bench_e2e.CONFIGS["cublade-fp8-lm-head"][0] == out.name
    assert "lm_head.weight_scale" in json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert not (tmp_path / "cublade-fp8-kv-nearest").exists()  # the FP8 KV variants come with fp8-dynamic only


class _Event:
    clock = 0.0  # launch order: each event starts after the one made before it

    def __init__(self, name, us):
        import types

        import torch

        self.name, self.device_time_total, self.device_type = name, us, torch.autograd.DeviceType.CUDA
        _Event.clock += us + 1.0
        self.time_range = types.SimpleNamespace(start=_Event.clock)


def test_gemms_by_projection_of_a_decode_step(bench_e2e):
    """The decode forwards' GEMMs by launch position: 4 a layer (qkv, o, gate_up, down) then the lm_head, each
    projection's time summed over the layers per step, the 1-token generate's forward (the prompts) left out; None
    where the launches do not split into such forwards."""
    layers, steps = 3, 2
    forward = [("cutlass_fp8", 10.0), ("cutlass_fp8", 5.0), ("fp8_gemm_cublade", 30.0), ("cutlass_fp8", 20.0)]

    def generate(n, prompt_us=1000.0):
        prompts = [(k, prompt_us) for k, _ in forward * layers] + [("nvjet", prompt_us)]
        return prompts + (forward * layers + [("nvjet", 240.0)]) * (n - 1)

    got = bench_e2e.gemms_by_projection(generate(1), generate(steps + 1), steps)
    assert got == {"qkv_proj": [30.0, ["cutlass_fp8"]], "o_proj": [15.0, ["cutlass_fp8"]],
                   "gate_up_proj": [90.0, ["fp8_gemm_cublade"]], "down_proj": [60.0, ["cutlass_fp8"]],
                   "lm_head": [240.0, ["nvjet"]]}
    assert bench_e2e.gemms_by_projection(generate(1), generate(steps + 1)[:-1], steps) is None
    # prompts whose layers launch two GEMM kernels each (a dequantize then cuBLAS): the decode forwards still split
    two = [(k, 1.0) for k, _ in forward * 2 * layers] + [("nvjet", 1.0)]
    assert bench_e2e.gemms_by_projection(two, two + generate(steps + 1)[len(generate(1)):], steps) == got


def test_kernel_profile_of_a_decode_step_and_of_the_prompts(bench_e2e, monkeypatch):
    """A decode step's kernels are the long generate's less the 1-token one's, per step; with prefill the 1-token
    generate's kernels are the whole answer. (torch.profiler stood in for: each generate of n tokens launches one
    prefill GEMM of 900 us and n - 1 decode GEMMs of 10 us.)"""
    import contextlib

    import torch.profiler

    last = {}

    def timed(n):
        last["n"] = n
        return 0.001 * n, []

    class Prof:
        def events(self):  # of the generate run inside the profile
            return [_Event("nvjet_prefill", 900.0)] + [_Event("nvjet_decode", 10.0)] * (last["n"] - 1)

    @contextlib.contextmanager
    def fake_profile(activities):
        yield Prof()

    monkeypatch.setattr(torch.profiler, "profile", fake_profile)
    decode = bench_e2e.kernel_profile(timed, steps=4, reps=1)
    assert decode["top"] == [("nvjet_decode", 10.0, 1.0)] and decode["kernels_ms"] == pytest.approx(0.010)
    assert decode["gemms_us"] is None  # one GEMM a forward: not a dense Llama's
    assert decode["step_ms"] == pytest.approx(1.0)
    prefill = bench_e2e.kernel_profile(timed, steps=4, reps=1, prefill=True)
    assert prefill["top"] == [("nvjet_prefill", 900.0, 1.0)] and prefill["step_ms"] == pytest.approx(1.0)


def test_kernel_profile_over_the_ranks_traces(bench_e2e, tmp_path):
    """At tensor-parallel size > 1 the kernels come from the traces vLLM's worker profiler writes, one per rank: their
    mean, the frontend's trace without GPU kernels left out, each trace removed once read. (vLLM stood in for: each
    rank's generate of n tokens launches n - 1 decode GEMMs of 10 us (rank 0) or 14 us (rank 1) and n all-reduces of
    3 us.)"""
    import json

    class FakeLLM:
        n = 0

        def start_profile(self):
            pass

        def stop_profile(self):
            for rank, gemm_us in ((0, 10.0), (1, 14.0)):
                events = [{"cat": "kernel", "name": "nvjet_decode", "dur": gemm_us}] * (self.n - 1) + [
                    {"cat": "kernel", "name": "cross_device_reduce_1stage<bf16>", "dur": 3.0}] * self.n + [
                    {"cat": "cpu_op", "name": "aten::mm", "dur": 50.0}]
                (tmp_path / f"rank{rank}.{self.n}.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
            (tmp_path / f"frontend.{self.n}.pt.trace.json").write_text(json.dumps({"traceEvents": [
                {"cat": "cpu_op", "name": "generate", "dur": 900.0}]}))

    llm = FakeLLM()

    def timed(n):
        llm.n = n
        return 0.001 * n, []

    res = bench_e2e.kernel_profile(timed, steps=4, reps=1, kernels=bench_e2e.worker_kernels(llm, timed, tmp_path))
    assert dict((name, (us, calls)) for name, us, calls in res["top"]) == {
        "nvjet_decode": (12.0, 1.0), "cross_device_reduce_1stage<bf16>": (3.0, 1.0)}
    assert res["kinds_us"] == {"cuBLAS GEMM (bf16)": 12.0, "all-reduce (tensor parallelism)": 3.0}
    assert res["kernels_ms"] == pytest.approx(0.015) and res["step_ms"] == pytest.approx(1.0)
    assert not list(tmp_path.glob("*.json"))


def test_worker_kernels_without_a_kernel_trace_says_so(bench_e2e, tmp_path):
    class SilentLLM:
        def start_profile(self):
            pass

        def stop_profile(self):
            pass

    kernels = bench_e2e.worker_kernels(SilentLLM(), lambda n: (0.001, []), tmp_path)
    with pytest.raises(RuntimeError, match="no trace with GPU kernels"):
        kernels(2)


def test_report_joins_the_lines_of_several_runs(bench_e2e, tmp_path, capsys, monkeypatch):
    """`report` prints one table and its ratios from the --json lines of runs split over several calls; a
    configuration measured twice keeps its last line, and lines of other batch sizes are refused, not mixed."""
    def line(name, step, batches=(1, 16)):
        rows = [{"batch": b, "step_ms": step * b ** 0.1, "tok_s": 1.0, "spread_ms": 0.0, "prefill_ms": 5.0}
                for b in batches]
        return json.dumps({"configs": {name: {"startup_s": 60.0, "rows": rows}}, "batches": list(batches),
                           "prompt": 128, "steps": 128}) + "\n"

    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(line("cublade-w4a16", 3.0) + line("vllm-w4a16", 3.0))
    second.write_text(line("cublade-w4a16", 2.0) + "\n" + line("bf16", 4.0))
    monkeypatch.setattr("sys.argv", ["bench_e2e.py", "report", str(first), str(second)])
    bench_e2e.main()
    out = capsys.readouterr().out
    assert [r.split(" |")[0] for r in out.splitlines() if r.startswith("| ") and "config" not in r] == [
        "| cublade-w4a16", "| vllm-w4a16", "| bf16"]
    assert "cublade-w4a16 vs vllm-w4a16: B=1 1.50x, B=16 1.50x" in out
    assert "cublade-w4a16 vs bf16: B=1 2.00x" in out and "vllm-w4a16 vs bf16: B=1 1.33x" in out

    second.write_text(line("bf16", 4.0, batches=(1, 64)))
    with pytest.raises(SystemExit, match=r"b.jsonl:1: measured with .*'batches': \[1, 64\].* a report compares"):
        bench_e2e.main()


def test_make_fp8_static_writes_a_static_compressed_tensors_checkpoint(bench_e2e, tmp_path, monkeypatch):
    """make --presets fp8-static (shrunk to hidden 128, vocab 512): the source in compressed-tensors FP8, relabelled
    static per tensor with one input_scale a layer (hard links to the dynamic conversion's shards), which cublade reads
    as its static-tensor fp8 scheme with every tensor in its shape and vLLM's compressed-tensors config as static
    per-tensor FP8 activations; both fp8-static configurations serve it."""
    import argparse

    from cublade.config import Fp8Scheme
    from cublade.config.compressed_tensors import policy_from_compressed_tensors, tensor_specs
    from cublade.numerics.fp8 import Fp8Activations

    shrunk(bench_e2e, monkeypatch, "8b")
    bench_e2e.cmd_make(argparse.Namespace(workdir=str(tmp_path), layers=2, shape="8b", presets=["fp8-static"]))
    dyn, out = tmp_path / "ct-fp8-dynamic", tmp_path / "ct-fp8-static"
    assert {bench_e2e.CONFIGS[c][0] for c in ("vllm-fp8-static", "cublade-fp8-static")} == {out.name}
    assert bench_e2e.CONFIGS["cublade-fp8-static"][1] == "cublade" and bench_e2e.CONFIGS["vllm-fp8-static"][1] is None
    src_index, src_t = tensors(dyn)
    dst_index, dst_t = tensors(out)
    for name, f in src_index.items():
        assert dst_index[name] == f and os.path.samefile(dyn / f, out / f)
    scaled = {n.removesuffix("weight_scale") for n in src_t if n.endswith(".weight_scale")}
    assert len(scaled) == 2 * 7  # q, k, v, o, gate, up, down in each layer
    assert set(dst_t) - set(src_t) == {p + "input_scale" for p in scaled}
    assert all(dst_t[p + "input_scale"].tolist() == [pytest.approx(bench_e2e.INPUT_SCALE)] for p in scaled)
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    policy = policy_from_compressed_tensors(q)
    (name, scheme), = policy.schemes
    assert isinstance(scheme, Fp8Scheme) and scheme.activations is Fp8Activations.STATIC_TENSOR
    for p in scaled:  # every tensor the static scheme reads, in its shape
        N, K = dst_t[p + "weight"].shape
        for suffix, (shape, _) in tensor_specs(scheme, N, K).items():
            assert tuple(dst_t[p + suffix].shape) == tuple(shape), (p, suffix)

    pytest.importorskip("vllm.model_executor")
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig)

    a = CompressedTensorsConfig.from_config(q).target_scheme_map["Linear"]["input_activations"]
    assert (a.num_bits, a.strategy, a.dynamic) == (8, "tensor", False)
