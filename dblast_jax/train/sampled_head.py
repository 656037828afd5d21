"""A cheaper training head: the frequent tokens exactly, a uniform sample of the rest.

Why: a cached five-tap training step (batch 8, 16 anchors, 7 block slots) spends most of
its time in the drafter's LM head, a [896, 576] x [576, 49,152] product run forward,
recomputed and run backward, to normalise one log q(x*) per row. Response text uses a small
part of the vocabulary (on the SmolLM2 corpus, 2,176 records, the 4,096 most frequent
response tokens, 8% of the vocabulary, are 84% of the response tokens), so most of that
work goes to columns whose only role is a little mass in the normaliser.

`sampled_token_logprobs` computes the same log q(t) = z_t - log Z with Z estimated:

    Z_hat = sum_{v in F} e^{z_v} + [t not in F] e^{z_t} + w * sum_{v in S, v != t} e^{z_v}

F: the `train_head_tokens` most frequent response tokens of the training data (fixed for a
run); S: `train_head_sampled` ids drawn uniformly without replacement from the rest
R = V \\ F, fresh at every step and shared by every row; w = |R \\ {t}| / |S \\ {t}| makes
the sampled sum an unbiased estimate of the rest's mass. Logits of F and S are one
[rows, |F| + |S|] product (about a tenth of the full head at 4,096 + 1,024). log Z_hat
itself is slightly biased (Jensen), which only the training loss sees: the drafter's
parameters and its exported head are unchanged, and validation, the sampler and export
always use the full softmax (`train.step.eval_config`).

`frequent_token_ids` picks F by counting response tokens (loss_mask) of the first records.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dblast_jax.chunked_logits import TokenLogprobs, by_row_blocks

Array = jax.Array

__all__ = ["frequent_token_ids", "response_token_counts", "rank_by_count", "coverage",
           "check_sizes", "sampled_token_logprobs", "HashableIds"]


def check_sizes(num_tokens: int, num_sampled: int, vocab_size: int) -> None:
    """Frequent + sampled columns must leave part of the vocabulary out (else: full head)."""
    if not (num_tokens >= 1 and num_sampled >= 0 and num_tokens + num_sampled < vocab_size):
        raise ValueError(f"train_head_tokens + train_head_sampled = {num_tokens} + "
                         f"{num_sampled} must be below the vocabulary {vocab_size} "
                         "(train_head_tokens=0: the full head)")


def response_token_counts(source: Any, vocab_size: int,
                          max_records: int) -> tuple[np.ndarray, int]:
    """Counts [V] of response tokens (loss_mask) over the first `max_records` records."""
    counts = np.zeros((vocab_size,), np.int64)
    n = min(len(source), int(max_records))
    for i in range(n):
        rec = source[i]
        tok = np.asarray(rec["tokens"])
        mask = np.asarray(rec.get("loss_mask", np.ones(tok.shape, bool))).astype(bool)
        ids = tok[mask[:tok.shape[0]]]
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"record {i} holds token ids outside [0, {vocab_size})")
        counts += np.bincount(ids, minlength=vocab_size)
    return counts, n


def frequent_token_ids(source: Any, vocab_size: int, num_tokens: int,
                       max_records: int = 4096) -> tuple[np.ndarray, dict[str, float]]:
    """The `num_tokens` most frequent response tokens of a random-access source (ties and
    never-seen ids: lower id first) -> (ids [F] int32 sorted, stats {records, response_tokens,
    coverage}). coverage: the share of the counted response tokens inside F."""
    if not 1 <= num_tokens < vocab_size:
        raise ValueError(f"train_head_tokens must lie in [1, {vocab_size}) for this "
                         f"vocabulary of {vocab_size}, got {num_tokens}")
    if source is None or not hasattr(source, "__getitem__") or not hasattr(source, "__len__"):
        raise ValueError("train_head_tokens counts the response tokens of the first training "
                         "records and needs random-access training data (a corpus folder, "
                         ".jsonl, a list of records or 'synthetic'), not an iterator")
    counts, n = response_token_counts(source, vocab_size, max_records)
    ids = np.sort(rank_by_count(counts)[:num_tokens]).astype(np.int32)
    total = int(counts.sum())
    stats = {"records": n, "response_tokens": total,
             "coverage": float(counts[ids].sum() / total) if total else 0.0}
    return ids, stats


def rank_by_count(counts: np.ndarray) -> np.ndarray:
    """Token ids [V] by count, most frequent first (ties and never-seen ids: lower id first)."""
    counts = np.asarray(counts)
    return np.lexsort((np.arange(counts.shape[0]), -counts)).astype(np.int32)


def coverage(ids: np.ndarray, tokens: np.ndarray) -> float:
    """Share of `tokens` (any shape) that lie in `ids`."""
    tokens = np.asarray(tokens).reshape(-1)
    return float(np.isin(tokens, ids).mean()) if tokens.size else 0.0


class HashableIds:
    """Token ids as a cache key of the compiled step (baked into it as a constant)."""

    def __init__(self, ids: np.ndarray):
        self.ids = tuple(int(i) for i in np.asarray(ids).reshape(-1))

    def __hash__(self):
        return hash(self.ids)

    def __eq__(self, other):
        return isinstance(other, HashableIds) and self.ids == other.ids

    def array(self) -> Array:
        return jnp.asarray(np.asarray(self.ids, np.int32))


def _head_columns(head: Array, layout: str, ids: Array) -> Array:
    """LM-head rows of `ids` [C] -> [C, H]."""
    return head[ids] if layout == "vh" else jnp.swapaxes(head[:, ids], 0, 1)


def sample_rest(rng: Array, frequent_ids: Array, vocab_size: int, num_sampled: int) -> Array:
    """`num_sampled` distinct ids uniformly from V \\ frequent_ids (Gumbel top-k) [m]."""
    in_f = jnp.zeros((vocab_size,), bool).at[frequent_ids].set(True)
    scores = jnp.where(in_f, -jnp.inf, jax.random.gumbel(rng, (vocab_size,), jnp.float32))
    return lax.top_k(scores, num_sampled)[1].astype(jnp.int32)


def sampled_token_logprobs(hidden: Array, head_weight: Array, head_layout: str,
                           targets: Array, frequent_ids: Array, rng: Array,
                           num_sampled: int, *, row_chunk_size: Optional[int] = None
                           ) -> TokenLogprobs:
    """log q(targets) [...] with the normaliser estimated from frequent + sampled columns.

    hidden [..., H] (final-normed drafter states), head_weight [V, H] ("vh") or [H, V]
    ("hv"), targets [...] ids in [0, V), frequent_ids [F] distinct ids, num_sampled m with
    F + m < V (static). argmax is taken over F, S and the target only (a training metric).
    Differentiable wrt hidden; the head is the frozen target's (no gradient to it)."""
    vocab = head_weight.shape[0] if head_layout == "vh" else head_weight.shape[1]
    n_f = int(frequent_ids.shape[0])
    m = int(num_sampled)
    check_sizes(n_f, m, vocab)
    head_weight = lax.stop_gradient(head_weight)
    lead = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).astype(jnp.int32)
    dtype = jnp.promote_types(jnp.result_type(hidden, head_weight), jnp.float32)
    sampled = sample_rest(rng, frequent_ids, vocab, m) if m else jnp.zeros((0,), jnp.int32)
    cand = jnp.concatenate([frequent_ids.astype(jnp.int32), sampled])  # [C]
    w_cand = _head_columns(head_weight, head_layout, cand).astype(h.dtype)  # [C, H]
    in_f = jnp.zeros((vocab,), bool).at[frequent_ids].set(True)
    in_s = jnp.zeros((vocab,), bool).at[sampled].set(True)
    rest = vocab - n_f

    def run(h_rows: Array, t_rows: Array) -> tuple[Array, Array]:
        z = jnp.einsum("nh,ch->nc", h_rows, w_cand, preferred_element_type=dtype)  # [N, C]
        w_t = _head_columns(head_weight, head_layout, t_rows).astype(h_rows.dtype)
        z_t = jnp.einsum("nh,nh->n", h_rows, w_t, preferred_element_type=dtype)
        t_in_f, t_in_s = in_f[t_rows], in_s[t_rows]
        # the rest's weight per row: |R \ {t}| / |S \ {t}|
        r_eff = rest - (~t_in_f).astype(dtype)
        m_eff = jnp.maximum(m - t_in_s.astype(dtype), 1.0)
        is_t = cand[None, :] == t_rows[:, None]
        w_s = jnp.where(is_t[:, n_f:], 0.0, (r_eff / m_eff)[:, None])  # t counted once, below
        weights = jnp.concatenate([jnp.ones((h_rows.shape[0], n_f), dtype), w_s,
                                   (~t_in_f).astype(dtype)[:, None]], axis=1)
        logits = jnp.concatenate([z, z_t[:, None]], axis=1)
        log_z = jax.nn.logsumexp(logits, axis=1, b=weights)
        best = jnp.argmax(jnp.where(weights > 0, lax.stop_gradient(logits), -jnp.inf), axis=1)
        ids = jnp.concatenate([jnp.broadcast_to(cand[None, :], z.shape), t_rows[:, None]],
                              axis=1)
        argmax = jnp.take_along_axis(ids, best[:, None], axis=1)[:, 0]
        return z_t - log_z, argmax.astype(jnp.int32)

    logprob, argmax = by_row_blocks(run, h, t, row_chunk_size)
    return TokenLogprobs(logprob.reshape(lead), argmax.reshape(lead), None)
