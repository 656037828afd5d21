"""Records and random-access sources: what the grain input pipeline (`data.pipeline`) reads.

A *record* is one training sequence:
    tokens     [L] int   the text (prompt + the target's own response)
    loss_mask  [L] bool  True on response tokens (where blocks may be anchored / scored)
    logp       [L] f32   optional: log p_target(tokens[t] | tokens[<t]) at the verify
                         temperature T_v (logp[0] is unused); the AL terms' input, stored
                         by the data step so that the trainer need not recompute it.
A plain list of ints is a record whose every token is "response".

A *source* gives random access to records (`len(src)`, `src[i]`) and names the usable
ones, `src.usable_indices(seq_len, block_size)` (a response token followed by a whole
block within seq_len; None: every index is usable and records are already i.i.d., as
for `SyntheticMultiModal`). Sources: `ListSource` (in-memory / .jsonl records),
`SyntheticMultiModal`, `corpus.Corpus` (a regenerated corpus folder) and
`tfds_builders.TfdsCorpusSource` (its TFDS array_record copy); `make_source` picks one
from a `--data` string.

`collate` right-pads / truncates records to seq_len into a fixed-shape numpy batch
(tokens [B, T], loss_mask [B, T], lengths [B], logp [B, T] when every record has it,
plus cached taps / teacher top-k when the records carry them): token 0 and mask False
past the end. Anchors are sampled later, on device (`train.objective.sample_anchors`).

`token_id_range` / `check_data_for_target`: whether a source can train against a target
(token ids inside its vocabulary; stored log-probs made by that target).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from dblast_jax.data.corpus import Corpus, is_corpus_folder, temperature_key
from dblast_jax.data.regenerate import check_corpus_target

Record = dict[str, Any]

__all__ = [
    "Record", "as_record", "load_jsonl", "ListSource", "SyntheticMultiModal", "collate",
    "record_is_usable", "make_source", "token_id_range", "check_data_for_target",
    "first_has_logp",
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
        return Corpus(data, verify_temperature=verify_temperature,
                      max_shards=corpus_shards or None, first_shard=corpus_first_shard)
    if os.path.isdir(data) and os.path.exists(os.path.join(data, "dataset_info.json")):
        # optional dependency: tensorflow_datasets (`dblast data tfds`)
        from dblast_jax.data.tfds_builders import TfdsCorpusSource
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


def first_has_logp(source: Any, usable: Optional[np.ndarray]) -> bool:
    """Whether the first usable record carries logp (decided once, so every batch of a
    run has the same fields)."""
    first = 0 if usable is None else int(usable[0])
    return "logp" in source[first]

