"""Prompt-lookup (n-gram) proposals on the token buffer of the on-device loop.

Small models answering greedily repeat their prompt and themselves, and copying costs
nothing: this is vLLM's `ngram` drafter as array ops, batched, jittable, with no host round
trip. For each row, the longest suffix (max_n .. min_n tokens) of the text so far that
occurred earlier is found, and the tokens that followed its latest occurrence are the
drafts. When the continuation runs into the end of the known text (a match `p` tokens
back), it repeats with period `p` (what the text would do if the pattern went on).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def match_suffix(history: Array, length: Array, *, min_n: int, max_n: int
                 ) -> tuple[Array, Array]:
    """The latest earlier occurrence of the longest matching suffix.

    history: [B, W] int token buffer; row b's text is history[b, :length[b]] (the last of
    them the anchor, the token the drafts continue). length: [B] int.
    Returns (end [B] int32: index of the occurrence's last token, < length - 1, or -1 when
    no suffix of min_n..max_n tokens occurred before; match [B] int32: its length, 0 if
    none). Cost: O(B * W * max_n^2) compares, trivial next to a target pass.
    """
    history = history.astype(jnp.int32)
    length = length.astype(jnp.int32)
    pos = jnp.arange(history.shape[1], dtype=jnp.int32)[None, :]  # candidate end j
    last = length - 1  # [B] the anchor's index
    best_end = jnp.full(length.shape, -1, jnp.int32)
    best_n = jnp.zeros(length.shape, jnp.int32)
    for n in range(min_n, max_n + 1):  # longer matches override shorter ones
        # j ends an occurrence of the n-token suffix: history[j - t] == history[last - t]
        # for t < n, with n - 1 <= j < last (so j - t >= 0 and the occurrence is earlier)
        ok = (pos >= n - 1) & (pos < last[:, None])
        for t in range(n):
            suffix_tok = jnp.take_along_axis(history, jnp.maximum(last - t, 0)[:, None],
                                             axis=1)  # [B, 1]
            ok &= jnp.roll(history, t, axis=1) == suffix_tok  # rolled[:, j] = history[j - t]
        end = jnp.max(jnp.where(ok, pos, -1), axis=1)
        found = end >= 0
        best_end = jnp.where(found, end, best_end)
        best_n = jnp.where(found, n, best_n)
    return best_end, best_n


def propose(history: Array, length: Array, *, num_drafts: int, min_n: int, max_n: int
            ) -> tuple[Array, Array]:
    """n-gram drafts for every row.

    history [B, W], length [B] as in `match_suffix`. Returns (drafts [B, num_drafts] int32,
    match [B] int32 the matched suffix's length, 0 where nothing matched). A row without a
    match drafts its anchor repeated (a period-1 continuation): the target pass is paid
    anyway, and repeats are what such rows accept most often.
    """
    end, match = match_suffix(history, length, min_n=min_n, max_n=max_n)
    last = length.astype(jnp.int32) - 1
    end = jnp.where(match > 0, end, last - 1)
    period = jnp.maximum(last - end, 1)  # [B] >= 1: the match ends `period` tokens back
    i = jnp.arange(num_drafts, dtype=jnp.int32)[None, :]
    idx = end[:, None] + 1 + i % period[:, None]  # <= last: known tokens only
    drafts = jnp.take_along_axis(history.astype(jnp.int32), jnp.clip(idx, 0, None), axis=1)
    return drafts, match
