"""Train / eval disjointness: no evaluation prompt may appear in a training pool.

Two checks on normalised text (Unicode NFKC, case-folded, punctuation and whitespace
runs collapsed to one space):

* exact: the hash of a whole normalised turn;
* contained: a training turn that shares a run of `ngram` consecutive words with an
  evaluation turn (an eval question pasted inside a longer training prompt). Turns with
  fewer than `ngram` words are covered by the exact check.

`check_disjoint` raises `OverlapError` naming every clash; `remove_overlaps` drops the
clashing training prompts (what the data step does before regenerating).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import unicodedata
from typing import Iterable, Sequence

from dblast_jax.data import sources
from dblast_jax.data.sources import Prompt

__all__ = ["normalize", "text_hash", "Overlap", "OverlapError", "OverlapIndex",
           "find_overlaps", "check_disjoint", "remove_overlaps", "dedup_prompts"]

_NON_WORD = re.compile(r"[\W_]+", re.UNICODE)
DEFAULT_NGRAM = 13


def normalize(text: str) -> str:
    return _NON_WORD.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def text_hash(text: str) -> str:
    """sha1 of the normalised text (stable across runs and machines)."""
    return hashlib.sha1(normalize(text).encode("utf-8")).hexdigest()


def _ngrams(words: Sequence[str], n: int) -> Iterable[int]:
    for i in range(len(words) - n + 1):
        yield hash(" ".join(words[i:i + n]))


@dataclasses.dataclass(frozen=True)
class Overlap:
    train: str  # "source/id"
    eval: str
    kind: str  # "exact" or "ngram"
    text: str  # the start of the clashing eval turn


class OverlapError(ValueError):
    def __init__(self, overlaps: Sequence[Overlap]):
        self.overlaps = list(overlaps)
        lines = [f"  {o.kind}: train {o.train} == eval {o.eval}: {o.text!r}"
                 for o in self.overlaps[:20]]
        more = f"\n  ... and {len(self.overlaps) - 20} more" if len(self.overlaps) > 20 else ""
        super().__init__(f"{len(self.overlaps)} training prompt(s) overlap the evaluation "
                         "sets (drop them with remove_overlaps):\n" + "\n".join(lines) + more)


class OverlapIndex:
    """The evaluation side of `find_overlaps`, built once: checking many small batches of
    training prompts against the same large set (self-written prompts, batch by batch)
    would otherwise re-index it every time."""

    def __init__(self, evals: Sequence[Prompt], ngram: int = DEFAULT_NGRAM):
        self.ngram = ngram
        self.exact: dict[str, tuple[str, str]] = {}
        self.grams: dict[int, tuple[str, str]] = {}
        for p in evals:
            for turn in p.turns:
                norm = normalize(turn)
                key = (f"{p.source}/{p.id}", turn[:80])
                self.exact.setdefault(hashlib.sha1(norm.encode()).hexdigest(), key)
                if ngram > 0:
                    for g in _ngrams(norm.split(), ngram):
                        self.grams.setdefault(g, key)

    def find(self, train: Sequence[Prompt]) -> list[Overlap]:
        """Every training prompt that shares a turn or an n-gram with the indexed set."""
        found: list[Overlap] = []
        for p in train:
            name = f"{p.source}/{p.id}"
            for turn in p.turns:
                norm = normalize(turn)
                hit = self.exact.get(hashlib.sha1(norm.encode()).hexdigest())
                if hit:
                    found.append(Overlap(name, hit[0], "exact", hit[1]))
                    break
                if self.ngram > 0:
                    g_hit = next((self.grams[g] for g in _ngrams(norm.split(), self.ngram)
                                  if g in self.grams), None)
                    if g_hit:
                        found.append(Overlap(name, g_hit[0], "ngram", g_hit[1]))
                        break
        return found


def find_overlaps(train: Sequence[Prompt], evals: Sequence[Prompt],
                  ngram: int = DEFAULT_NGRAM) -> list[Overlap]:
    """Every (training prompt, evaluation prompt) pair that shares a turn or an n-gram."""
    return OverlapIndex(evals, ngram).find(train)


def check_disjoint(train: Sequence[Prompt], evals: Sequence[Prompt],
                   ngram: int = DEFAULT_NGRAM) -> None:
    """Raise OverlapError if any training prompt overlaps an evaluation prompt."""
    overlaps = find_overlaps(train, evals, ngram)
    if overlaps:
        raise OverlapError(overlaps)


def remove_overlaps(train: Sequence[Prompt], evals: Sequence[Prompt],
                    ngram: int = DEFAULT_NGRAM) -> tuple[list[Prompt], list[Overlap]]:
    """(training prompts without any overlap, the overlaps dropped)."""
    overlaps = find_overlaps(train, evals, ngram)
    bad = {o.train for o in overlaps}
    return [p for p in train if f"{p.source}/{p.id}" not in bad], overlaps


def dedup_prompts(prompts: Sequence[Prompt]) -> list[Prompt]:
    """Keep the first of prompts whose normalised turns are identical (pools repeat some)."""
    seen, out = set(), []
    for p in prompts:
        key = tuple(text_hash(t) for t in p.turns)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def training_prompts(pools: Sequence[str] | None = None, eval_sets: Sequence[str] | None = None,
                     ngram: int = DEFAULT_NGRAM) -> tuple[list[Prompt], list[Overlap]]:
    """The training pools, deduplicated, without any prompt that overlaps an eval set.

    Returns (prompts, overlaps dropped); the result is re-checked with `check_disjoint`.
    """
    train = [p for n in (pools or sources.TRAIN_POOLS) for p in sources.load_prompts(n)]
    evals = [p for n in (eval_sets or sources.EVAL_SETS) for p in sources.load_prompts(n)]
    kept, dropped = remove_overlaps(dedup_prompts(train), evals, ngram)
    check_disjoint(kept, evals, ngram)
    return kept, dropped
