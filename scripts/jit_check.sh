#!/usr/bin/env bash
# On a Hopper GPU machine: install cublade without its extension into an empty directory and check the first-use
# build (cublade.extension): one process builds into a fresh cache and says so in one line, later processes load
# the cached library, several processes started together build it once, the ops then run their CUDA kernels, and
# `cublade doctor` reports the cached build. Prints the build's wall time (BUILD_MINUTES in plugin/extension.py
# says it).
#   bash scripts/jit_check.sh            Env: PYTHON (default python3), MAX_JOBS
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
CUBLADE_BUILD_EXT=0 "$py" -m pip install -q --no-deps --no-build-isolation --target "$work/pkg" .
export PYTHONPATH="$work/pkg"
unset CUBLADE_DISABLE_KERNELS
cd "$work"
probe='from cublade.ops import _dispatch; print("loaded from", _dispatch.extension_path())'
"$py" -c 'import importlib.util as u; assert u.find_spec("cublade._C") is None, "the install has cublade._C"'
t0=$(date +%s)
CUBLADE_EXT_CACHE="$work/cache" "$py" -c "$probe"
echo "jit_check: first use built in $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
CUBLADE_EXT_CACHE="$work/cache" "$py" -c "$probe" 2>&1 | tee "$work/second.log"
! grep -q "building" "$work/second.log" || { echo "jit_check: FAILED: the second process built again"; exit 1; }
echo "jit_check: second process loaded the cache in $(( $(date +%s) - t0 )) s"
for i in 1 2 3 4; do CUBLADE_EXT_CACHE="$work/cache2" "$py" -c "$probe" > "$work/p$i.log" 2>&1 & done
wait
n=$(cat "$work"/p*.log | grep -c "cublade: building" || true)
[ "$n" = 1 ] || { echo "jit_check: FAILED: 4 processes started $n builds"; cat "$work"/p*.log; exit 1; }
echo "jit_check: 4 processes together: 1 build"
CUBLADE_EXT_CACHE="$work/cache" "$py" - <<'PY'
import torch
from cublade import doctor
from cublade.ops import _dispatch, fp8_quant_per_token, fp8_quant_per_token_ref

missing = sorted(set(doctor.op_names()) - _dispatch._CUDA_OPS)
assert not missing, f"ops without a CUDA kernel in the cached build: {missing}"
x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
assert _dispatch.use_kernel(x, "fp8_quant_per_token")
q, s = fp8_quant_per_token(x)
qr, sr = fp8_quant_per_token_ref(x)
assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr), "kernel != reference"
print("jit_check: every op has its CUDA kernel; fp8_quant_per_token matches its reference bit for bit")
PY
CUBLADE_EXT_CACHE="$work/cache" "$py" -m cublade.cli doctor
echo "jit_check: OK"
