"""Serving throughput through vLLM's own client: `vllm serve` of each configuration of bench_e2e.py (the
Llama-3-8B-shaped model and its conversions, made by `bench_e2e.py make`), loaded by `vllm bench serve` with random
prompts at each concurrency; output tokens/s, median TTFT and median TPOT per configuration and concurrency.

    python benchmarks/bench_serve.py run WORKDIR CONFIG ... [--concurrency 1,16,64,256] [--input-len 512]
                                     [--output-len 256] [--json FILE]
    python benchmarks/bench_serve.py report FILE [FILE ...]          # the table of earlier runs' JSON lines

Each server is compiled with CUDA graphs (vLLM's defaults), holds up to the largest concurrency, and is stopped before
the next starts (also when the run is stopped with SIGTERM, e.g. by `timeout`). Prompts and their tokenizer: the
random dataset samples token ids, decodes them to text and sends the text, which the server encodes again. A
sentencepiece tokenizer does not give the same ids back for random ids (with the bundled stories tokenizer 13 of 32
prompts of 512 ids came back as 1054-1470 tokens and were refused by the server), so the run writes a word-level
tokenizer of its own into WORKDIR/tokenizer-words: ids 3-511 are the words "w3" ... "w511" (all inside the model's
128256), joined by spaces, so every prompt is exactly --input-len tokens on both sides; generated ids beyond 511
decode to no text. Every request generates exactly --output-len tokens (`--ignore-eos`). Prompts per concurrency: 4x
the concurrency, at least 32. A row with failed requests is marked in the table (its throughput does not measure the
full load). A configuration whose server does not start, or a client run that fails, is reported with the log's last
lines and the rest goes on. Runs one configuration at a time: split a long list over several commands with the same
--json, then `report` it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import CONFIGS  # noqa: E402  (the same configurations as the decode-step bench)

REPO = Path(__file__).resolve().parent.parent
WORDS = 512  # the prompt tokenizer's ids; the model's vocabulary is 128256
START_TIMEOUT_S = 900  # a compiled 8B-shaped engine, Humming's JIT included
# kept per row (the table prints the first three); the rest tell a long tail or a slow stretch from the medians
METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "completed", "failed", "duration",
           "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms")
PAIRS = [("cublade-w4a16", "vllm-w4a16"), ("cublade-w4a16", "vllm-w4a16-humming"), ("cublade-fp8", "vllm-fp8"),
         ("cublade-mxfp8", "vllm-mxfp8")]


def write_word_tokenizer(path: Path) -> Path:
    """A word-level tokenizer whose decode -> encode gives the same ids back: "<unk>" 0, "<s>" 1, "</s>" 2, then
    "w3" ... "w511", split on whitespace. Written once; returns path."""
    if not (path / "tokenizer.json").exists():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, WORDS)}}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(cleanup=False)  # tokens joined by single spaces
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                eos_token="</s>").save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, n: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else "(no log)"


def server_command(model: Path, tokenizer: Path, port: int, quantization: str | None, backend: str | None,
                   max_seqs: int, max_len: int, tp: int) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--port", str(port),
            "--host", "127.0.0.1", "--served-model-name", "m", "--tokenizer", str(tokenizer),
            "--max-model-len", str(max_len), "--max-num-seqs", str(max_seqs), "--gpu-memory-utilization", "0.85",
            "--tensor-parallel-size", str(tp)] + \
        (["--quantization", quantization] if quantization else []) + \
        (["--attention-backend", backend] if backend else [])


def client_command(tokenizer: Path, port: int, concurrency: int, prompts: int, input_len: int, output_len: int,
                   result: Path) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm",
            "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--tokenizer", str(tokenizer),
            "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len",
            str(output_len), "--ignore-eos", "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
            "--percentile-metrics", "ttft,tpot,itl", "--seed", "0", "--save-result", "--result-dir",
            str(result.parent), "--result-filename", result.name]


@contextlib.contextmanager
def server(cmd: list[str], env: dict, log: Path):
    """The server started in its own process group; yields the process once /health answers (None if it did not
    start within START_TIMEOUT_S or exited); always stopped."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    port = cmd[cmd.index("--port") + 1]
    try:
        deadline = time.time() + START_TIMEOUT_S
        up = False
        while time.time() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    up = r.status == 200
            except OSError:
                pass
            if up:
                break
            time.sleep(3)
        yield proc if up else None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def run_config(work: Path, name: str, args) -> dict:
    """{concurrency: metrics} for one configuration (empty when its server did not start)."""
    sub, quant, extra_env, backend = CONFIGS[name]
    port = free_port()
    tokenizer = write_word_tokenizer(work / "tokenizer-words")
    cmd = server_command(work / sub, tokenizer, port, quant, backend, max(args.concurrency),
                         args.input_len + args.output_len, args.tensor_parallel_size)
    log = work / f"serve-{name}.log"
    print(f"{name}: {work / sub}" + (f" --quantization {quant}" if quant else "") +
          "".join(f" {k}={v}" for k, v in extra_env.items()) + f" (log {log})", flush=True)
    rows = {}
    t0 = time.time()
    with server(cmd, dict(os.environ, **extra_env), log) as proc:
        if proc is None:
            print(f"{name}: the server did not start; last lines of {log}:\n{tail(log)}", flush=True)
            return rows
        print(f"  started in {time.time() - t0:.0f} s", flush=True)
        for c in args.concurrency:
            result = work / f"serve-{name}-c{c}.json"
            result.unlink(missing_ok=True)
            client_log = work / f"serve-{name}-c{c}-client.log"
            with open(client_log, "w") as out:
                r = subprocess.run(client_command(tokenizer, port, c, max(4 * c, 32), args.input_len,
                                                  args.output_len, result),
                                   stdout=out, stderr=subprocess.STDOUT)
            if r.returncode != 0 or not result.exists():
                print(f"  concurrency {c}: client failed (exit {r.returncode}); last lines of {client_log}:\n"
                      f"{tail(client_log)}", flush=True)
                continue
            data = json.loads(result.read_text())
            rows[c] = {k: data.get(k) for k in METRICS}
            m = rows[c]
            if args.json:  # one line a concurrency: a run stopped later keeps the rows it finished
                with open(args.json, "a") as f:
                    f.write(json.dumps({"input_len": args.input_len, "output_len": args.output_len,
                                        "configs": {name: {c: m}}}) + "\n")
            print(f"  concurrency {c}: {m['output_throughput']:.0f} output tok/s, median TTFT "
                  f"{m['median_ttft_ms']:.1f} ms, median TPOT {m['median_tpot_ms']:.2f} ms "
                  f"({m['completed']} completed, {m['failed']} failed)", flush=True)
            if m["failed"]:
                print(f"  concurrency {c}: {m['failed']} requests failed: the row does not measure the full load; "
                      f"see {client_log}", flush=True)
    return rows


def cell(m: dict) -> str:
    text = f"{m['output_throughput']:.0f} / {m['median_ttft_ms']:.0f} / {m['median_tpot_ms']:.2f}"
    return text + (f" ({m['failed']} of {m['completed'] + m['failed']} failed)" if m.get("failed") else "")


def tail_cell(m: dict) -> str:
    return (f"{m['duration']:.0f} / {m['mean_ttft_ms']:.0f} / {m['p99_ttft_ms']:.0f} / {m['mean_tpot_ms']:.2f} / "
            f"{m['p99_tpot_ms']:.2f}")


def report(runs: list[dict]) -> None:
    """The table of every configuration's rows (later runs of a configuration replace earlier ones), the same rows'
    run time and mean / p99 TTFT and TPOT where kept, and the output-throughput ratios of cublade's configurations
    against their baselines."""
    results: dict[str, dict] = {}
    setup = None
    for run in runs:
        setup = setup or {k: run[k] for k in ("input_len", "output_len")}
        for name, rows in run["configs"].items():
            results.setdefault(name, {}).update({int(c): m for c, m in rows.items()})
    if not results:
        print("no results")
        return
    levels = sorted({c for rows in results.values() for c in rows})
    print(f"\n`vllm bench serve`, random prompts of {setup['input_len']} tokens, {setup['output_len']} output tokens "
          "each; output tok/s / median TTFT ms / median TPOT ms")
    print("| config | " + " | ".join(f"concurrency {c}" for c in levels) + " |")
    print("|---|" + "---:|" * len(levels))
    for name, rows in results.items():
        cells = [cell(rows[c]) if c in rows else "—" for c in levels]
        print(f"| {name} | " + " | ".join(cells) + " |")
    tails = {name: rows for name, rows in results.items() if any(m.get("p99_tpot_ms") is not None
                                                                   for m in rows.values())}
    if tails:  # what the medians hide: a slow stretch or a long tail
        print("\nthe same rows: run seconds / mean TTFT ms / p99 TTFT ms / mean TPOT ms / p99 TPOT ms")
        print("| config | " + " | ".join(f"concurrency {c}" for c in levels) + " |")
        print("|---|" + "---:|" * len(levels))
        for name, rows in tails.items():
            cells = [tail_cell(rows[c]) if rows.get(c, {}).get("p99_tpot_ms") is not None else "—" for c in levels]
            print(f"| {name} | " + " | ".join(cells) + " |")
    pairs = PAIRS + [(n, "bf16") for n in results if n != "bf16"]
    print("\noutput tokens/s, ours / baseline's:")
    for ours, base in pairs:
        if ours in results and base in results:
            common = [c for c in levels if c in results[ours] and c in results[base]]
            print(f"  {ours} vs {base}: " + ", ".join(
                f"c={c} {results[ours][c]['output_throughput'] / results[base][c]['output_throughput']:.2f}x"
                for c in common))


def cmd_run(args) -> None:
    work = Path(args.workdir)
    unknown = [n for n in args.configs if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    missing = sorted({CONFIGS[n][0] for n in args.configs if not (work / CONFIGS[n][0]).is_dir()})
    if missing:
        raise SystemExit(f"{work}: no {', '.join(missing)}; run `bench_e2e.py make {work}` first")
    run = {"input_len": args.input_len, "output_len": args.output_len, "concurrency": args.concurrency,
           "configs": {name: run_config(work, name, args) for name in args.configs}}
    report([run])


def cmd_report(args) -> None:
    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        raise SystemExit(f"no such file: {', '.join(missing)} (bench_serve.py run ... --json FILE writes one)")
    runs = [json.loads(line) for path in args.files for line in Path(path).read_text().splitlines() if line.strip()]
    report(runs)


def main() -> None:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="serve each configuration and load it at each concurrency")
    r.add_argument("workdir", help="bench_e2e.py make's directory")
    r.add_argument("configs", nargs="+", help=", ".join(CONFIGS))
    r.add_argument("--concurrency", type=ints, default=[1, 16, 64, 256], help="client concurrencies (default "
                   "1,16,64,256)")
    r.add_argument("--input-len", type=int, default=512, help="prompt tokens per request (default 512)")
    r.add_argument("--output-len", type=int, default=256, help="output tokens per request (default 256)")
    r.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per server (default 1)")
    r.add_argument("--json", help="append each concurrency's result as one JSON line to this file, as it finishes")
    q = sub.add_parser("report", help="print the table of earlier runs (their --json files)")
    q.add_argument("files", nargs="+")
    args = p.parse_args()
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the running server's context stops it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    {"run": cmd_run, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
