"""Log-probabilities of data tokens without materialising [N, V] logits.

Training needs log q(x*) (and the target's log p(x*)) at the data tokens only, but the
softmax normaliser runs over the whole vocabulary: for K = 4 branches, 15 block positions,
hundreds of anchors and V = 151,936 a full [N, V] float32 logit array is tens of GB, and
autodiff would keep it (or the softmax) for the backward pass.

`token_logprobs` instead scans over vocabulary chunks of `chunk_size` columns with an
online logsumexp: per row it carries a running max m, the rescaled sum s = sum exp(z - m),
the target logit, the running argmax and (for the entropy) t = sum exp(z - m) * z. Each
chunk's logits [N, C] exist only inside one scan step. The scan body is wrapped in
`jax.checkpoint`, so the backward pass saves only the small per-step carries and
recomputes each chunk's logits when it needs them: backward never holds [N, V] either.
(The body-level checkpoint is what bounds memory; an extra checkpoint around the whole
scan would only add a third pass over the head without saving anything more.)

The running max is wrapped in stop_gradient: logsumexp = m + log sum exp(z - m) holds
for any constant m, so the gradient is exactly softmax(z) without differentiating through
the max. The vocabulary need not be a multiple of the chunk: the last chunk is read at
start V - C (overlapping the previous one) and the already-counted columns are masked, so
the head is never padded or copied. `row_chunk_size` additionally splits the rows into
blocks (lax.map) to bound the [rows, C] chunk when N itself is large.

Temperature: logits are divided by `temperature` before the softmax (the verification
temperature T_v for target log-probs). Top-k / top-p filtering is not applied here.
Targets must lie in [0, V); any other id gives a meaningless value that the caller masks.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

__all__ = ["TeacherTopK", "TokenLogprobs", "by_row_blocks", "teacher_topk", "token_logprobs",
           "token_logprobs_naive"]

_LAYOUTS = ("vh", "hv")


class TokenLogprobs(NamedTuple):
    """Per-token results, shaped like `targets`."""

    logprob: Array  # log softmax(z / T)[target], float32 (float64 under x64 inputs)
    argmax: Array  # int32 argmax of the logits (first index on ties)
    entropy: Optional[Array]  # entropy of softmax(z / T) in nats, or None if not requested


def _check(hidden: Array, head_weight: Array, head_layout: str, targets: Array) -> int:
    if head_layout not in _LAYOUTS:
        raise ValueError(f"head_layout must be 'vh' (tied embedding [V, H]) or 'hv' (kernel "
                         f"[H, V]), got {head_layout!r}")
    if head_weight.ndim != 2:
        raise ValueError(f"head_weight must be 2-D ({head_layout}), got shape {head_weight.shape}")
    if hidden.ndim < 1:
        raise ValueError(f"hidden must be [..., H], got shape {hidden.shape}")
    h_dim = hidden.shape[-1]
    v, h_w = head_weight.shape if head_layout == "vh" else head_weight.shape[::-1]
    if h_w != h_dim:
        raise ValueError(f"head_weight shape {head_weight.shape} (layout {head_layout!r}) has "
                         f"hidden size {h_w}, but hidden has shape {hidden.shape}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets shape {targets.shape} must equal hidden's leading shape "
                         f"{hidden.shape[:-1]} (hidden {hidden.shape})")
    chex.assert_type([hidden, head_weight, targets], [float, float, int],
                     custom_message="hidden and head_weight must be floating point, targets "
                                    "integer token ids (inputs 0, 1, 2)")
    return v


def _check_temperature(temperature) -> None:
    if isinstance(temperature, (int, float)) and not temperature > 0:
        raise ValueError(f"temperature must be > 0 for log-probs (use argmax for T = 0), "
                         f"got {temperature}")


def _compute_dtype(hidden: Array, head_weight: Array):
    return jnp.promote_types(jnp.result_type(hidden, head_weight), jnp.float32)


def _logits(h: Array, w: Array, head_layout: str, temperature, dtype) -> Array:
    spec = "nh,ch->nc" if head_layout == "vh" else "nh,hc->nc"
    return jnp.einsum(spec, h, w, preferred_element_type=dtype).astype(dtype) / temperature


def token_logprobs_naive(hidden: Array, head_weight: Array, head_layout: str, targets: Array,
                         temperature=1.0, chunk_size: Optional[int] = None, *,
                         with_entropy: bool = False, row_chunk_size: Optional[int] = None
                         ) -> TokenLogprobs:
    """Reference: full [N, V] logits (same signature; the chunk sizes are ignored)."""
    del chunk_size, row_chunk_size
    hidden, targets = jnp.asarray(hidden), jnp.asarray(targets)
    _check(hidden, head_weight, head_layout, targets)
    _check_temperature(temperature)
    dtype = _compute_dtype(hidden, head_weight)
    lead = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).astype(jnp.int32)
    z = _logits(h, head_weight, head_layout, temperature, dtype)
    lse = jax.nn.logsumexp(z, axis=-1)
    logprob = jnp.take_along_axis(z, t[:, None], axis=-1)[:, 0] - lse
    argmax = jnp.argmax(z, axis=-1).astype(jnp.int32)
    entropy = None
    if with_entropy:
        entropy = (lse - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)).reshape(lead)
    return TokenLogprobs(logprob.reshape(lead), argmax.reshape(lead), entropy)


def _rows(h: Array, w: Array, t: Array, head_layout: str, temperature, chunk: int, vocab: int,
          with_entropy: bool, dtype) -> tuple[Array, Array, Array]:
    """h [N, H], t [N] -> (logprob [N], argmax [N], entropy [N]) by vocabulary chunks."""
    n = h.shape[0]
    n_chunks = math.ceil(vocab / chunk)
    axis = 0 if head_layout == "vh" else 1
    cols0 = jnp.arange(chunk, dtype=jnp.int32)

    def body(carry, c):
        m, s, ent_t, tgt, best, best_idx = carry
        nominal = c * chunk
        start = jnp.minimum(nominal, vocab - chunk)        # last chunk overlaps, never pads
        wc = lax.dynamic_slice_in_dim(w, start, chunk, axis=axis)
        z = _logits(h, wc, head_layout, temperature, dtype)  # [N, C]
        cols = start + cols0
        fresh = (cols >= nominal)[None, :]                  # columns not seen in earlier chunks
        z_sg = lax.stop_gradient(jnp.where(fresh, z, -jnp.inf))
        c_max = jnp.max(z_sg, axis=-1)
        c_arg = jnp.argmax(z_sg, axis=-1).astype(jnp.int32) + start
        m_new = jnp.maximum(m, c_max)                       # no gradient: see module doc
        scale = jnp.exp(m - m_new)
        e = jnp.where(fresh, jnp.exp(z - m_new[:, None]), 0.0)
        s = s * scale + jnp.sum(e, axis=-1)
        if with_entropy:
            ent_t = ent_t * scale + jnp.sum(e * jnp.where(fresh, z, 0.0), axis=-1)
        hit = fresh & (cols[None, :] == t[:, None])
        tgt = tgt + jnp.sum(jnp.where(hit, z, 0.0), axis=-1)
        better = c_max > best
        best = jnp.where(better, c_max, best)
        best_idx = jnp.where(better, c_arg, best_idx)
        return (m_new, s, ent_t, tgt, best, best_idx), None

    zeros = jnp.zeros((n,), dtype)
    neg = jnp.full((n,), -jnp.inf, dtype)
    init = (neg, zeros, zeros, zeros, neg, jnp.zeros((n,), jnp.int32))
    body = jax.checkpoint(body, prevent_cse=False)
    steps = jnp.arange(n_chunks, dtype=jnp.int32)
    (m, s, ent_t, tgt, _, best_idx), _ = lax.scan(body, init, steps)
    lse = m + jnp.log(s)
    entropy = lse - ent_t / s if with_entropy else zeros
    return tgt - lse, best_idx, entropy


def by_row_blocks(run, h: Array, t: Array, row_chunk_size: Optional[int]) -> tuple:
    """run(h [r, H], t [r]) -> tuple of [r] arrays, applied to blocks of `row_chunk_size`
    rows (lax.map; the last block padded, its padding dropped) or to all rows at once."""
    n = h.shape[0]
    if row_chunk_size is None or n <= int(row_chunk_size):
        return run(h, t)
    r = int(row_chunk_size)
    if r < 1:
        raise ValueError(f"row_chunk_size must be >= 1, got {row_chunk_size}")
    blocks = math.ceil(n / r)
    pad = blocks * r - n
    hp = jnp.pad(h, ((0, pad), (0, 0))).reshape(blocks, r, h.shape[-1])
    tp = jnp.pad(t, (0, pad)).reshape(blocks, r)
    outs = lax.map(lambda args: run(*args), (hp, tp))
    return tuple(o.reshape(-1)[:n] for o in outs)


def token_logprobs(hidden: Array, head_weight: Array, head_layout: str, targets: Array,
                   temperature=1.0, chunk_size: int = 8192, *, with_entropy: bool = False,
                   row_chunk_size: Optional[int] = None) -> TokenLogprobs:
    """log softmax(hidden @ head / temperature)[targets] by vocabulary chunks.

    hidden [..., H] (final-normed states), head_weight [V, H] ("vh", tied embedding) or
    [H, V] ("hv", untied lm_head kernel), targets [...] int ids. Returns TokenLogprobs
    shaped like targets. Differentiable wrt hidden and head_weight (equal to the naive
    gradient); peak memory O(rows * chunk_size) in both passes. chunk_size >= V means one
    chunk; row_chunk_size (optional) also splits the rows."""
    hidden, targets = jnp.asarray(hidden), jnp.asarray(targets)
    vocab = _check(hidden, head_weight, head_layout, targets)
    _check_temperature(temperature)
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    chunk = min(int(chunk_size), vocab)
    dtype = _compute_dtype(hidden, head_weight)
    lead = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).astype(jnp.int32)
    n = h.shape[0]

    def run(h_rows, t_rows):
        return _rows(h_rows, head_weight, t_rows, head_layout, temperature, chunk, vocab,
                     with_entropy, dtype)

    if n == 0:
        logprob, argmax, entropy = (jnp.zeros((0,), dtype), jnp.zeros((0,), jnp.int32),
                                    jnp.zeros((0,), dtype))
    else:
        logprob, argmax, entropy = by_row_blocks(run, h, t, row_chunk_size)
    return TokenLogprobs(logprob.reshape(lead), argmax.reshape(lead),
                         entropy.reshape(lead) if with_entropy else None)


class TeacherTopK(NamedTuple):
    """The k most likely tokens of softmax(z / T) per row (a truncated teacher)."""

    ids: Array  # [..., k] int32, most likely first
    logprob: Array  # [..., k] float32, their log-probabilities (normalised over all V)


def teacher_topk(hidden: Array, head_weight: Array, head_layout: str, k: int,
                 temperature=1.0, chunk_size: int = 8192) -> TeacherTopK:
    """Top-k of softmax(hidden @ head / temperature) by vocabulary chunks, no gradient.

    Distillation targets for a drafter: the frozen target's distribution at one position
    reduced to its k most likely tokens plus the tail mass 1 - sum(exp(logprob)). One pass
    over the head (a running top-k merged with each chunk's top-k, and an online
    logsumexp for the normaliser), so [N, V] logits never exist. hidden [..., H]."""
    hidden = lax.stop_gradient(jnp.asarray(hidden))
    vocab = _check(hidden, head_weight, head_layout, jnp.zeros(hidden.shape[:-1], jnp.int32))
    _check_temperature(temperature)
    k = int(k)
    if not 1 <= k <= vocab:
        raise ValueError(f"teacher top-k must lie in [1, {vocab}], got {k}")
    chunk = max(min(int(chunk_size), vocab), k)
    w = lax.stop_gradient(head_weight)
    dtype = jnp.float32
    lead = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.shape[-1])
    n = h.shape[0]
    axis = 0 if head_layout == "vh" else 1
    cols0 = jnp.arange(chunk, dtype=jnp.int32)

    def body(carry, c):
        m, s, top_v, top_i = carry
        nominal = c * chunk
        start = jnp.minimum(nominal, vocab - chunk)
        wc = lax.dynamic_slice_in_dim(w, start, chunk, axis=axis)
        z = jnp.where((start + cols0 >= nominal)[None, :],
                      _logits(h, wc, head_layout, temperature, dtype), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(z, axis=-1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=-1)
        cv, ci = lax.top_k(z, k)
        both_v = jnp.concatenate([top_v, cv], axis=-1)
        both_i = jnp.concatenate([top_i, ci.astype(jnp.int32) + start], axis=-1)
        best_v, pick = lax.top_k(both_v, k)
        return (m_new, s, best_v, jnp.take_along_axis(both_i, pick, axis=-1)), None

    init = (jnp.full((n,), -jnp.inf, dtype), jnp.zeros((n,), dtype),
            jnp.full((n, k), -jnp.inf, dtype), jnp.zeros((n, k), jnp.int32))
    steps = jnp.arange(math.ceil(vocab / chunk), dtype=jnp.int32)
    (m, s, top_v, top_i), _ = lax.scan(body, init, steps)
    logprob = top_v - (m + jnp.log(s))[:, None]
    return TeacherTopK(top_i.reshape(lead + (k,)), logprob.reshape(lead + (k,)))
