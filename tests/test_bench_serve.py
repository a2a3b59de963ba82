"""benchmarks/bench_serve.py without a GPU: its prompt tokenizer (vLLM's random prompts come back at exactly the
asked length), the server and client commands it runs (vLLM's own CLI, fixed-length random requests), the table and
ratios it prints from its JSON lines (rows with failed requests marked), and its refusals."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench(script):
    return script(REPO / "benchmarks" / "bench_serve.py")


def test_word_tokenizer_gives_vllm_random_prompts_back_at_their_length(bench, tmp_path):
    path = bench.write_word_tokenizer(tmp_path / "tok")
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocab) == 512 and max(vocab.values()) < 128256  # inside the 8B-shaped model's vocabulary
    datasets = pytest.importorskip("vllm.benchmarks.datasets.datasets")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    requests = datasets.RandomDataset(random_seed=0).sample(tokenizer=tok, num_requests=64, input_len=512,
                                                            output_len=256)
    # the client's count and the server's encoding of the text it is sent
    assert {r.prompt_len for r in requests} == {512}
    assert {len(tok(r.prompt).input_ids) for r in requests} == {512}
    assert tok.decode([5, 100_000, 6]) == "w5 w6"  # a generated id beyond the words decodes to no text


def test_commands(bench, tmp_path):
    tok = tmp_path / "tokenizer-words"
    srv = bench.server_command(tmp_path / "cublade-w4a16", tok, 8123, None, None, 256, 768, 1)
    assert srv[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", str(tmp_path / "cublade-w4a16")]
    assert srv[srv.index("--tokenizer") + 1] == str(tok)
    assert srv[srv.index("--max-model-len") + 1] == "768"
    assert srv[srv.index("--max-num-seqs") + 1] == "256" and "--quantization" not in srv
    assert "--enforce-eager" not in srv  # compiled, CUDA graphs: as served
    srv = bench.server_command(tmp_path / "src", tok, 8123, "fp8_per_channel", "CUSTOM", 16, 768, 2)
    assert srv[srv.index("--quantization") + 1] == "fp8_per_channel"
    assert srv[srv.index("--attention-backend") + 1] == "CUSTOM"
    assert srv[srv.index("--tensor-parallel-size") + 1] == "2"
    cli = bench.client_command(tok, 8123, 64, 256, 512, 256, tmp_path / "r.json")
    assert cli[3:5] == ["bench", "serve"] and "--ignore-eos" in cli
    assert cli[cli.index("--tokenizer") + 1] == str(tok)
    for flag, value in (("--dataset-name", "random"), ("--random-input-len", "512"), ("--random-output-len", "256"),
                        ("--max-concurrency", "64"), ("--num-prompts", "256"), ("--result-dir", str(tmp_path)),
                        ("--result-filename", "r.json"), ("--base-url", "http://127.0.0.1:8123")):
        assert cli[cli.index(flag) + 1] == value, flag


def rows(tps, ttft=50.0, tpot=5.0, failed=0):
    return {str(c): {"output_throughput": t, "median_ttft_ms": ttft, "median_tpot_ms": tpot, "completed": 32 - failed,
                     "failed": failed} for c, t in tps.items()}


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


def test_report_tail_table_where_kept(bench, capsys):
    """Rows that kept the run's time and mean / p99 TTFT and TPOT get a second table (a row can have lower medians
    than another and still finish later); rows from files without them get none."""
    tail = {"duration": 40.2, "mean_ttft_ms": 900.0, "p99_ttft_ms": 5100.0, "mean_tpot_ms": 33.5, "p99_tpot_ms": 61.25}
    new = rows({256: 6522.0})
    new["256"].update(tail)
    bench.report([{"input_len": 512, "output_len": 256, "configs": {"cublade-w4a16": new,
                                                                     "vllm-w4a16": rows({256: 7196.0})}}])
    out = capsys.readouterr().out
    assert "run seconds / mean TTFT ms / p99 TTFT ms / mean TPOT ms / p99 TPOT ms" in out
    assert "| cublade-w4a16 | 40 / 900 / 5100 / 33.50 / 61.25 |" in out
    assert out.count("| vllm-w4a16 |") == 1  # its row without the tail metrics: only in the first table
    bench.report([{"input_len": 512, "output_len": 256, "configs": {"bf16": rows({1: 199.0})}}])
    assert "p99" not in capsys.readouterr().out


def test_report_marks_rows_with_failed_requests(bench, capsys):
    bench.report([{"input_len": 512, "output_len": 256, "configs": {"bf16": rows({1: 199.0}, failed=13)}}])
    assert "| bf16 | 199 / 50 / 5.00 (13 of 32 failed) |" in capsys.readouterr().out


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
    monkeypatch.setattr(bench.sys, "argv", ["bench_serve.py", "report", str(tmp_path / "none.jsonl")])
    with pytest.raises(SystemExit, match=r"no such file: .*none.jsonl \(bench_serve.py run ... --json FILE"):
        bench.main()
    monkeypatch.setattr(bench.sys, "argv", ["bench_serve.py", "run", str(tmp_path), "cublade-w4a16"])
    with pytest.raises(SystemExit, match=r"no cublade-w4a16; run `bench_e2e.py make"):
        bench.main()


def test_sigterm_stops_the_server(tmp_path):
    """`timeout` stops a run with SIGTERM: the server it started (its own process group) must go with it, or it holds
    the GPU's memory for whatever runs next."""
    (tmp_path / "src").mkdir()
    pidfile = tmp_path / "server.pid"
    fake_server = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO / 'benchmarks')!r})
        import bench_serve
        bench_serve.server_command = lambda *a: [sys.executable, "-c", {fake_server!r}, "--port", "1"]
        sys.argv = ["bench_serve.py", "run", {str(tmp_path)!r}, "bf16"]
        bench_serve.main()
    """))
    run = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while not (pidfile.exists() and pidfile.read_text()) and time.time() < deadline:
        time.sleep(0.2)
    server_pid = int(pidfile.read_text())
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=60) == 143, run.stdout.read()
    with pytest.raises(ProcessLookupError):
        os.kill(server_pid, 0)


def test_each_concurrency_is_written_as_it_finishes(bench, tmp_path, monkeypatch):
    """A lane stopped by `timeout` in its second concurrency keeps the first one's row in --json."""
    (tmp_path / "src").mkdir()
    out = tmp_path / "serve.jsonl"

    @contextlib.contextmanager
    def up(cmd, env, log):
        yield object()

    def client(cmd, stdout, stderr):
        if cmd[cmd.index("--max-concurrency") + 1] == "16":
            raise KeyboardInterrupt  # what SIGTERM's handler unwinds as
        result = Path(cmd[cmd.index("--result-dir") + 1]) / cmd[cmd.index("--result-filename") + 1]
        result.write_text(json.dumps(rows({1: 321.0})["1"]))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bench, "server", up)
    monkeypatch.setattr(bench.subprocess, "run", client)
    monkeypatch.setattr(bench.sys, "argv", ["bench_serve.py", "run", str(tmp_path), "bf16", "--concurrency",
                                            "1,16", "--json", str(out)])
    with pytest.raises(KeyboardInterrupt):
        bench.main()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    kept = {k: rows({1: 321.0})["1"].get(k) for k in bench.METRICS}  # the metrics vLLM's result file has, else None
    assert lines == [{"input_len": 512, "output_len": 256, "configs": {"bf16": {"1": kept}}}]
