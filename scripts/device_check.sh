#!/usr/bin/env bash
# One script for a GPU lease: build the extension, run the tests of tests/ops (GPU tests included), run every
# benchmarks/bench_*.py, write the logs under $OUT (build.log, tests.log, bench.md, bench.jsonl), print a
# short summary last. Exit status: 1 when the build, a test file or a bench failed.
#
#   bash scripts/device_check.sh                       (on the device: `run` with this command)
#
# With vLLM staged first (../shared/device/README.md: three calls, the last one
# `bash .device-stage/install.sh && source .device-stage/env.sh && bash scripts/device_check.sh`), the benches
# measure vLLM's ops as baselines and the vLLM comparison tests run; without it they print
# "baseline: vLLM not importable" / skip.
#
# Env (all optional):
#   OUT               where logs go (default ./out)
#   CUBLADE_TESTS     pytest targets (default tests/ops); "none" skips the tests
#   CUBLADE_PYTEST    extra pytest args (e.g. "-x --maxfail=3"), split on spaces
#   CUBLADE_PYTEST_K  a pytest -k expression (may contain spaces, e.g. "not compile")
#   CUBLADE_BENCHES   bench scripts (default benchmarks/bench_*.py); "none" skips them
#   CUBLADE_CU_ONLY   space-separated op stems to build (default: all of plugin/csrc; an op's files STEM_*.cu come
#                     along); the others are left out
#                     of a copy of the tree, so one op's broken build does not cost the lease for the rest
#   CUBLADE_SKIP_BUILD=1  reuse the build already in /tmp/site (a later call on the same warm machine)
#   CUBLADE_TEST_TIMEOUT  seconds the tests may take (default 420), so the benches and summary still run
#   MAX_JOBS          parallel nvcc jobs (default 16)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
SITE=/tmp/site
t0=$(date +%s)
summary=()
status=0
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
stamp "gpu: $(tail -1 "$OUT/gpu.txt")"

# ---- build ----------------------------------------------------------------------------------------------
src=$PWD
if [ -n "${CUBLADE_CU_ONLY:-}" ]; then
  src=/tmp/cublade-src
  rm -rf "$src" && mkdir -p "$src"
  tar -cf - --exclude=./out --exclude=./.device-stage --exclude=./build . | tar -xf - -C "$src"
  for f in "$src"/plugin/csrc/*.cu; do
    stem=$(basename "$f" .cu) keep=0
    for op in $CUBLADE_CU_ONLY; do  # an op's stem, and its other files (w4a16_gemm_wide_bf16.cu for w4a16_gemm)
      case "$stem" in "$op" | "$op"_*) keep=1;; esac
    done
    if [ $keep = 0 ]; then rm -f "$f" "$src/plugin/csrc/${stem}_torch.cpp"; stamp "build: leaving out $stem.cu"; fi
  done
fi
if [ "${CUBLADE_SKIP_BUILD:-0}" = 1 ] && ls "$SITE"/cublade/_C*.so >/dev/null 2>&1; then
  stamp "build: reusing $(ls "$SITE"/cublade/_C*.so)"
  cp -r plugin/ops/. "$SITE/cublade/ops/"  # Python edits still travel
  summary+=("build: reused")
else
stamp "build: pip install --target $SITE (CUBLADE_BUILD_EXT=1)"
if (cd "$src" && CUBLADE_BUILD_EXT=1 python3 -m pip install --no-deps --no-build-isolation --upgrade \
      --target "$SITE" . ) > "$OUT/build.log" 2>&1; then
  summary+=("build: ok ($(( $(date +%s) - t0 ))s)")
else
  grep -E "error|Error" "$OUT/build.log" | head -40
  summary+=("build: FAILED (see build.log)")
  printf '%s\n' "${summary[@]}"
  exit 1
fi
fi
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
python3 - <<'EOF' 2>&1 | tee "$OUT/import.log"
import torch
from cublade.ops import _dispatch
print("cublade._C loaded:", _dispatch.extension_loaded(), _dispatch.extension_load_error() or "")
print("ops:", sorted(n for n in dir(torch.ops.cublade) if not n.startswith("_")))
EOF

# ---- tests ----------------------------------------------------------------------------------------------
tests=${CUBLADE_TESTS:-tests/ops}
if [ "$tests" != "none" ]; then
  # one pytest process per file: a crash (SIGSEGV) in one file must not hide the other files' results
  files=$(for t in $tests; do if [ -d "$t" ]; then ls "$t"/test_*.py; else echo "$t"; fi; done)
  kexpr=()
  [ -n "${CUBLADE_PYTEST_K:-}" ] && kexpr=(-k "$CUBLADE_PYTEST_K")
  : > "$OUT/tests.log"
  deadline=$(( $(date +%s) + ${CUBLADE_TEST_TIMEOUT:-420} ))
  for f in $files; do
    left=$(( deadline - $(date +%s) ))
    if [ $left -le 5 ]; then summary+=("tests $f: NOT RUN (CUBLADE_TEST_TIMEOUT)"); continue; fi
    stamp "tests: $f"
    one=$(mktemp)
    # -p no:cacheprovider: the tree may be read-only; --durations: where the test time goes
    timeout "$left" python3 -m pytest -q -p no:cacheprovider -rs --durations=5 "$f" ${CUBLADE_PYTEST:-} \
      "${kexpr[@]}" > "$one" 2>&1
    rc=$?
    { echo "==== $f (rc=$rc)"; cat "$one"; } >> "$OUT/tests.log"
    line=$(grep -E '^[0-9]+ (passed|failed|skipped)|^=+ .*(passed|failed|skipped|error).* =+$' "$one" | tail -1)
    rm -f "$one"
    [ $rc -eq 139 ] && line="CRASHED (SIGSEGV), see tests.log"
    [ $rc -eq 124 ] && line="TIMED OUT"
    summary+=("tests $f: rc=$rc $line")
    [ $rc -ne 0 ] && status=1
  done
  grep -E "^(FAILED|ERROR)|Fatal Python" "$OUT/tests.log" | head -30
fi

# ---- benchmarks -----------------------------------------------------------------------------------------
benches=${CUBLADE_BENCHES:-$(ls benchmarks/bench_*.py 2>/dev/null)}
if [ "$benches" != "none" ]; then
  export CUBLADE_BENCH_JSON=$OUT/bench.jsonl
  : > "$OUT/bench.md"
  for b in $benches; do
    stamp "bench: $b"
    python3 "$b" >> "$OUT/bench.md" 2>&1 || { summary+=("bench $b: FAILED rc=$?"); status=1; }
  done
  summary+=("benches: $(grep -c '^| ' "$OUT/bench.md") table lines in bench.md")
fi

stamp "done"
echo "==== summary"
printf '%s\n' "${summary[@]}"
echo "==== bench rows (cublade us | baseline us | ratio | TB/s | % copy)"
grep -E '^\| (fp8|mx|w4|fp4|silu|copy)' "$OUT/bench.md" 2>/dev/null | awk -F'|' '{printf "%-34s %-22s %8s %8s %7s %6s %5s %s\n", $2, $3, $4, $6, $7, $8, $9, $10}'
grep -E "^copy ceiling" "$OUT/bench.md" 2>/dev/null | head -1
exit $status  # non-zero when a test file or a bench failed
