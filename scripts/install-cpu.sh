#!/usr/bin/env bash
# Install cublade on a CPU machine (no GPU) with everything the demo and the tests need:
#   torch 2.13.0 (CPU build), vLLM 0.26.0's Python code (--no-deps: its CUDA torch pin cannot install on a CPU
#   machine; the real vLLM layers, MoE and model loader still import and run on CPU), the packages vLLM's
#   import needs, and cublade itself (editable, pure Python: no CUDA extension without nvcc + CUDA torch).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore "$@"; }
pip_install torch==2.13.0
pip_install --no-deps vllm==0.26.0
pip_install -c requirements/constraints-cpu.txt -r requirements/cpu.txt
CUBLADE_BUILD_EXT=0 pip_install --no-deps --no-build-isolation -e .
"$PY" -c "import torch, vllm, cublade; print(f'cublade {cublade.__version__}: torch {torch.__version__}, vllm {vllm.__version__}')" 2>&1 | tail -1
