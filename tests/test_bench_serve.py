"""benchmarks/bench_serve.py without a GPU: the server and client commands it runs (vLLM's own CLI, the bundled
tokenizer, fixed-length random requests), the table and ratios it prints from its JSON lines, and its refusals."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench(script):
    return script(REPO / "benchmarks" / "bench_serve.py")


def test_tokenizer_ids_fit_the_8b_vocabulary(bench):
    vocab = json.loads((bench.TOKENIZER / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocab) == 512 < 128256


def test_commands(bench, tmp_path):
    srv = bench.server_command(tmp_path / "cublade-w4a16", 8123, None, None, 256, 832, 1)
    assert srv[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", str(tmp_path / "cublade-w4a16")]
    assert srv[srv.index("--tokenizer") + 1] == str(bench.TOKENIZER)
    assert srv[srv.index("--max-num-seqs") + 1] == "256" and "--quantization" not in srv
    assert "--enforce-eager" not in srv  # compiled, CUDA graphs: as served
    srv = bench.server_command(tmp_path / "src", 8123, "fp8_per_channel", "CUSTOM", 16, 832, 2)
    assert srv[srv.index("--quantization") + 1] == "fp8_per_channel"
    assert srv[srv.index("--attention-backend") + 1] == "CUSTOM"
    assert srv[srv.index("--tensor-parallel-size") + 1] == "2"
    cli = bench.client_command(8123, 64, 256, 512, 256, tmp_path / "r.json")
    assert cli[3:5] == ["bench", "serve"] and "--ignore-eos" in cli
    for flag, value in (("--dataset-name", "random"), ("--random-input-len", "512"), ("--random-output-len", "256"),
                        ("--max-concurrency", "64"), ("--num-prompts", "256"), ("--result-dir", str(tmp_path)),
                        ("--result-filename", "r.json"), ("--base-url", "http://127.0.0.1:8123")):
        assert cli[cli.index(flag) + 1] == value, flag


def rows(tps, ttft=50.0, tpot=5.0):
    return {str(c): {"output_throughput": t, "median_ttft_ms": ttft, "median_tpot_ms": tpot, "completed": 32,
                     "failed": 0} for c, t in tps.items()}


def test_report_table_and_ratios(bench, capsys):
    first = {"input_len": 512, "output_len": 256, "configs": {
        "cublade-w4a16": rows({1: 100.0, 64: 1000.0}), "vllm-w4a16": rows({1: 50.0, 64: 2000.0})}}
    later = {"input_len": 512, "output_len": 256, "configs": {
        "bf16": rows({1: 80.0, 64: 1250.0}), "vllm-w4a16": rows({1: 40.0})}}  # replaces vllm-w4a16 at 1
    bench.report([first, later])
    out = capsys.readouterr().out
    assert "| config | concurrency 1 | concurrency 64 |" in out
    assert "| cublade-w4a16 | 100 / 50 / 5.00 | 1000 / 50 / 5.00 |" in out
    assert "cublade-w4a16 vs vllm-w4a16: c=1 2.50x, c=64 0.50x" in out
    assert "cublade-w4a16 vs bf16: c=1 1.25x, c=64 0.80x" in out
    assert "vllm-w4a16-humming" not in out  # no such rows: no ratio


def test_report_from_files(bench, tmp_path, capsys, monkeypatch):
    f = tmp_path / "serve.jsonl"
    f.write_text(json.dumps({"input_len": 512, "output_len": 256, "configs": {"bf16": rows({16: 900.0})}}) + "\n")
    monkeypatch.setattr(bench.sys, "argv", ["bench_serve.py", "report", str(f)])
    bench.main()
    assert "| bf16 | 900 / 50 / 5.00 |" in capsys.readouterr().out


def test_refusals(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench.sys, "argv", ["bench_serve.py", "run", str(tmp_path), "no-such-config"])
    with pytest.raises(SystemExit, match=r"unknown configuration\(s\) \['no-such-config'\]; known: bf16, "):
        bench.main()
    monkeypatch.setattr(bench.sys, "argv", ["bench_serve.py", "run", str(tmp_path), "cublade-w4a16"])
    with pytest.raises(SystemExit, match=r"no cublade-w4a16; run `bench_e2e.py make"):
        bench.main()
