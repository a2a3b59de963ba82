#!/usr/bin/env bash
# Compile every plugin/csrc/*.cu (kernels + launchers; each defines CUBLADE_KERNELS_ONLY and includes no torch
# header) for sm_90a and every plugin/csrc/sm80/*.cu for sm_80, sm_86, sm_89 and compute_80 PTX (cublade._C_sm80's
# targets), to catch a broken kernel build on a machine without a GPU (CI runs this).
# Prints ptxas' register / spill report per kernel with -v. Exits non-zero if any file fails.
#   scripts/compile_kernels.sh [-v] [FILE.cu ...]      (default: every plugin/csrc/*.cu)
# Without nvcc it says so and exits 0 (the tests need no CUDA toolkit), unless CUBLADE_NVCC_REQUIRED=1.
# Env: NVCC (default nvcc), CUBLADE_CUDA_ARCH / CUBLADE_CUDA_ARCH_SM80 (default: setup.py's HOPPER_ARCH / SM80_ARCH).
set -uo pipefail
cd "$(dirname "$0")/.."
verbose=0
if [ "${1:-}" = "-v" ]; then verbose=1; shift; fi
if [ -z "${NVCC:-}" ]; then
  NVCC=nvcc
  if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc; fi
fi
ARCH=${CUBLADE_CUDA_ARCH:--gencode=arch=compute_90a,code=sm_90a}
ARCH_SM80=${CUBLADE_CUDA_ARCH_SM80:--gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_86,code=sm_86 \
-gencode=arch=compute_89,code=sm_89 -gencode=arch=compute_80,code=compute_80}
if ! command -v "$NVCC" >/dev/null; then
  if [ -n "${CUBLADE_NVCC_REQUIRED:-}" ]; then echo "compile_kernels: $NVCC not found" >&2; exit 2; fi
  # The tests need no nvcc (the kernels run on a GPU machine); this step only catches a broken kernel build.
  echo "compile_kernels: skipped: $NVCC not found (install the CUDA toolkit or set NVCC to compile the kernels;" \
       "CUBLADE_NVCC_REQUIRED=1 makes this an error)"
  exit 0
fi
files=("$@")
[ ${#files[@]} -eq 0 ] && files=(plugin/csrc/*.cu plugin/csrc/sm80/*.cu)
if [ ! -e "${files[0]}" ]; then echo "compile_kernels: no .cu files in plugin/csrc" >&2; exit 2; fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
fail=0
for f in "${files[@]}"; do
  arch=$ARCH
  case "$f" in */sm80/*) arch=$ARCH_SM80;; esac
  flags=(-std=c++17 -O3 --expt-relaxed-constexpr $arch -Iplugin/csrc -c "$f" -o "$out/$(basename "$f").o")
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
