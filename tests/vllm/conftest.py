"""Real vLLM 0.26.0 Python layers on a CPU machine (see ../shared/notes/vllm-on-cpu.md): one gloo process group
per test process (`vllm_dist`, tests/conftest.py), vLLM's config context per test,
the platform left as UnspecifiedPlatform (a CpuPlatform breaks layer construction on the CUDA wheel)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm.model_executor",
                    reason="vLLM is not installed (pip install vllm==0.26.0 --no-deps, see README)")

from vllm_model import cpu_vllm_config  # noqa: E402  (after the importorskip)


@pytest.fixture
def vllm_ctx(vllm_dist):
    """vLLM's current config, the layer dtype bf16 (vLLM builds layers under the model dtype), restored after."""
    from vllm.config import set_current_vllm_config

    old = torch.get_default_dtype()
    with set_current_vllm_config(cpu_vllm_config()):
        torch.set_default_dtype(torch.bfloat16)
        try:
            yield
        finally:
            torch.set_default_dtype(old)
