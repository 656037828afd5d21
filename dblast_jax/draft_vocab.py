"""A draft-time vocabulary: the drafter's head over the N most frequent response tokens.

Why: on a CPU most of a drafting pass is the LM head, [b - 1, H] x [H, V] with
V = 49,152 for SmolLM2, although response text uses a small part of the vocabulary (on
the SmolLM2 corpus the 4,096 most frequent response tokens are 84% of them). FR-Spec and
EAGLE-3 draft over such a subset V' instead; vLLM's DFlash loader reads it
(`draft_vocab_size`, `d2t`).

Exactness: q_i is the softmax over V' and 0 elsewhere; the drafts are drawn from that q_i
(or are its argmax) and verified against the same q_i. The residual max(0, p_i - q_i)
keeps the target's mass outside V', so every emitted token is still distributed as the
target's (docs/METHOD.md section 3). Only acceptance can drop: a token outside V' is
never drafted.

It is a setting of a trained drafter, nothing is retrained. At decode time it lives beside
the drafter's parameters as `dparams["draft_vocab"] = {"ids": [N] int32 target ids, most
frequent first, "head": [N, H] the target LM head's rows of those ids}` (`attach`); the
sampler splits it off (`split`) before the drafter's own layers see their parameters, so
training, checkpoints and the drafter's sharding rules never carry it.

Where the ranking comes from: a drafter folder's `token_counts.npy` (the response-token
counts of its training corpus: shipped with the drafters of `pretrained/`, written by
`dblast export --token-counts-from CORPUS`), or an export made with a draft vocabulary
(vLLM's fields: `draft_vocab_size` in config.json, offsets `d2t` in the safetensors,
target id = j + d2t[j]), whose order is the ranking.
"""

from __future__ import annotations

import io
import os
from typing import Any, Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np

from dblast_jax.config import TargetConfig
from dblast_jax.models import target as target_lib

Array = jax.Array
Params = Any

KEY = "draft_vocab"
COUNTS_FILE = "token_counts.npy"


def check_size(n: int, vocab_size: int, where: str = "draft_vocab") -> int:
    """N must be a whole number in [1, V): N = V is the full head (leave the setting off)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n < vocab_size:
        raise ValueError(f"{where} must be an integer in [1, {vocab_size}) for this "
                         f"vocabulary of {vocab_size} (leave it off for the full head), "
                         f"got {n!r}")
    return int(n)


def ids_from_counts(counts: np.ndarray, n: int) -> np.ndarray:
    """The n most frequent token ids [n] int32, most frequent first (ties: lower id)."""
    from dblast_jax.train.sampled_head import rank_by_count  # one ranking rule for both
    counts = np.asarray(counts)
    check_size(n, counts.shape[0])
    return rank_by_count(counts)[:n].astype(np.int32)


def coverage(counts: np.ndarray, n: int) -> float:
    """The share of the counted response tokens that the n most frequent cover."""
    counts = np.asarray(counts, np.int64)
    total = int(counts.sum())
    return float(counts[ids_from_counts(counts, n)].sum() / total) if total else 0.0


# ---- token counts beside a drafter ---------------------------------------------------------

def count_corpus_tokens(data: str, vocab_size: int, max_records: int = 1 << 30) -> np.ndarray:
    """Response-token counts [V] int64 (loss_mask tokens) of a corpus folder, its shards
    A .. B-1 (`FOLDER:A:B`: the training shards, leaving held-out ones out) or a .jsonl."""
    from dblast_jax.data.corpus import parse_shard_range  # the data stack loads on demand
    from dblast_jax.data.records import make_source
    from dblast_jax.train.sampled_head import response_token_counts
    first = stop = 0
    head, sep, rng = data.rpartition(":")
    if sep and ":" in head and rng.isdigit():
        data, _, first_text = head.rpartition(":")
        first, stop = parse_shard_range(f"{first_text}:{rng}")
    source = make_source(data, vocab_size=vocab_size, block_size=2, seq_len=2,
                         verify_temperature=None, corpus_shards=stop, corpus_first_shard=first)
    counts, n = response_token_counts(source, vocab_size, max_records)
    if not n or not counts.sum():
        raise ValueError(f"{data}: no response tokens to count")
    return counts


def counts_bytes(counts: np.ndarray, vocab_size: int) -> bytes:
    """token_counts.npy's bytes: [V] non-negative integer counts, stored as int64."""
    counts = np.asarray(counts)
    if counts.shape != (vocab_size,) or not np.issubdtype(counts.dtype, np.integer) \
            or (counts < 0).any():
        raise ValueError(f"token counts must be {vocab_size} non-negative integers (the "
                         f"target's vocabulary), got {counts.shape} {counts.dtype}")
    buf = io.BytesIO()
    np.save(buf, counts.astype(np.int64), allow_pickle=False)
    return buf.getvalue()


def save_counts(folder: str | os.PathLike, counts: np.ndarray) -> str:
    """Write FOLDER/token_counts.npy atomically; returns its path."""
    from dblast_jax.io.atomic import atomic_write_bytes
    counts = np.asarray(counts)
    path = os.path.join(os.fspath(folder), COUNTS_FILE)
    atomic_write_bytes(path, counts_bytes(counts, counts.shape[0]))
    return path


def load_counts(folder: str | os.PathLike, vocab_size: int) -> Optional[np.ndarray]:
    """FOLDER/token_counts.npy as int64 [V], or None when the folder has none."""
    path = os.path.join(os.fspath(folder), COUNTS_FILE)
    if not os.path.isfile(path):
        return None
    try:
        counts = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"{path}: unreadable token counts ({e}); delete the file or "
                         "rewrite it with `dblast export --token-counts-from CORPUS`") from e
    if counts.shape != (vocab_size,) or not np.issubdtype(counts.dtype, np.integer) \
            or (counts < 0).any():
        raise ValueError(f"{path}: expected {vocab_size} non-negative integer counts (the "
                         f"target's vocabulary), got shape {counts.shape} {counts.dtype}")
    return counts.astype(np.int64)


# ---- decode-time parameters ---------------------------------------------------------------

def head_rows(tparams: Params, ids: Array, target_config: TargetConfig) -> Array:
    """The target LM head's rows of `ids` [N] -> [N, H] (tied or untied head)."""
    if target_config.tie_word_embeddings:
        return jnp.take(tparams["embed"]["embedding"], ids, axis=0)
    return jnp.swapaxes(jnp.take(tparams["lm_head"]["kernel"], ids, axis=1), 0, 1)


def attach(dparams: Params, tparams: Params, ids: np.ndarray,
           target_config: TargetConfig) -> Params:
    """dparams plus the decode-time draft vocabulary `ids` [N] (distinct target ids)."""
    core, _ = split(dparams)
    ids = np.asarray(ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"draft vocabulary ids must be a [N] integer array, got {ids.shape} "
                         f"{ids.dtype}")
    check_size(int(ids.shape[0]), target_config.vocab_size)
    if ids.min() < 0 or ids.max() >= target_config.vocab_size:
        raise ValueError(f"draft vocabulary ids must lie in [0, {target_config.vocab_size})")
    if np.unique(ids).shape[0] != ids.shape[0]:
        raise ValueError("draft vocabulary ids must be distinct")
    ids = jnp.asarray(ids, jnp.int32)
    return {**core, KEY: {"ids": ids, "head": head_rows(tparams, ids, target_config)}}


def split(dparams: Params) -> tuple[Params, Optional[Params]]:
    """(the drafter's own parameters, the draft vocabulary or None)."""
    if isinstance(dparams, dict) and KEY in dparams:
        return {k: v for k, v in dparams.items() if k != KEY}, dparams[KEY]
    return dparams, None


def size(dparams: Params) -> Optional[int]:
    """N of an attached draft vocabulary, None for the full head."""
    _, dv = split(dparams)
    return None if dv is None else int(dv["ids"].shape[0])


def draft_logits(tparams: Params, dv: Optional[Params], hidden: Array,
                 target_config: TargetConfig) -> Array:
    """Final-normed drafter states [.., H] -> float32 logits over the draft vocabulary
    [.., N] (or the full vocabulary [.., V] when dv is None)."""
    if dv is None:
        return target_lib.lm_head(tparams, hidden, target_config)
    chex.assert_axis_dimension(hidden, -1, target_config.hidden_size,
                               custom_message="draft_logits: hidden must be [.., hidden_size]")
    return jnp.einsum("...h,nh->...n", hidden, dv["head"], preferred_element_type=jnp.float32)


def to_target_ids(dv: Optional[Params], idx: Array) -> Array:
    """Indices into the draft vocabulary -> target token ids (int32)."""
    idx = idx.astype(jnp.int32)
    return idx if dv is None else jnp.take(dv["ids"], idx, axis=0)


def to_target_probs(dv: Optional[Params], probs: Array, vocab_size: int) -> Array:
    """Probabilities over the draft vocabulary [.., N] -> over the target's [.., V], 0
    outside the draft vocabulary (the q the drafts were drawn from)."""
    if dv is None:
        return probs
    full = jnp.zeros(probs.shape[:-1] + (vocab_size,), probs.dtype)
    return full.at[..., dv["ids"]].set(probs)
