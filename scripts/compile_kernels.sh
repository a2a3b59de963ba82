#!/usr/bin/env bash
# Compile every plugin/csrc/*.cu (kernels + launchers; each defines CUBLADE_KERNELS_ONLY and includes no torch
# header) for sm_90a and every plugin/csrc/sm80/*.cu for sm_80, sm_86, sm_89 and compute_80 PTX (cublade._C_sm80's
# targets), and (with no FILE given, or those given) syntax-check the torch wrappers (*.cpp) against torch's headers,
# to catch a broken build on a machine without a GPU (CI runs this).
# Prints ptxas' register / spill report per kernel with -v. Exits non-zero if any file fails.
#   scripts/compile_kernels.sh [-v] [FILE.cu|FILE.cpp ...]      (default: every kernel and wrapper)
# Without nvcc it says so and exits 0 (the tests need no CUDA toolkit), unless CUBLADE_NVCC_REQUIRED=1.
# Env: NVCC (default nvcc), CUBLADE_CUDA_ARCH / CUBLADE_CUDA_ARCH_SM80 (default: setup.py's HOPPER_ARCH / SM80_ARCH).
# CUBLADE_COMPILE_JOBS: files compiled at once (default: the CPU count).
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
jobs_max=${CUBLADE_COMPILE_JOBS:-$(nproc 2>/dev/null || echo 2)}

# run_jobs CMD FILE...: `CMD FILE` for each file, up to jobs_max at a time, each writing $out/<n>.log and
# $out/<n>.rc; then the results in the files' order (the logs of failures, or with -v what ptxas said).
run_jobs() {
  local cmd=$1 i=0 f; shift
  for f in "$@"; do
    ( "$cmd" "$f" > "$out/$i.log" 2>&1; echo $? > "$out/$i.rc" ) &
    i=$((i + 1))
    while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n; done
  done
  wait
  i=0
  for f in "$@"; do
    if [ "$(cat "$out/$i.rc")" = 0 ]; then
      echo "ok      $f"
      if [ $verbose -eq 1 ]; then grep -E "Compiling entry|registers|spill" "$out/$i.log" | sed 's/^/        /'; fi
    else
      echo "FAILED  $f"
      grep -E "error" "$out/$i.log" | head -20 | sed 's/^/        /'
      fail=1
    fi
    i=$((i + 1))
  done
}

compile_cu() {
  local f=$1 arch=$ARCH
  case "$f" in */sm80/*) arch=$ARCH_SM80;; esac
  local flags=(-std=c++17 -O3 --expt-relaxed-constexpr --threads 0 $arch -Iplugin/csrc -c "$f"
               -o "$out/$(basename "$f").o")
  [ $verbose -eq 1 ] && flags+=(-Xptxas -v)
  "$NVCC" "${flags[@]}"
}
kernels=()
for f in "${files[@]}"; do case "$f" in *.cu) kernels+=("$f");; esac; done  # *.cpp: check_wrappers below
[ ${#kernels[@]} -gt 0 ] && run_jobs compile_cu "${kernels[@]}"

# With every kernel compiled, each extension's kernel objects linked into one program: a launcher that calls into
# another translation unit (w4a16_gemm.cu's wide passes, compiled per dtype in w4a16_gemm_wide_*.cu) must find
# what it calls there, or the extension would fail to load on the GPU machine with an undefined symbol.
link_check() {  # NAME OBJECT...
  local name=$1; shift
  printf 'int main() { return 0; }\n' > "$out/link_main.cpp"
  if "$NVCC" "$@" "$out/link_main.cpp" -o "$out/link_$name" > "$out/link_$name.log" 2>&1; then
    echo "ok      link: $name's kernels"
  else
    echo "FAILED  link: $name's kernels"
    grep -E "undefined|error" "$out/link_$name.log" | head -10 | sed 's/^/        /'
    fail=1
  fi
}
if [ $# -eq 0 ] && [ $fail -eq 0 ]; then
  main_objs=() sm80_objs=()
  for f in plugin/csrc/*.cu; do main_objs+=("$out/$(basename "$f").o"); done
  for f in plugin/csrc/sm80/*.cu; do sm80_objs+=("$out/$(basename "$f").o"); done
  link_check _C "${main_objs[@]}"
  [ ${#sm80_objs[@]} -gt 0 ] && link_check _C_sm80 "${sm80_objs[@]}"
fi

# The torch wrappers (*_torch.cpp, bindings*.cpp) need torch's headers: a syntax check with the host compiler against
# the installed torch's (a CPU build ships them), CUDA's runtime headers from nvcc's toolkit, and empty stand-ins for
# the CUDA library headers ATen's CUDA context includes but a compiler-only toolkit may lack (cuBLAS, cuSPARSE,
# cuSOLVER: their handle and status types only; the wrappers call none of those libraries). Skipped, with the reason, without a host compiler or torch.
check_wrappers() {
  local cxx=${CXX:-g++} py=${PYTHON:-python3} inc
  command -v "$cxx" >/dev/null || { echo "compile_kernels: wrappers not checked: $cxx not found"; return 0; }
  inc=$("$py" -c 'import os, sysconfig, torch; d = os.path.join(os.path.dirname(torch.__file__), "include")
print(d, os.path.join(d, "torch", "csrc", "api", "include"), sysconfig.get_paths()["include"])' 2>/dev/null) ||
    { echo "compile_kernels: wrappers not checked: torch is not importable"; return 0; }
  local cuda_inc
  cuda_inc=$(dirname "$(dirname "$(readlink -f "$(command -v "$NVCC")")")")/include
  local stubs="$out/stubs"  # each stand-in declares the handle and status types ATen's headers name
  mkdir -p "$stubs/c10/cuda/impl"
  stub() { [ -e "$cuda_inc/$1" ] || printf '#pragma once\n%s\n' "$2" > "$stubs/$1"; }
  stub cublas.h ""
  stub cublas_v2.h "typedef struct cublasContext* cublasHandle_t; typedef int cublasStatus_t;"
  stub cublasLt.h "#include \"cublas_v2.h\"
typedef struct cublasLtContext* cublasLtHandle_t;"
  stub cusparse.h "typedef struct cusparseContext* cusparseHandle_t;"
  stub cusolver_common.h "typedef int cusolverStatus_t;"
  stub cusolverDn.h "#include \"cusolver_common.h\"
typedef struct cusolverDnContext* cusolverDnHandle_t;"
  [ -e "$cuda_inc/c10/cuda/impl/cuda_cmake_macros.h" ] || printf '#pragma once\n' > "$stubs/c10/cuda/impl/cuda_cmake_macros.h"
  local flags=(-std=c++20 -w -Iplugin/csrc)
  for d in $inc; do flags+=(-I"$d"); done
  flags+=(-I"$cuda_inc" -I/usr/local/cuda/include -I"$stubs")
  # torch's headers parsed once, as a precompiled header every wrapper starts from (15-20 s a file otherwise)
  printf '#include <ATen/ATen.h>\n#include <ATen/cuda/CUDAContext.h>\n#include <c10/cuda/CUDAGuard.h>\n#include <torch/library.h>\n' \
    > "$out/torch_headers.h"
  "$cxx" "${flags[@]}" -x c++-header "$out/torch_headers.h" -o "$out/torch_headers.h.gch" 2>/dev/null || true
  check_one() { "$cxx" "${flags[@]}" -fsyntax-only -include "$out/torch_headers.h" "$1"; }
  run_jobs check_one "$@"
}
wrappers=()
for f in "$@"; do case "$f" in *.cpp) wrappers+=("$f");; esac; done
if [ $# -eq 0 ]; then check_wrappers plugin/csrc/*.cpp plugin/csrc/sm80/*.cpp
elif [ ${#wrappers[@]} -gt 0 ]; then check_wrappers "${wrappers[@]}"; fi
exit $fail
