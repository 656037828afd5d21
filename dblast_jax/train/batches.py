"""From token sequences to training batches: records, sources, batchers.

A *record* is one training sequence:
    tokens     [L] int   the text (prompt + the target's own response)
    loss_mask  [L] bool  True on response tokens (where blocks may be anchored / scored)
    logp       [L] f32   optional: log p_target(tokens[t] | tokens[<t]) at the verify
                         temperature T_v (logp[0] is unused); the AL terms' input, stored
                         by the data step so that the trainer need not recompute it.
A plain list of ints is a record whose every token is "response".

Batches are fixed-shape numpy dicts (tokens [B, T], loss_mask [B, T], lengths [B], and
logp [B, T] when every record has it), right-padded with token 0 and mask False; longer
records are truncated to T. Anchors are sampled later, on device, from the step RNG
(`objective.sample_anchors`): an anchor a is eligible when loss_mask[a] (a response
token — at inference the anchor is always a token the target produced) and a + b <=
length (its whole block lies inside the sequence). Block slot i = 1..b-1 is labelled tokens[a + i]
and scored where loss_mask[a + i].

Determinism and multi-host: a `Batcher` reads a random-access source in a seeded
per-epoch order. Global batch k holds items k*B .. k*B + B - 1 of that order; each
process materialises only its rows (`rows`), so every process count yields the same
global batches, and the whole iterator state is one integer.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np

from dblast_jax.data.corpus import is_corpus_folder, temperature_key
# moved to objective; re-exported for existing imports
from dblast_jax.train.objective import (  # noqa: F401
    block_labels, eligible_anchor_mask, gather_block, sample_anchors)

Record = dict[str, Any]

__all__ = [
    "as_record", "load_jsonl", "ListSource", "SyntheticMultiModal", "Batcher",
    "IteratorBatcher", "collate", "record_is_usable", "eligible_anchor_mask",
    "sample_anchors", "gather_block", "block_labels", "make_source", "token_id_range",
    "check_data_for_target",
]


# ---- records ------------------------------------------------------------------------------

def _pick_logp(value, where: str, verify_temperature: Optional[float]):
    """logp may be a list (taken as already at T_v) or {temperature: list}."""
    if isinstance(value, Mapping):
        if verify_temperature is None:
            return None
        want = float(verify_temperature)
        for k, v in value.items():
            try:
                if math.isclose(float(k), want, rel_tol=0, abs_tol=1e-6):
                    return v
            except ValueError:
                continue
        raise ValueError(f"{where}: stored logp has temperatures {sorted(value)} but the "
                         f"verify temperature is {temperature_key(want)}; regenerate the "
                         "corpus with it or set logp_source=target")
    return value


def as_record(item: Any, where: str = "record",
              verify_temperature: Optional[float] = None) -> Record:
    """Normalise a list of ids or a dict (tokens / input_ids, loss_mask / response_mask,
    logp) into a record of numpy arrays; raise naming `where` if it is malformed."""
    if isinstance(item, Mapping):
        if "tokens" in item:
            tokens = item["tokens"]
        elif "input_ids" in item:
            tokens = item["input_ids"]
        else:
            raise ValueError(f"{where}: a record needs 'tokens' (or 'input_ids'); it has keys "
                             f"{sorted(item)}")
        mask = item.get("loss_mask", item.get("response_mask"))
        logp = _pick_logp(item["logp"], where, verify_temperature) if "logp" in item else None
    else:
        tokens, mask, logp = item, None, None
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not (tokens.size == 0 or np.issubdtype(tokens.dtype, np.integer)):
        raise ValueError(f"{where}: tokens must be a flat list of integer ids, got "
                         f"{tokens.dtype} array of shape {tokens.shape}")
    tokens = tokens.astype(np.int32)
    n = tokens.shape[0]
    mask = np.ones((n,), bool) if mask is None else np.asarray(mask).astype(bool)
    if mask.shape != (n,):
        raise ValueError(f"{where}: loss_mask has shape {mask.shape}, tokens have ({n},)")
    rec: Record = {"tokens": tokens, "loss_mask": mask}
    if logp is not None:
        logp = np.asarray(logp, np.float32)
        if logp.shape != (n,):
            raise ValueError(f"{where}: logp has shape {logp.shape}, tokens have ({n},)")
        rec["logp"] = logp
    return rec


def record_is_usable(rec: Record, seq_len: int, block_size: int) -> bool:
    """True when the record (truncated to seq_len) has at least one eligible anchor."""
    n = min(len(rec["tokens"]), seq_len)
    last = n - block_size  # anchors 0..last fit a whole block
    return last >= 0 and bool(np.any(rec["loss_mask"][:last + 1]))


def load_jsonl(path: str, verify_temperature: Optional[float] = None) -> list[Record]:
    """Records from a .jsonl file: one JSON list of ids or one record object per line."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"corpus {path!r} does not exist")
    records = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            records.append(as_record(item, f"{path}:{lineno}", verify_temperature))
    if not records:
        raise ValueError(f"corpus {path!r} is empty: no records")
    return records


# ---- sources ------------------------------------------------------------------------------

class ListSource:
    """Random access over in-memory records."""

    def __init__(self, records: Sequence[Any], name: str = "corpus",
                 verify_temperature: Optional[float] = None):
        self.name = name
        self.records = [as_record(r, f"{name}[{i}]", verify_temperature)
                        for i, r in enumerate(records)]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> Record:
        return self.records[i]

    def usable_indices(self, seq_len: int, block_size: int) -> np.ndarray:
        if not self.records:
            raise ValueError(f"corpus {self.name!r} is empty: no records")
        ok = np.array([record_is_usable(r, seq_len, block_size) for r in self.records])
        if not ok.any():
            lens = [len(r["tokens"]) for r in self.records]
            resp = [int(r["loss_mask"].sum()) for r in self.records]
            raise ValueError(
                f"corpus {self.name!r} is too short: none of its {len(self.records)} records "
                f"has a response token followed by a full block of {block_size} tokens within "
                f"seq_len {seq_len} (longest record {max(lens)} tokens, most response tokens "
                f"{max(resp)})")
        return np.nonzero(ok)[0]


class SyntheticMultiModal:
    """A multi-modal language with exactly known probabilities.

    Record i: a random prompt (tokens from a prompt vocabulary, loss_mask False), then a
    response of phrases. Each phrase is one of `num_phrases` fixed random phrases of
    `phrase_len` distinct tokens, chosen independently with probabilities
    softmax(logits / temperature), logits falling linearly from 0 to -logit_scale — a
    hidden choice made at every phrase boundary that decides the next `phrase_len`
    tokens jointly. Inside a phrase the next token is certain. So a block that crosses a
    boundary has several coherent continuations, and per-position marginals mix them:
    the case a latent-mixture drafter is for.

    `logp` holds the exact log-probability of each response token under the process at
    `temperature` (log pi_z at a phrase start, 0 inside a phrase), which is what the
    target's log-probs at T_v would be for a target that had learned this language.
    The phrases come from `language_seed`, the records from (seed, i): two sources with
    the same language and different seeds are a train / held-out pair.
    """

    def __init__(self, vocab_size: int, *, block_size: int, seq_len: int,
                 num_phrases: int = 4, phrase_len: int = 3, temperature: float = 1.0,
                 logit_scale: float = 3.0, min_prompt: int = 2, max_prompt: int = 8,
                 seed: int = 0, language_seed: int = 0, size: int = 2**31 - 1):
        if num_phrases < 1 or phrase_len < 1:
            raise ValueError("num_phrases and phrase_len must be >= 1")
        n_phrase_tokens = num_phrases * phrase_len
        if vocab_size < n_phrase_tokens + 2:
            raise ValueError(f"vocab_size {vocab_size} is too small for {num_phrases} phrases "
                             f"of {phrase_len} distinct tokens plus a prompt vocabulary")
        if max_prompt + block_size > seq_len:
            raise ValueError(f"seq_len {seq_len} cannot hold a {max_prompt}-token prompt and "
                             f"a block of {block_size}")
        self.name = "synthetic"
        self.vocab_size, self.block_size, self.seq_len = vocab_size, block_size, seq_len
        self.num_phrases, self.phrase_len = num_phrases, phrase_len
        self.temperature, self.min_prompt, self.max_prompt = temperature, min_prompt, max_prompt
        self.seed, self.size = seed, size
        gen = np.random.default_rng([language_seed, 2**20])
        ids = gen.permutation(np.arange(1, vocab_size))  # 0 is padding
        self.phrases = ids[:n_phrase_tokens].reshape(num_phrases, phrase_len).astype(np.int32)
        self.prompt_vocab = ids[n_phrase_tokens:].astype(np.int32)
        self.logits = -logit_scale * np.arange(num_phrases) / max(num_phrases - 1, 1)
        z = self.logits / temperature
        self.log_probs = (z - np.logaddexp.reduce(z)).astype(np.float64)
        self.min_phrases = max(1, math.ceil(block_size / phrase_len))
        self.max_phrases = max(self.min_phrases, (seq_len - max_prompt) // phrase_len)

    def __len__(self) -> int:
        return self.size

    @property
    def phrase_probs(self) -> np.ndarray:
        return np.exp(self.log_probs)

    def __getitem__(self, i: int) -> Record:
        gen = np.random.default_rng([self.seed, int(i)])
        n_prompt = int(gen.integers(self.min_prompt, self.max_prompt + 1))
        n_phr = int(gen.integers(self.min_phrases, self.max_phrases + 1))
        prompt = gen.choice(self.prompt_vocab, n_prompt)
        z = gen.choice(self.num_phrases, n_phr, p=self.phrase_probs)
        resp = self.phrases[z].reshape(-1)
        logp_resp = np.zeros((n_phr, self.phrase_len), np.float32)
        logp_resp[:, 0] = self.log_probs[z]
        tokens = np.concatenate([prompt, resp]).astype(np.int32)
        mask = np.concatenate([np.zeros(n_prompt, bool), np.ones(resp.size, bool)])
        logp = np.concatenate([np.full(n_prompt, -math.log(len(self.prompt_vocab)), np.float32),
                               logp_resp.reshape(-1)])
        return {"tokens": tokens, "loss_mask": mask, "logp": logp}

    def usable_indices(self, seq_len: int, block_size: int) -> None:
        """None: every index is usable and records are already i.i.d. (no shuffling).
        Every record has a response of >= block_size tokens right after a prompt of at
        most max_prompt tokens, and max_prompt + block_size <= seq_len."""
        if seq_len < self.max_prompt + block_size or block_size > self.block_size:
            raise ValueError(f"seq_len {seq_len} / block_size {block_size} do not fit the "
                             f"synthetic source (built for {self.seq_len} / {self.block_size})")
        return None


def make_source(data: str, *, vocab_size: int, block_size: int, seq_len: int,
                verify_temperature: float, seed: int = 0, num_phrases: int = 4,
                phrase_len: int = 3, logit_scale: float = 3.0, corpus_shards: int = 0,
                corpus_first_shard: int = 0):
    """'synthetic', a .jsonl path, a corpus folder (shards `corpus_first_shard` ..
    `corpus_shards` - 1; all from the first when corpus_shards is 0) or a prepared TFDS
    corpus dataset folder -> a random-access source."""
    if data == "synthetic":
        return SyntheticMultiModal(vocab_size, block_size=block_size, seq_len=seq_len,
                                   num_phrases=num_phrases, phrase_len=phrase_len,
                                   temperature=verify_temperature, logit_scale=logit_scale,
                                   seed=seed)
    if not data:
        raise ValueError("no training data: set data (--data PATH.jsonl or 'synthetic')")
    if data.endswith(".jsonl"):
        return ListSource(load_jsonl(data, verify_temperature), name=data,
                          verify_temperature=verify_temperature)
    if is_corpus_folder(data):  # a `dblast data regenerate` folder (local or gs://...)
        from dblast_jax.data.corpus import Corpus
        return Corpus(data, verify_temperature=verify_temperature,
                      max_shards=corpus_shards or None, first_shard=corpus_first_shard)
    if os.path.isdir(data) and os.path.exists(os.path.join(data, "dataset_info.json")):
        from dblast_jax.data.tfds_builders import TfdsCorpusSource  # `dblast data tfds`
        if corpus_shards or corpus_first_shard:
            raise ValueError("data_shards selects shards of a corpus folder; a TFDS dataset "
                             "is already a fixed snapshot (build it with --max-shards)")
        return TfdsCorpusSource(data, verify_temperature=verify_temperature)
    raise ValueError(f"data {data!r}: expected 'synthetic', a .jsonl file of token lists / "
                     "records, a corpus folder written by `dblast data regenerate`, or its "
                     "TFDS dataset folder (`dblast data tfds`)")


# ---- data / target compatibility ----------------------------------------------------------

def token_id_range(source: Any) -> Optional[tuple[int, int]]:
    """(smallest, largest) token id of a source's records, where that is cheap to know (a
    corpus folder, in-memory / .jsonl records); None otherwise (synthetic data are drawn
    inside the vocabulary; a TFDS copy is not scanned)."""
    inner = getattr(source, "source", None)  # a wrapper (cached features) over a source
    if hasattr(source, "token_range"):
        return source.token_range()
    if isinstance(source, ListSource):
        toks = [np.asarray(r["tokens"]) for r in source.records if len(r["tokens"])]
        if not toks:
            return None
        return min(int(t.min()) for t in toks), max(int(t.max()) for t in toks)
    if inner is not None and inner is not source:
        return token_id_range(inner)
    return None


def check_data_for_target(source: Any, target_config: Any, target_name: str, target_params: Any,
                          *, uses_logp: bool, log: Optional[Callable[[str], None]] = None,
                          what: str = "data") -> None:
    """Raise ValueError when `source` cannot train / be scored against this target: token
    ids outside its vocabulary (no padding is stored: every id must be a real token), or,
    when the run uses the log-probs stored in a corpus, a corpus made by another target
    (its manifest's target digest; see `regenerate.check_corpus_target`)."""
    name = getattr(source, "name", type(source).__name__)
    span = token_id_range(source)
    vocab = int(target_config.vocab_size)
    if span is not None and (span[0] < 0 or span[1] >= vocab):
        bad = span[1] if span[1] >= vocab else span[0]
        raise ValueError(f"{what} {name}: token id {bad} (ids span {span[0]} .. {span[1]}) "
                         f"lies outside the vocabulary of target {target_name!r} "
                         f"(vocab_size {vocab}, ids 0 .. {vocab - 1}): the data were "
                         "tokenized for another model; use data made for this target "
                         "(`dblast data regenerate`) or train against the target they "
                         "were made with")
    manifest = getattr(source, "manifest", None)
    if uses_logp and isinstance(manifest, Mapping):
        from dblast_jax.data.regenerate import check_corpus_target
        check_corpus_target(manifest, name, target_name, target_params, log)


# ---- batch assembly -----------------------------------------------------------------------

def collate(records: Sequence[Record], seq_len: int, with_logp: Optional[bool] = None
            ) -> dict[str, np.ndarray]:
    """Right-pad / truncate records to seq_len -> numpy batch dict."""
    n = len(records)
    if with_logp is None:
        with_logp = bool(records) and all("logp" in r for r in records)
    tokens = np.zeros((n, seq_len), np.int32)
    mask = np.zeros((n, seq_len), bool)
    lengths = np.zeros((n,), np.int32)
    logp = np.zeros((n, seq_len), np.float32) if with_logp else None
    for i, r in enumerate(records):
        m = min(len(r["tokens"]), seq_len)
        tokens[i, :m] = r["tokens"][:m]
        mask[i, :m] = r["loss_mask"][:m]
        lengths[i] = m
        if with_logp:
            if "logp" not in r:
                raise ValueError("some records carry logp and others do not; the corpus "
                                 "must be consistent")
            logp[i, :m] = r["logp"][:m]
    out = {"tokens": tokens, "loss_mask": mask, "lengths": lengths}
    if with_logp:
        out["logp"] = logp
    if records and "taps" in records[0]:  # cached target features, already [seq_len, ...]
        taps = [r["taps"] for r in records]
        if any(t.shape[0] != seq_len for t in taps):
            raise ValueError(f"cached taps cover {taps[0].shape[0]} positions, the batch "
                             f"{seq_len}: the cache was built for another seq_len")
        out["taps"] = np.stack(taps)
    for key in ("teacher_ids", "teacher_logp"):  # the cached teacher's top-k, [seq_len, k]
        if records and key in records[0]:
            out[key] = np.stack([r[key] for r in records])
    return out


class Batcher:
    """Deterministic global batches from a random-access source.

    Global batch k = items k*B .. k*B+B-1 of an order that is a seeded permutation of the
    usable records, fresh each epoch (`shuffle=False` keeps source order; a source whose
    `usable_indices` returns None is used in index order: all usable, already random).
    This process materialises rows [rows[0], rows[1]) of each global batch.
    State: {"batches": k}."""

    def __init__(self, source, *, batch_size: int, seq_len: int, block_size: int,
                 seed: int = 0, shuffle: bool = True, rows: Optional[tuple[int, int]] = None,
                 with_logp: Optional[bool] = None):
        self.source, self.batch_size, self.seq_len = source, batch_size, seq_len
        self.block_size, self.seed, self.shuffle = block_size, seed, shuffle
        self.rows = tuple(rows) if rows is not None else (0, batch_size)
        if not 0 <= self.rows[0] < self.rows[1] <= batch_size:
            raise ValueError(f"rows {self.rows} do not lie in a batch of {batch_size}")
        usable = source.usable_indices(seq_len, block_size)
        self.usable = None if usable is None else np.asarray(usable)
        if with_logp is None:  # decided once, so every batch has the same fields
            first = 0 if self.usable is None else int(self.usable[0])
            with_logp = "logp" in source[first]
        self.with_logp = with_logp
        self._batches = 0
        self._perm_epoch, self._perm = -1, None

    @property
    def num_usable(self) -> int:
        return len(self.source) if self.usable is None else int(self.usable.size)

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return self.usable
        if epoch != self._perm_epoch:
            gen = np.random.default_rng([self.seed, epoch, 7])
            self._perm = self.usable[gen.permutation(self.usable.size)]
            self._perm_epoch = epoch
        return self._perm

    def item_index(self, g: int) -> int:
        if self.usable is None:
            return g % len(self.source)
        n = self.usable.size
        if not self.shuffle:
            return int(self.usable[g % n])
        return int(self._order(g // n)[g % n])

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        start = self._batches * self.batch_size
        recs = [self.source[self.item_index(start + r)] for r in range(*self.rows)]
        self._batches += 1
        return collate(recs, self.seq_len, self.with_logp)

    def get_state(self) -> dict[str, Any]:
        return {"kind": "batcher", "global": True, "batches": int(self._batches),
                "seed": int(self.seed), "num_usable": int(self.num_usable)}

    def set_state(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != "batcher":
            raise ValueError(f"data state {dict(state)} was not written by a Batcher")
        if int(state.get("num_usable", self.num_usable)) != self.num_usable:
            raise ValueError(f"the checkpoint's data order was over {state['num_usable']} "
                             f"usable records; this corpus has {self.num_usable}: not the "
                             "same data")
        self._batches = int(state["batches"])


class IteratorBatcher:
    """Batches from any iterator of records (per-process: it must yield this process's
    rows). State: the iterator's own get_state() when it has one; otherwise the number of
    records consumed, restored by re-creating the iterator with `make_iterator` and
    skipping that many."""

    def __init__(self, make_iterator: Callable[[], Iterator[Any]], *, local_batch_size: int,
                 seq_len: int, block_size: int, with_logp: Optional[bool] = None,
                 verify_temperature: Optional[float] = None, max_skips: int = 10000):
        self.make_iterator = make_iterator
        self.local_batch_size, self.seq_len, self.block_size = local_batch_size, seq_len, block_size
        self.with_logp, self.verify_temperature, self.max_skips = with_logp, verify_temperature, max_skips
        self._it = make_iterator()
        self._consumed = 0
        self._seen_usable = False

    def _next_record(self) -> Record:
        skipped = 0
        while True:
            try:
                item = next(self._it)
            except StopIteration:
                if self._consumed == 0:
                    raise ValueError("corpus is empty: the iterator yielded nothing") from None
                if not self._seen_usable:
                    raise ValueError(f"corpus is too short: no record has a response token "
                                     f"followed by a full block of {self.block_size} within "
                                     f"seq_len {self.seq_len}") from None
                self._it = self.make_iterator()  # next epoch
                continue
            self._consumed += 1
            rec = as_record(item, f"record {self._consumed}", self.verify_temperature)
            if record_is_usable(rec, self.seq_len, self.block_size):
                self._seen_usable = True
                return rec
            skipped += 1
            if skipped > self.max_skips:
                raise ValueError(f"{skipped} consecutive records were too short for a block of "
                                 f"{self.block_size} within seq_len {self.seq_len}")

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return collate([self._next_record() for _ in range(self.local_batch_size)],
                       self.seq_len, self.with_logp)

    def get_state(self) -> dict[str, Any]:
        if hasattr(self._it, "get_state"):
            state = self._it.get_state()
            if isinstance(state, bytes):
                return {"kind": "iterator", "bytes": state.decode("latin-1")}
            return {"kind": "iterator", "state": state}
        return {"kind": "position", "consumed": self._consumed}

    def set_state(self, state: Mapping[str, Any]) -> None:
        kind = state.get("kind")
        if kind == "iterator":
            if not hasattr(self._it, "set_state"):
                raise ValueError("checkpoint holds an iterator state but this iterator has "
                                 "no set_state()")
            self._it.set_state(state["bytes"].encode("latin-1") if "bytes" in state
                               else state["state"])
        elif kind == "position":
            self._it = self.make_iterator()
            self._consumed = 0
            for _ in range(int(state["consumed"])):
                try:
                    next(self._it)
                except StopIteration:
                    self._it = self.make_iterator()
                    next(self._it)
                self._consumed += 1
        else:
            raise ValueError(f"unknown data state {dict(state)}")
