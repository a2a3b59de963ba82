#!/usr/bin/env bash
# Build a cublade wheel with the CUDA extensions cublade._C (sm_90a) and cublade._C_sm80 (sm_80 / 86 / 89 and
# compute_80 PTX) for this machine's Python, torch and CUDA, install it into a clean target directory, and check the
# installed copy: both libraries load from it, every op has its CUDA kernel, and `cublade doctor` runs. Run it on a
# machine with torch (CUDA build) and nvcc; no network needed (the installed torch and setuptools build it:
# --no-build-isolation --no-deps).
#   bash scripts/build_wheel.sh [WHEEL_DIR]        (default dist/)
# Then: pip install --no-deps WHEEL_DIR/cublade-*.whl   (docs/install.md)
# Env: PYTHON (default python3), MAX_JOBS (parallel nvcc jobs), CUDA_HOME (the toolkit).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-dist}
py=${PYTHON:-python3}
mkdir -p "$dir"
rm -f "$dir"/cublade-*.whl
echo "build_wheel: building the wheel with cublade._C for sm_90a into $dir (nvcc: several minutes)"
CUBLADE_BUILD_EXT=1 "$py" -m pip wheel --no-deps --no-build-isolation -w "$dir" .
whl=$(cd "$dir" && echo "$PWD"/cublade-*.whl)
target=$(mktemp -d)
trap 'rm -rf "$target"' EXIT
"$py" -m pip install -q --no-deps --no-index --target "$target" "$whl"
# From outside the source tree, with an empty first-use cache: only the wheel's own extension can load.
cd "$target"
export PYTHONPATH="$target" CUBLADE_EXT_CACHE="$target/.no-cache"
unset CUBLADE_DISABLE_KERNELS
"$py" - "$target" <<'PY'
import sys

target = sys.argv[1]
import torch  # noqa: F401  (cublade._C links against torch's libraries)
import cublade._C  # noqa: F401
from cublade import doctor
from cublade.ops import _dispatch

where = _dispatch.extension_path()
assert where and where.startswith(target), f"cublade._C loaded from {where}, not the wheel in {target}"
missing = sorted(set(doctor.op_names()) - _dispatch._CUDA_OPS)
assert not missing, f"ops without a CUDA kernel in the wheel: {missing}"
sm80 = _dispatch.sm80_extension_path()
assert sm80 and sm80.startswith(target), f"cublade._C_sm80 loaded from {sm80}, not the wheel in {target}"
print(f"build_wheel: cublade._C and cublade._C_sm80 from the wheel ({where}, {sm80}): "
      f"{len(_dispatch._CUDA_OPS)} ops with CUDA kernels")
PY
"$py" -m cublade.cli doctor
echo "build_wheel: OK $whl"
