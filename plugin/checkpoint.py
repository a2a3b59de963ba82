"""Reading Hugging Face safetensors checkpoints tensor by tensor, with errors that name the file and tensor.

Tensors are read one mapping each (`read_header` + `read_tensor`), not through a mapping of the whole shard:
mapped file pages count in the process's resident set until they are unmapped, and a shard's mapping lives
as long as any tensor read from it; a tensor's own mapping goes with the tensor.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
# safetensors dtype strings of the float dtypes cublade quantizes.
FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# Every safetensors dtype string torch has a dtype for.
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
          **{k: getattr(torch, v) for k, v in (("U64", "uint64"), ("U32", "uint32"), ("U16", "uint16"),
                                               ("F8_E8M0", "float8_e8m0fnu")) if hasattr(torch, v)}}


class CheckpointError(ValueError):
    """A source checkpoint that cannot be read: the message names the file or tensor."""


SHARD_NAME = re.compile(r"(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.safetensors")


def shard_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in index order (or sorted when unindexed). Sharded files
    (`model-0000i-of-0000n.safetensors`) without their index must all be there: the tensor set is then their
    union, and a missing shard would drop tensors without a word."""
    model_dir = Path(model_dir)
    if model_dir.is_file():
        raise CheckpointError(f"{model_dir} is a file; the checkpoint is its directory ({model_dir.parent})")
    if not model_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {model_dir} does not exist")
    if not (model_dir / "config.json").is_file():
        raise CheckpointError(f"{model_dir} has no config.json: not a Hugging Face checkpoint directory")
    index = model_dir / INDEX_NAME
    if index.is_file():
        return [model_dir / n for n in _index_shards(index)]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
        hint = f" (found {', '.join(other)}: convert them to safetensors first)" if other else ""
        raise CheckpointError(f"{model_dir} holds no *.safetensors files{hint}")
    _check_unindexed_shards(model_dir, files)
    return files


def read_index(index: Path) -> dict[str, str]:
    """The index's weight_map (tensor -> shard file name)."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index} is not a valid safetensors index (weight_map is not tensor -> file name)")
    return weight_map


def _index_shards(index: Path) -> list[str]:
    names = list(dict.fromkeys(read_index(index).values()))
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise CheckpointError(f"{index} lists shard(s) that are missing: {', '.join(missing)}")
    return names


def _check_unindexed_shards(model_dir: Path, files: list[Path]) -> None:
    groups: dict[tuple[str, int], set[int]] = {}
    for f in files:
        m = SHARD_NAME.fullmatch(f.name)
        if m:
            groups.setdefault((m["stem"], int(m["n"])), set()).add(int(m["i"]))
    for (stem, n), have in sorted(groups.items()):
        missing = [f"{stem}-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1) if i not in have]
        if missing:
            raise CheckpointError(f"{model_dir} has {len(have)} of the {n} shards {stem}-*-of-{n:05d}.safetensors "
                                  f"and no {INDEX_NAME}: missing {', '.join(missing[:3])}"
                                  f"{' ...' if len(missing) > 3 else ''}; a sharded checkpoint needs every shard")


def check_index_matches_shards(model_dir: Path, headers: dict[Path, list]) -> None:
    """Every tensor the index lists is in the shard it names, and no tensor is in two shards."""
    model_dir = Path(model_dir)
    where: dict[str, Path] = {}
    for path, entries in headers.items():
        for e in entries:
            if e.name in where:
                raise CheckpointError(f"{e.name}: in both {where[e.name].name} and {path.name}; a tensor must be in "
                                      f"one shard")
            where[e.name] = path
    index = model_dir / INDEX_NAME
    if not index.is_file():
        return
    for name, shard in read_index(index).items():
        if name not in where:
            raise CheckpointError(f"{name}: {INDEX_NAME} puts it in {shard}, which does not hold it (no shard "
                                  f"does): the checkpoint is incomplete")
        if where[name].name != shard:
            raise CheckpointError(f"{name}: {INDEX_NAME} puts it in {shard}, but {where[name].name} holds it")


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
    """(shard, name, shape, safetensors dtype string) of every tensor, without loading any; the index and the
    shards' headers checked against each other first (check_index_matches_shards)."""
    headers = {path: read_header(path) for path in shard_files(model_dir)}
    check_index_matches_shards(model_dir, headers)
    for path, entries in headers.items():
        for e in entries:
            yield path, e.name, e.shape, e.dtype


def iter_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor, one at a time, in tensor_infos' order; each holds its file pages only while it lives."""
    for path in shard_files(model_dir):
        entries = read_header(path)
        with open(path, "rb") as f:
            for e in entries:
                try:
                    t = read_tensor(f, e)
                except (OSError, ValueError) as err:
                    raise CheckpointError(f"cannot read tensor {e.name} from {path.name}: truncated or "
                                          f"corrupt file ({err})") from None
                yield e.name, t
                del t  # not held while the next one is read


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: name, safetensors dtype string, shape, and its bytes' place in the
    file (absolute offsets)."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def _corrupt(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"cannot read {path.name}: truncated or corrupt safetensors file ({why})")


def read_header(path: Path) -> list[TensorEntry]:
    """The tensors of a safetensors file (8 bytes of little-endian header length, the JSON header, the data)
    by name, the order safe_open lists them, checked as safetensors checks them: known dtypes, byte ranges
    that match the shapes and cover the data without gap or overlap up to the file's end."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little") if size >= 8 else 0
            if size < 8 or n > size - 8:
                raise _corrupt(path, f"header of {n} bytes in a file of {size}")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        header = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise _corrupt(path, f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    base = 8 + n
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            ok = (dtype in DTYPES and all(type(d) is int and d >= 0 for d in shape)
                  and type(a) is int and type(b) is int and 0 <= a <= b)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise _corrupt(path, f"invalid header entry for {name}: {info}")
        if b - a != math.prod(shape) * DTYPES[dtype].itemsize:
            raise _corrupt(path, f"{name}: {b - a} bytes for {dtype} {list(shape)}")
        entries.append(TensorEntry(name, dtype, shape, base + a, base + b))
    end = base
    for e in sorted(entries, key=lambda e: (e.start, e.end)):
        if e.start != end:
            raise _corrupt(path, f"{e.name}: data at byte {e.start - base}, expected {end - base}")
        end = e.end
    if end != size:
        raise _corrupt(path, f"the header describes {end} bytes, the file has {size}")
    return sorted(entries, key=lambda e: e.name)


def read_tensor(f, e: TensorEntry) -> torch.Tensor:
    """Tensor `e` of the open file `f`, on a private (copy-on-write) mapping of its own bytes that is unmapped
    when the tensor (and every view of it) is freed. Reading a mapping costs fewer page faults than copying
    into fresh memory: this is what keeps the converter as fast as with a whole-shard mapping."""
    if e.end == e.start:
        return torch.empty(e.shape, dtype=DTYPES[e.dtype])
    start = e.start - e.start % mmap.ALLOCATIONGRANULARITY
    buf = mmap.mmap(f.fileno(), e.end - start, access=mmap.ACCESS_COPY, offset=start)
    return torch.frombuffer(buf, dtype=torch.uint8, count=e.end - e.start,
                            offset=e.start - start).view(DTYPES[e.dtype]).reshape(e.shape)


# The order in which safetensors' save_file (0.8) lays out tensors: by dtype, in this order, then by name.
# safetensors_header follows it, so the converter's shards are byte-identical to save_file's.
SAVE_ORDER = ("U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E5M2FNUZ",
              "F8_E4M3FNUZ", "F8_E8M0", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def safetensors_header(tensors: list[tuple[str, tuple[int, ...], torch.dtype]], metadata: dict | None = None,
                       ) -> tuple[bytes, dict[str, int]]:
    """The file header save_file writes for tensors of these (name, shape, dtype), and where each tensor's
    bytes go in the file (absolute offsets): write the header at 0 and each tensor at its offset."""
    head: dict = {"__metadata__": metadata} if metadata is not None else {}
    offsets, pos = {}, 0
    for name, shape, dtype in sorted(tensors, key=lambda t: (SAVE_ORDER.index(DTYPE_NAMES[t[2]]), t[0])):
        nbytes = math.prod(shape) * dtype.itemsize
        head[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        offsets[name], pos = pos, pos + nbytes
    raw = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, {k: 8 + len(raw) + v for k, v in offsets.items()}


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
