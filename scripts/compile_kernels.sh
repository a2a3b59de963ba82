#!/usr/bin/env bash
# Compile every plugin/csrc/*.cu (kernels + launchers; each defines CUBLADE_KERNELS_ONLY and includes no torch
# header) for sm_90a, to catch a broken kernel build on a machine without a GPU (CI runs this).
# Prints ptxas' register / spill report per kernel with -v. Exits non-zero if any file fails.
#   scripts/compile_kernels.sh [-v] [FILE.cu ...]      (default: every plugin/csrc/*.cu)
# Env: NVCC (default nvcc), CUBLADE_CUDA_ARCH (default -gencode=arch=compute_90a,code=sm_90a, as setup.py).
set -uo pipefail
cd "$(dirname "$0")/.."
verbose=0
if [ "${1:-}" = "-v" ]; then verbose=1; shift; fi
NVCC=${NVCC:-nvcc}
ARCH=${CUBLADE_CUDA_ARCH:--gencode=arch=compute_90a,code=sm_90a}
if ! command -v "$NVCC" >/dev/null; then echo "compile_kernels: $NVCC not found" >&2; exit 2; fi
files=("$@")
[ ${#files[@]} -eq 0 ] && files=(plugin/csrc/*.cu)
if [ ! -e "${files[0]}" ]; then echo "compile_kernels: no .cu files in plugin/csrc" >&2; exit 2; fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
fail=0
for f in "${files[@]}"; do
  flags=(-std=c++17 -O3 --expt-relaxed-constexpr $ARCH -Iplugin/csrc -c "$f" -o "$out/$(basename "$f").o")
  [ $verbose -eq 1 ] && flags+=(-Xptxas -v)
  if log=$("$NVCC" "${flags[@]}" 2>&1); then
    echo "ok      $f"
    if [ $verbose -eq 1 ]; then echo "$log" | grep -E "Compiling entry|registers|spill" | sed 's/^/        /'; fi
  else
    echo "FAILED  $f"
    echo "$log" | sed 's/^/        /'
    fail=1
  fi
done
exit $fail
