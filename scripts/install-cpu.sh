#!/usr/bin/env bash
# Install cublade on a CPU machine (no GPU) with everything the demo and the tests need, from nothing but Python
# and pip:
#   torch 2.13.0, CPU build: from the wheels pip already sees (a local wheel directory or mirror), else from
#     PyTorch's CPU index ($CUBLADE_TORCH_INDEX, default https://download.pytorch.org/whl/cpu; point it at a
#     mirror if needed). A plain `pip install torch` on Linux would fetch the CUDA build: gigabytes of nvidia-*.
#   vLLM 0.26.0's Python code, --no-deps: its CUDA torch pin cannot install on a CPU machine, yet its layers, MoE
#     and model loader import and run there, which the tests use;
#   the pinned packages in requirements/cpu.txt (what vLLM's import needs on CPU, and the test tools);
#   cublade itself, editable and pure Python (no CUDA extension without nvcc and a CUDA torch).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
TORCH=2.13.0
TORCH_INDEX=${CUBLADE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
pip_install() { "$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore "$@"; }

have_cpu_torch() {
  "$PY" -c "import torch, sys; sys.exit(not (torch.__version__.split('+')[0] == '$TORCH' and torch.version.cuda is None))" \
    2>/dev/null
}
if have_cpu_torch; then
  echo "torch $TORCH (CPU) already installed"
elif pip_install "torch==$TORCH+cpu" > "$log" 2>&1; then
  echo "torch $TORCH+cpu installed from the configured package sources"
else
  echo "torch $TORCH+cpu installing from $TORCH_INDEX (set CUBLADE_TORCH_INDEX for a mirror)"
  pip_install --index-url "$TORCH_INDEX" "torch==$TORCH+cpu"
fi

pip_install --no-deps vllm==0.26.0
# vLLM's metadata asks for a CUDA torch and packages the CPU tests never import; pip then prints a long
# "dependency resolver" complaint after the next install. Expected here: keep it out of the way, say it once.
if ! pip_install -c requirements/constraints-cpu.txt -r requirements/cpu.txt > "$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
if grep -q "dependency resolver" "$log"; then
  grep -v -e "dependency resolver" -e "^vllm " -e "^\s*$" "$log" >&2 || true
  echo "note: pip reports vLLM 0.26.0's CUDA requirements as unmet: expected, vLLM is installed --no-deps on CPU"
else
  cat "$log"
fi
CUBLADE_BUILD_EXT=0 pip_install --no-deps --no-build-isolation -e .
"$PY" -c "import torch, vllm, cublade; print(f'cublade {cublade.__version__}: torch {torch.__version__}, vllm {vllm.__version__}')" 2>&1 | tail -1
