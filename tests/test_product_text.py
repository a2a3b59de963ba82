"""The product speaks of the product: no work-log words in its files or file names.

The repository keeps decisions with the measurement behind them (docs/decisions.md), user-visible changes
(CHANGELOG.md) and current tables (docs/performance.md). When or in which work period something was measured
belongs in the issue tracker, not here. This test fails when a product file dates its text.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Product files: the package, user docs, benchmark and tuning code, scripts, examples and the tests. Raw
# benchmark output (benchmarks/runs) is data: only its file names are checked.
PRODUCT = ["plugin", "README.md", "CHANGELOG.md", "docs", "benchmarks/*.py", "benchmarks/tuning", "scripts",
           "tests", "examples", "setup.py", ".ci"]
NAMES_ONLY = ["benchmarks/runs"]
TEXT_SUFFIXES = {".py", ".md", ".sh", ".cu", ".cuh", ".cpp", ".h", ".txt", ".toml", ".cfg", ""}
SKIP_DIRS = {"__pycache__", ".pytest_cache"}

ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
            "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth")
# Each entry: (pattern, what it is). Case-insensitive.
HISTORY_WORDS = [
    (rf"\b({ORDINALS})\s+session", "an ordinal work period"),
    (r"\b(fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth)\b", "an ordinal work period"),
    (r"\bsession[-_ ]?\d+", "a numbered work period"),
    (r"\bsession's\b", "a work period"),
    (r"\b(this|that|last|next|same|earlier|later|previous|each|one|whole) session\b", "a work period"),
    (r"\bPart [AB]\b", "a project phase"),
    (r"\bthe issue's (target|bar)\b", "a tracker reference"),
    (r"\bfirst form\b", "a superseded design"),
    (r"\bNOTES\.md\b", "the running log (removed)"),
    (r"\bRESULTS\.md\b", "the results log (removed)"),
    (r"^#+ *Latest\b", "a dated heading"),
]
_RX = [(re.compile(p, re.IGNORECASE | re.MULTILINE), why) for p, why in HISTORY_WORDS]


def _walk(entries: list[str]) -> list[Path]:
    files: list[Path] = []
    for entry in entries:
        for p in sorted(ROOT.glob(entry)):
            if p.is_file():
                files.append(p)
            elif p.is_dir():
                files += [f for f in sorted(p.rglob("*")) if f.is_file() and not SKIP_DIRS.intersection(f.parts)]
    return files


def _product_files() -> list[Path]:
    this = Path(__file__).resolve()  # it lists the words
    return [f for f in _walk(PRODUCT) if f.suffix in TEXT_SUFFIXES and f.resolve() != this]


def _hits(text: str) -> list[str]:
    out = []
    for rx, why in _RX:
        for m in rx.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append(f"line {line}: {m.group(0)!r} ({why})")
    return out


def test_the_word_list_catches_what_it_names():
    # The check must be able to fail: each kind of dated phrase is caught, and ordinary prose is not.
    dated = ["measured in the fifteenth session", "Part B appends its ops", "see NOTES.md",
             "(the issue's target)", "raw run 2026-11-22-1734-h200-session5.md", "the first form of the kernel",
             "## Latest: H200", "as this session found"]
    for text in dated:
        assert _hits(text), text
    plain = ["subprocess.Popen(cmd, start_new_session=True)", '@pytest.fixture(scope="session")',
             "built once per test session", "the first token's scale", "a fourth of the rows"]
    for text in plain:
        assert not _hits(text), text


@pytest.mark.parametrize("path", _product_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_product_file_has_no_history_words(path: Path):
    text = path.read_text(encoding="utf-8")
    hits = _hits(text) + [f"file name: {h}" for h in _hits(path.name.replace("-", " "))]
    assert not hits, f"{path.relative_to(ROOT)} dates its text:\n  " + "\n  ".join(hits[:20])


def test_raw_run_file_names_have_no_history_words():
    bad = [str(f.relative_to(ROOT)) for f in _walk(NAMES_ONLY) if _hits(f.name.replace("-", " "))]
    assert not bad, "raw runs named after work periods: " + ", ".join(bad[:20])
