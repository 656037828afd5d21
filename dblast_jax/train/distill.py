"""Distillation from the frozen target's distribution (top-k truncated teacher).

The plain recipe learns from one sampled token per block position. The target's whole
teacher-forced distribution at that position is known (one pass, the same that yields the
drafter's taps), and matching it is what acceptance rewards: sampled-branch acceptance
is sum_x min(p, q). Keeping only its k most likely tokens (plus the tail mass) makes it
cheap to store in the feature cache and cheap to use: the student's log q at k ids is k
dot products per position on top of the log-normaliser the NLL already computes.

Indexing convention (like the stored log-probs): teacher[t] is the distribution of the
token at position t given tokens < t, read from the target's final state at t - 1;
teacher[0] is a dummy (no block slot ever sits at position 0).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dblast_jax.chunked_logits import teacher_topk

Array = jax.Array

# the dummy distribution at position 0 (and at padding): all mass in the tail
EMPTY_LOGP = -1e9


class Teacher(NamedTuple):
    ids: Array  # [B, T, k] int32
    logp: Array  # [B, T, k] float32


def teacher_from_final(final: Array, head: Array, layout: str, k: int, temperature: float,
                       chunk_size: int = 8192) -> Teacher:
    """final [B, T, H] (the target's final-normed states) -> Teacher [B, T, k] in the
    convention above, at `temperature` (the verification temperature T_v)."""
    top = teacher_topk(final[:, :-1], head, layout, k, temperature, chunk_size)
    ids = jnp.pad(top.ids, ((0, 0), (1, 0), (0, 0)))
    logp = jnp.pad(top.logprob, ((0, 0), (1, 0), (0, 0)), constant_values=EMPTY_LOGP)
    return Teacher(lax.stop_gradient(ids), lax.stop_gradient(logp))


def _head_rows(head: Array, layout: str, ids: Array) -> Array:
    """Rows of the LM head for token ids [...] -> [..., H]."""
    return head[ids] if layout == "vh" else jnp.moveaxis(head[:, ids], 0, -1)


def student_logq_at(branch_hidden: Array, head: Array, layout: str, ids: Array,
                    labels: Array, label_logq: Array) -> Array:
    """Each branch's log q at the teacher's ids, reusing the normaliser of the NLL.

    branch_hidden [B, A, K, P, H]; ids [B, A, P, k]; labels [B, A, K, P] and their log q
    label_logq [B, A, K, P] (from `token_logprobs` at temperature 1). log Z =
    z(label) - log q(label), so log q(v) = z(v) - z(label) + log q(label): exact, and its
    gradient flows through log q(label) into the normaliser. -> [B, A, K, P, k]."""
    rows = _head_rows(head, layout, ids).astype(branch_hidden.dtype)  # [B, A, P, k, H]
    z_ids = jnp.einsum("bazph,bapkh->bazpk", branch_hidden, rows,
                       preferred_element_type=jnp.float32)
    label_rows = _head_rows(head, layout, labels).astype(branch_hidden.dtype)
    z_label = jnp.einsum("bazph,bazph->bazp", branch_hidden, label_rows,
                         preferred_element_type=jnp.float32)
    log_z = z_label - label_logq.astype(jnp.float32)
    return z_ids - log_z[..., None]
