#!/usr/bin/env bash
# End-to-end checks on the GPU machine, after vLLM is staged (../shared/device/README.md) and
# `source .device-stage/env.sh`. One phase per device call (each stays well inside the 10-minute limit):
#   kernels  build cublade into /tmp/site, GPU op tests, every benchmark (scripts/device_check.sh)
#   serve    vllm serve each preset: completions, greedy vs unquantized (one call took 560 s: too long)
#   serve2   compiled vs eager, FP8 KV with cublade's cache write, compressed-tensors interop
#   ppl      cublade ppl --backend vllm vs the reference backend; the MoE fixture served and scored
#   tuning   the stand-alone sweeps of benchmarks/tuning (no vLLM needed): quant kernels, W4A16 small-M GEMV,
#            W4A16 occupancy (tiles per warp x splits x ring stages), W4A16 pipeline (copies alone vs a plain read)
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
case "${1:?phase: kernels | serve | serve2 | ppl | tuning}" in
  kernels) CUBLADE_TEST_TIMEOUT=${CUBLADE_TEST_TIMEOUT:-300} bash scripts/device_check.sh ;;
  serve)   pytest_run serve 560 tests/gpu/test_serve.py -k "answers or baseline or greedy" ;;
  serve2)  pytest_run serve2 560 tests/gpu/test_serve.py -k "compiled or kv_cache or compressed" ;;
  ppl)     pytest_run ppl 330 tests/gpu/test_serve.py -k "ppl"
           pytest_run moe 230 tests/moe/test_moe_gpu.py ;;
  tuning)  for h in quant_sweep w4a16_gemv_sweep w4a16_occupancy w4a16_pipeline; do
             nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I plugin/csrc "benchmarks/tuning/$h.cu" \
               -o "/tmp/$h" > "$OUT/$h.build.log" 2>&1 || { echo "$h: build FAILED"; continue; }
             timeout 240 "/tmp/$h" > "$OUT/$h.txt" 2>&1
             echo "$h: rc=$?"; grep -E "^BEST|fastest|FAIL" "$OUT/$h.txt" | head -20
           done ;;
  *) echo "unknown phase $1" >&2; exit 2 ;;
esac
