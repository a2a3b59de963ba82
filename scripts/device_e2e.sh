#!/usr/bin/env bash
# End-to-end checks on the GPU machine, after vLLM is staged (../shared/device/README.md) and
# `source .device-stage/env.sh`. One phase per device call (each stays well inside the 10-minute limit):
#   kernels  build cublade into /tmp/site, GPU op tests, every benchmark (scripts/device_check.sh)
#   serve    vllm serve each preset: completions, greedy vs unquantized (one call took 560 s: too long)
#   serve2   compiled vs eager, FP8 KV with cublade's cache write, compressed-tensors interop
#   ppl      cublade ppl --backend vllm vs the reference backend; the MoE fixture served and scored
#   tuning   the stand-alone sweeps of benchmarks/tuning (no vLLM needed): quant kernels, W4A16 small-M GEMV,
#            W4A16 occupancy (tiles per warp x splits x ring stages), W4A16 pipeline (copies alone vs a plain read),
#            RMSNorm + FP8 quantization as two kernels or one (norm_quant)
#   tp SEL ...  tests/gpu/test_tensor_parallel_8b_shaped.py -k SEL on the machine's GPUs (2 or 4), at most TP_TIMEOUT
#            seconds (default 570; 30-40 s an engine: e.g. "tp2 and (bf16 or w4a16-g128)", "x2"); with several
#            selections, side by side on an equal share of the GPUs each (on four: `tp "tp2 and A" "tp2 and B"` runs
#            on GPUs 0,1 and 2,3); logs $OUT/tp-lane<i>.log, those of engines that failed in $OUT/tp-engines
#   model    the 32-layer Llama-3-8B-shaped model and its conversions ($E2E_PRESETS, default w4a16, fp8-dynamic and
#            both with --quantize-lm-head) in $E2E (default /tmp/e2e; about 6 minutes on 32 cores), for bench_e2e.py and
#            bench_serve.py; E2E_SHAPE / E2E_LAYERS make another (e.g. 70b and 40: 16 layers took 34 s + 116 s for w4a16
#            on 64 cores beside the build); log $OUT/make-<E2E's name>.log
#   serve-bench LANE ...  benchmarks/bench_serve.py, one lane per GPU (lane i on GPU i, side by side), a lane a
#            comma-separated list of configurations run one after another, each appending to $OUT/serve.jsonl;
#            then the table of all of them. E.g. `serve-bench cublade-w4a16,bf16 vllm-w4a16,vllm-w4a16-humming` on
#            two GPUs (a compiled 8B-shaped server starts in 110-175 s, Humming's JIT included; each stays well
#            under 10 minutes with two configurations a lane, SERVE_TIMEOUT seconds at most, default 570; a lane that
#            runs out keeps the concurrencies it finished). The servers' and clients' logs and vLLM's result files go
#            to $OUT/serve-logs; the kernel choices they name are printed. SERVE_ARGS: more bench_serve.py run
#            arguments, e.g. "--concurrency 256".
#   e2e-bench LANE ...  benchmarks/bench_e2e.py run, one lane per GPU as serve-bench's (a lane's configurations, comma-
#            separated, in one run: their ratios in its report), E2E_ARGS more run arguments (default "--batches
#            1,16,64"), at most E2E_TIMEOUT seconds (default 570; about 2 minutes a configuration on the 8B shape);
#            each lane's report in $OUT/e2e-lane<GPU>.log, the JSON lines in $OUT/e2e.jsonl.
# Logs and JSON results go under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUBLADE_GPU_RESULTS=$OUT/gpu_results.jsonl
pytest_run() {  # name, timeout, pytest args...
  local name=$1 t=$2; shift 2
  timeout "$t" python3 -m pytest -q -p no:cacheprovider -rs --durations=10 "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? $(grep -E '^[0-9]+ (passed|failed|skipped)|(passed|failed).* in [0-9.]+s' "$OUT/$name.log" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$OUT/$name.log" | head -20
}
case "${1:?phase: kernels | serve | serve2 | ppl | tuning | tp | model | serve-bench | e2e-bench}" in
  kernels) CUBLADE_TEST_TIMEOUT=${CUBLADE_TEST_TIMEOUT:-300} bash scripts/device_check.sh ;;
  serve)   pytest_run serve 560 tests/gpu/test_serve.py -k "answers or baseline or greedy" ;;
  serve2)  pytest_run serve2 560 tests/gpu/test_serve.py -k "compiled or kv_cache or compressed" ;;
  ppl)     pytest_run ppl 330 tests/gpu/test_serve.py -k "ppl"
           pytest_run moe 230 tests/moe/test_moe_gpu.py ;;
  tuning)  for h in quant_sweep w4a16_gemv_sweep w4a16_occupancy w4a16_pipeline norm_quant; do
             nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I plugin/csrc "benchmarks/tuning/$h.cu" \
               -o "/tmp/$h" > "$OUT/$h.build.log" 2>&1 || { echo "$h: build FAILED"; continue; }
             timeout 240 "/tmp/$h" > "$OUT/$h.txt" 2>&1
             echo "$h: rc=$?"; grep -E "^BEST|fastest|FAIL" "$OUT/$h.txt" | head -20
           done ;;
  tp)      shift
           [ $# -gt 0 ] || { echo "tp: give a -k selection (or one per lane)" >&2; exit 2; }
           per=$(( $(nvidia-smi -L | wc -l) / $# )) lane=0
           for sel in "$@"; do  # lane i on GPUs i*per .. i*per+per-1
             CUDA_VISIBLE_DEVICES=$(seq -s, $((lane * per)) $((lane * per + per - 1))) pytest_run "tp-lane$lane" \
               "${TP_TIMEOUT:-570}" -s --basetemp "/tmp/tp-run$lane" tests/gpu/test_tensor_parallel_8b_shaped.py \
               -k "$sel" &
             lane=$((lane + 1))
           done
           wait
           grep -ho "RESULT {.*}" "$OUT"/tp-lane*.log
           for log in /tmp/tp-run*/*/engine.log; do  # the engines that failed, for their workers' own words
             grep -q "RESULT " "$log" 2>/dev/null && continue
             [ -f "$log" ] || continue
             mkdir -p "$OUT/tp-engines" && cp "$log" "$OUT/tp-engines/$(basename "$(dirname "$log")").log"
           done ;;
  model)   E2E=${E2E:-/tmp/e2e}
           if ! python3 -c "import cublade" 2>/dev/null; then  # the converter needs no CUDA build
             CUBLADE_BUILD_EXT=0 python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site .
           fi
           log=$OUT/make-${E2E##*/}.log
           python3 benchmarks/bench_e2e.py make "$E2E" --shape "${E2E_SHAPE:-8b}" --layers "${E2E_LAYERS:-32}" \
             --presets "${E2E_PRESETS:-w4a16,fp8-dynamic,w4a16-lm-head,fp8-dynamic-lm-head}" > "$log" 2>&1
           echo "model: rc=$? $(grep -E 'in [0-9]+ s$' "$log" | tr '\n' ';')" ;;
  serve-bench)
           shift
           [ $# -gt 0 ] || { echo "serve-bench: give one lane (comma-separated configurations) per GPU" >&2; exit 2; }
           E2E=${E2E:-/tmp/e2e} gpu=0
           for lane in "$@"; do
             # timeout sends SIGTERM, on which bench_serve.py stops its server before it exits
             CUDA_VISIBLE_DEVICES=$gpu timeout "${SERVE_TIMEOUT:-570}" bash -c '
               for c in ${1//,/ }; do
                 python3 benchmarks/bench_serve.py run "$2" "$c" --json "$3/serve.jsonl" $4
               done' lane "$lane" "$E2E" "$OUT" "${SERVE_ARGS:-}" > "$OUT/serve-lane$gpu.log" 2>&1 &
             gpu=$((gpu + 1))
           done
           wait
           mkdir -p "$OUT/serve-logs" && cp "$E2E"/serve-*.log "$E2E"/serve-*.json "$OUT/serve-logs/" 2>/dev/null
           grep -ho "Using [A-Za-z0-9]*Kernel[^.]*\|cublade: .* run on [a-z0-9-]*" "$OUT"/serve-logs/serve-*.log \
             2>/dev/null | sort | uniq -c
           python3 benchmarks/bench_serve.py report "$OUT/serve.jsonl" | tee "$OUT/serve-report.md" ;;
  e2e-bench)
           shift
           [ $# -gt 0 ] || { echo "e2e-bench: give one lane (comma-separated configurations) per GPU" >&2; exit 2; }
           E2E=${E2E:-/tmp/e2e} gpu=0
           for lane in "$@"; do
             CUDA_VISIBLE_DEVICES=$gpu timeout "${E2E_TIMEOUT:-570}" python3 benchmarks/bench_e2e.py run "$E2E" \
               ${lane//,/ } ${E2E_ARGS:---batches 1,16,64} --json "$OUT/e2e.jsonl" > "$OUT/e2e-lane$gpu.log" 2>&1 &
             gpu=$((gpu + 1))
           done
           wait
           for f in "$OUT"/e2e-lane*.log; do echo "== $f"; sed -n '/^| config/,$p' "$f"; done ;;
  *) echo "unknown phase $1" >&2; exit 2 ;;
esac
