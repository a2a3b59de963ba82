"""Reading Hugging Face safetensors checkpoints tensor by tensor, with errors that name the file and tensor."""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
# safetensors dtype strings of the float dtypes cublade quantizes.
FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class CheckpointError(ValueError):
    """A source checkpoint that cannot be read: the message names the file or tensor."""


def shard_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in index order (or sorted when unindexed)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {model_dir} does not exist")
    if not (model_dir / "config.json").is_file():
        raise CheckpointError(f"{model_dir} has no config.json: not a Hugging Face checkpoint directory")
    index = model_dir / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from None
        names = list(dict.fromkeys(weight_map.values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shard(s) that are missing: {', '.join(missing)}")
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
        hint = f" (found {', '.join(other)}: convert them to safetensors first)" if other else ""
        raise CheckpointError(f"{model_dir} holds no *.safetensors files{hint}")
    return files


@contextmanager
def open_shard(path: Path):
    """safe_open with a clear error for truncated or corrupt files."""
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises its own SafetensorError for bad headers / short files
        if type(e).__name__ == "SafetensorError" or isinstance(e, (OSError, RuntimeError)):
            raise CheckpointError(f"cannot read {path.name}: truncated or corrupt safetensors file ({e})") from None
        raise


def tensor_infos(model_dir: Path) -> Iterator[tuple[Path, str, tuple[int, ...], str]]:
    """(shard, name, shape, safetensors dtype string) of every tensor, without loading any."""
    for path in shard_files(model_dir):
        with open_shard(path) as f:
            for name in f.keys():
                sl = f.get_slice(name)
                yield path, name, tuple(sl.get_shape()), sl.get_dtype()


def iter_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor, one at a time (one shard memory-mapped at a time)."""
    for path in shard_files(model_dir):
        with open_shard(path) as f:
            for name in f.keys():
                try:
                    t = f.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(f"cannot read tensor {name} from {path.name}: truncated or "
                                          f"corrupt file ({e})") from None
                yield name, t


def load_all(model_dir: Path) -> dict[str, torch.Tensor]:
    return dict(iter_tensors(model_dir))


def check_tensors(module: str, specs: dict[str, tuple[tuple[int, ...], torch.dtype | None]],
                  tensors: dict[str, torch.Tensor], needs: str = "", context: str = "") -> None:
    """`tensors` are exactly what `specs` ({suffix: (shape, dtype or None for any)}) asks for, else a ValueError
    naming `module.suffix`. `needs` says who asks (e.g. "scheme fp8"), `context` where the shapes come from."""
    for suffix, (shape, dtype) in specs.items():
        t = tensors.get(suffix)
        if t is None:
            why = f" ({needs} needs {', '.join(specs)})" if needs else ""
            raise ValueError(f"{module}.{suffix}: missing from the checkpoint{why}")
        if tuple(t.shape) != tuple(shape) or (dtype is not None and t.dtype != dtype):
            want = f"{list(shape)}" + (f" {dtype}" if dtype is not None else "")
            raise ValueError(f"{module}.{suffix}: expected shape {want}, found {list(t.shape)} {t.dtype}"
                             + (f" ({context})" if context else ""))
    extra = sorted(set(tensors) - set(specs))
    if extra:
        raise ValueError(f"{module}.{extra[0]}: unexpected tensor" + (f" for {needs}" if needs else ""))
