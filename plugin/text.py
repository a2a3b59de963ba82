"""The text every tool reads the same way: `cublade ppl` scores it, calibration observes it.

Tokens: each (non-empty) line of the text is BOS + tokenizer(line) without special tokens, all lines
concatenated; `lines` selects a slice of the lines (e.g. a held-out split). Windows: non-overlapping chunks of
`window` tokens (a last chunk of one token is dropped: it predicts nothing).
"""
from __future__ import annotations

from pathlib import Path


def parse_lines(spec: str | None) -> slice | None:
    """'A:B', 'A:', ':B' -> slice (python semantics), None -> None."""
    if spec is None:
        return None
    try:
        a, b = spec.split(":")
        return slice(int(a) if a else None, int(b) if b else None)
    except ValueError:
        raise ValueError(f"--lines must look like START:END (python slice of the text's lines), got {spec!r}") from None


def format_lines(lines: slice | None) -> str | None:
    """slice -> 'A:B' (the inverse of parse_lines), None -> None."""
    if lines is None:
        return None
    return f"{'' if lines.start is None else lines.start}:{'' if lines.stop is None else lines.stop}"


def read_lines(text_path, lines: slice | None = None) -> list[str]:
    text_path = Path(text_path)
    if text_path.is_dir():
        raise IsADirectoryError(f"{text_path} is a directory; a text file (one sample per line) is needed")
    if not text_path.is_file():
        raise FileNotFoundError(f"text file {text_path} does not exist")
    data = text_path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{text_path}: not UTF-8 text (byte 0x{data[e.start]:02x} at line {line}, byte offset "
                         f"{e.start}); save it as UTF-8") from None
    all_lines = [ln for ln in text.splitlines() if ln.strip()]
    chosen = all_lines[lines] if lines is not None else all_lines
    if not chosen:
        raise ValueError(f"{text_path}: no non-empty lines{f' in lines {format_lines(lines)}' if lines else ''}")
    return chosen


def tokenize(model_dir, text_path, lines: slice | None = None) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.model_max_length = 1 << 30  # lines are tokenized whole and windowed here, not by the tokenizer
    if tok.bos_token_id is None:
        raise ValueError(f"{model_dir}: the tokenizer has no BOS token")
    ids: list[int] = []
    for line in read_lines(text_path, lines):
        ids += [tok.bos_token_id] + tok.encode(line, add_special_tokens=False)
    return ids


def windows(ids: list[int], window: int) -> list[list[int]]:
    return [w for w in (ids[i:i + window] for i in range(0, len(ids), window)) if len(w) >= 2]
