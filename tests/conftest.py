"""Shared fixtures: the bundled model and text (fixtures/, copied from ../shared), and converted checkpoints
of the padded model, converted once per test run and cached per (preset, options)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                   reason="needs a CUDA GPU (run on the H200 device)")


@pytest.fixture(scope="session")
def padded_model_dir() -> Path:
    return FIXTURES / "models" / "stories260K-padded-hf"


@pytest.fixture(scope="session")
def original_model_dir() -> Path:
    return FIXTURES / "models" / "stories260K-hf"


@pytest.fixture(scope="session")
def valid_text() -> Path:
    return FIXTURES / "data" / "tinystories_valid_head30k.txt"


def load_script(path: Path):
    """A script that is not part of the package (examples/, benchmarks/) as a module named after its file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def script():
    """script(path) -> that file as a module (load_script). A fixture, because a test module cannot import from
    this conftest by name once tests/moe's conftest, also named `conftest`, has been imported."""
    return load_script


@pytest.fixture(scope="session")
def fixture_builder():
    """examples/make_moe_fixture.py as a module."""
    return load_script(REPO / "examples" / "make_moe_fixture.py")


@pytest.fixture(scope="session")
def converted(tmp_path_factory, padded_model_dir):
    """converted(preset, src=None, lm_head=False, **overrides) -> directory of `src` (the padded model by default)
    converted with that preset (and its lm_head quantized too with lm_head=True: `--quantize-lm-head`)."""
    from cublade.config import preset as make_preset
    from cublade.convert import convert

    cache: dict = {}

    def get(preset: str, src: Path | None = None, lm_head: bool = False, **overrides) -> Path:
        src = src or padded_model_dir
        convert_kwargs = {k: overrides.pop(k) for k in ("calib_text", "calib_tokens", "calib_lines")
                          if k in overrides}
        key = (preset, str(src), lm_head, tuple(sorted(overrides.items())),
               tuple(sorted(map(str, convert_kwargs.items()))))
        if key not in cache:
            out = tmp_path_factory.mktemp("ckpt") / preset
            policy = make_preset(preset, **overrides)
            convert(src, out, policy.with_lm_head() if lm_head else policy, **convert_kwargs)
            cache[key] = out
        return cache[key]

    return get


@pytest.fixture(scope="session")
def untied_model_dir(tmp_path_factory, padded_model_dir) -> Path:
    """The padded bundled model with its output projection as a matrix of its own (a copy of the tied embeddings,
    tie_word_embeddings false), so that lm_head can be quantized."""
    import json

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("untied") / "model"
    shutil.copytree(padded_model_dir, out)
    tensors = load_file(str(out / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}, indent=1))
    return out


@pytest.fixture
def cpu_attention(monkeypatch):
    """get_model on UnspecifiedPlatform needs an attention backend class to build Attention layers; no attention
    kernel runs in the CPU tests (test-side patch, see ../shared/notes/vllm-on-cpu.md, and tests/vllm_model.py)."""
    from vllm.platforms.interface import UnspecifiedPlatform

    monkeypatch.setattr(UnspecifiedPlatform, "get_attn_backend_cls", classmethod(
        lambda cls, *a, **k: "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend"), raising=False)


@pytest.fixture(scope="session")
def vllm_dist(tmp_path_factory):
    """vLLM's distributed state for this test process, set up once (it can be set up once per process):
    tensor-parallel size 1 over gloo. Registers cublade with vLLM."""
    pytest.importorskip("vllm.model_executor",
                        reason="vLLM is not installed (pip install vllm==0.26.0 --no-deps, see README)")
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    import cublade.vllm
    from vllm_model import cpu_vllm_config, dist_init_method

    with set_current_vllm_config(cpu_vllm_config()):
        init_distributed_environment(1, 0, dist_init_method(tmp_path_factory.mktemp("dist")), 0, "gloo")
        initialize_model_parallel(1, 1)
    cublade.vllm.register()
