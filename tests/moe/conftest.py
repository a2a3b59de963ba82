"""MoE test fixtures: the Mixtral checkpoints examples/make_moe_fixture.py builds from the bundled dense model
(built once per test run), and a vLLM config on CPU (real vLLM 0.26 Python code, gloo, one rank)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def moe_fixture(tmp_path_factory, fixture_builder, padded_model_dir, valid_text):
    """moe_fixture(variant='exact', layout='mixtral') -> directory of that MoE checkpoint (cached)."""
    cache: dict = {}

    def get(variant: str = "exact", layout: str = "mixtral") -> Path:
        if (variant, layout) not in cache:
            out = tmp_path_factory.mktemp("moe") / f"{variant}-{layout}"
            cache[(variant, layout)] = fixture_builder.build(padded_model_dir, out, variant=variant, layout=layout,
                                                             text=valid_text, calib_lines=60)
        return cache[(variant, layout)]

    return get


def _text_windows(tokenizer_dir: Path, text: Path, n_lines: int, window: int = 512) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.model_max_length = 1 << 30
    ids: list[int] = []
    lines = [ln for ln in text.read_text(encoding="utf-8").splitlines() if ln.strip()][:n_lines]
    for ln in lines:
        ids += [tok.bos_token_id] + tok.encode(ln, add_special_tokens=False)
    n = len(ids) // window
    return torch.tensor(ids[: n * window]).view(n, window)


@pytest.fixture(scope="session")
def text_windows():
    """text_windows(tokenizer_dir, text, n_lines, window=512) -> [n, window] token ids: each line BOS + tokens,
    concatenated, cut into whole windows (the ppl harness's rule, without the short tail)."""
    return _text_windows


@pytest.fixture(scope="module")
def vllm_cpu(vllm_dist):
    """A VllmConfig on CPU, vLLM's distributed state set up (`vllm_dist`, tests/conftest.py); use it as
    `with set_current_vllm_config(cfg):` around layer construction."""
    from vllm_model import cpu_vllm_config

    return cpu_vllm_config()
