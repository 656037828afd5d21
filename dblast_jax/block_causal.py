"""Drafting with a causal block (`DrafterConfig.block_attention = "causal"`).

Inside the block, position i attends to the context, to the anchor and to the block's
tokens before it (and its own input), never to positions after it (`models/drafter.py`,
`causal_block_mask`). The drafts are taken left to right: pass i runs the drafter over
the block [anchor, d_1 .. d_{i-1}, MASK, ..] with the causal mask and reads position i,
so q_i conditions on the drafted prefix; d_i's embedding then goes into position i.
That is b - 1 drafter passes per block (`lax.scan`, static shapes). A pass does not rerun
the whole block (`models/drafter.py`, `causal_pass`, the definition): the causal mask
makes the positions after i irrelevant and those before i unchanged, so pass i
(`causal_step`) computes two positions only, d_{i-1}'s (its keys / values kept per layer
for the later passes) and position i's MASK, against the draft cache's context keys /
values. The LM head runs once per position, on that position's state only.

Exactness (docs/METHOD.md section 3.2). The proposal recorded for position i is the q_i
the draft was actually taken from, given the drafted prefix, so `verify.verify_block`
checks each draft against its own conditional:

* `greedy-branch`: z ~ pi' (the prior is read from the anchor position, which sees no
  block token), then d_i = argmax of branch z given d_<i; Q_i = one-hot(d_i).
* `sampled-branch`: d_i ~ softmax(branch z's logits / T_d) given d_<i; Q_i is that
  softmax.
* `mixture`: every branch drafts its own greedy chain (its own prefix: K blocks per row
  in each pass), d is branch z's chain and Q_i = sum_z post(z | d_<i) one-hot(chain_z[i]).
* `sampled-mixture`: d is sampled from branch z; the trunk does not depend on z (the
  branches differ after the final norm), so the same passes give every branch's q_i on the
  drafted prefix, and Q_i = sum_z post(z | d_<i) q_i(. | z, d_<i) with post proportional
  to pi'(z) prod_{j<i} q_j(d_j | z, d_<j): the exact conditional of the autoregressive
  mixture sum_z pi'(z) prod_i q_i(d_i | z, d_<i).
* T = 0: the argmax chains, checked by prefix match against the target's argmax.

A draft-time vocabulary (dblast_jax/draft_vocab.py) works unchanged: each q_i is over its
N ids, and the drafted id is mapped to the target's before its embedding enters the block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dblast_jax import draft_vocab, verify
from dblast_jax.config import DrafterConfig, SamplingConfig, TargetConfig
from dblast_jax.models import drafter as drafter_lm

Array = jax.Array


def first_pass(core, tparams, anchor: Array, anchor_pos: Array, cache, num_blocks: int, *,
               dcfg: DrafterConfig):
    """Pass 1 (the anchor at slot 0, MASK at position 1) for num_blocks blocks per row:
    (start = (block keys / values, branch states of position 1 [B, M, K, H]), prior
    logits [B, K] of the anchor position)."""
    bsz = anchor.shape[0]
    kv = drafter_lm.init_block_cache(dcfg, bsz, num_blocks, jax.tree.leaves(cache.k)[0].dtype)
    prev = jnp.broadcast_to(anchor.astype(jnp.int32)[:, None], (bsz, num_blocks))
    branch, prior, kv = drafter_lm.causal_step(core, tparams, prev, kv, anchor_pos, cache, 1,
                                               drafter_config=dcfg)
    return (kv, branch), prior[:, 0]


def left_to_right(core, tparams, start, anchor_pos: Array, cache, pick, xs: Array | None, *,
                  dcfg: DrafterConfig):
    """Draft positions 1 .. b-1 in turn from `start` (first_pass). pick(branch states
    [B, M, K, H], x) -> (tokens [B, M] target ids put at that position, per-position
    output); xs: per-position inputs [b-1, ..] or None. Returns (the M chains [B, M, b-1],
    outputs stacked [b-1, ..])."""
    kv, branch1 = start
    tok1, out1 = pick(branch1, None if xs is None else xs[0])

    def step(carry, x):
        kv, prev = carry
        i, xi = x
        branch, _, kv = drafter_lm.causal_step(core, tparams, prev, kv, anchor_pos, cache, i,
                                               drafter_config=dcfg)
        tok, out = pick(branch, xi)
        return (kv, tok), (tok, out)

    slots = jnp.arange(2, dcfg.block_size, dtype=jnp.int32)
    _, (toks, outs) = jax.lax.scan(step, (kv, tok1), (slots, None if xs is None else xs[1:]))
    chains = jnp.moveaxis(jnp.concatenate([tok1[None], toks], axis=0), 0, 2)
    if out1 is not None:
        outs = jnp.concatenate([out1[None], outs], axis=0)
    return chains, outs


def greedy_chains(core, dv, tparams, anchor_pos: Array, cache, start, z: Array | None, *,
                  tcfg: TargetConfig, dcfg: DrafterConfig) -> Array:
    """Argmax chains [B, M, b-1] (target ids). z None: M = K blocks per row, chain m
    drafts with branch m on its own prefix (mixture); else M = 1, branch z (greedy-branch)."""

    def pick(branch, _):  # branch [B, M, K, H]
        if z is None:
            m = branch.shape[1]
            h = branch[:, jnp.arange(m), jnp.arange(m)]  # [B, K, H]
        else:
            h = jnp.take_along_axis(branch, z[:, None, None, None], axis=2)[:, :, 0]
        idx = jnp.argmax(draft_vocab.draft_logits(tparams, dv, h, tcfg), axis=-1)
        return draft_vocab.to_target_ids(dv, idx).astype(jnp.int32), None

    chains, _ = left_to_right(core, tparams, start, anchor_pos, cache, pick, None, dcfg=dcfg)
    return chains


def sampled_chain(core, dv, tparams, anchor: Array, anchor_pos: Array, cache, start,
                  z: Array, noise: Array, every_branch: bool, temperature: float, *,
                  tcfg: TargetConfig, dcfg: DrafterConfig) -> tuple[Array, Array]:
    """One sampled prefix per row (start of one block per row) drawn from branch z with
    Gumbel noise [B, b-1, N]: (drafts [B, b-1] target ids, log q [B, K', b-1, N], the q
    each draft was drawn from given the drafted prefix: every branch's (K' = K) or branch
    z's (K' = 1)). anchor [B]: the block's anchor (unused here: it is in `start`)."""
    del anchor

    def pick(branch, g):  # branch [B, 1, K, H]; g [B, N]
        h = branch[:, 0] if every_branch else jnp.take_along_axis(
            branch[:, 0], z[:, None, None], axis=1)  # [B, K', H]
        log_q = jax.nn.log_softmax(draft_vocab.draft_logits(tparams, dv, h, tcfg)
                                   / temperature, axis=-1)  # [B, K', N]
        chosen = (jnp.take_along_axis(log_q, z[:, None, None], axis=1) if every_branch
                  else log_q)[:, 0]
        tok = draft_vocab.to_target_ids(dv, jnp.argmax(chosen + g, axis=-1))
        return tok.astype(jnp.int32)[:, None], log_q

    chains, log_q = left_to_right(core, tparams, start, anchor_pos, cache, pick,
                                  jnp.moveaxis(noise, 1, 0), dcfg=dcfg)
    return chains[:, 0], jnp.moveaxis(log_q, 0, 2)  # [B, K', P, N]


def draft(core, dv, tparams, anchor: Array, anchor_pos: Array, cache, keys,
          tcfg: TargetConfig, dcfg: DrafterConfig,
          sampling: SamplingConfig) -> tuple[Array, Array]:
    """The drafts [B, b-1] and dense proposal [B, b-1, V] of a causal-block drafter
    (called by sampler._trained_draft)."""
    k_cat, k_draft = keys[0], keys[1]
    vocab, k = tcfg.vocab_size, dcfg.num_categories
    mode = sampling.verify_mode
    sampled = sampling.temperature > 0  # at T = 0 every mode drafts argmaxes
    sample_drafts = sampled and mode in ("sampled-branch", "sampled-mixture")
    every_branch = mode in ("mixture", "sampled-mixture")
    chains_per_row = k if every_branch and not sample_drafts else 1
    anchor_pos = anchor_pos.astype(jnp.int32)
    start, prior = first_pass(core, tparams, anchor, anchor_pos, cache, chains_per_row,
                              dcfg=dcfg)
    draw_logp = jax.nn.log_softmax(prior.astype(jnp.float32) / sampling.category_temperature,
                                   axis=-1)  # [B, K]: pi', the law z is drawn from
    z = jax.random.categorical(k_cat, draw_logp, axis=-1)
    if sample_drafts:
        n = vocab if dv is None else dv["ids"].shape[0]
        noise = jax.random.gumbel(k_draft, (anchor.shape[0], dcfg.block_size - 1, n),
                                  jnp.float32)
        drafts, log_q = sampled_chain(core, dv, tparams, anchor, anchor_pos, cache, start, z,
                                      noise, every_branch, sampling.draft_temperature,
                                      tcfg=tcfg, dcfg=dcfg)
        probs = draft_vocab.to_target_probs(dv, jnp.exp(log_q), vocab)  # [B, K', P, V]
        if not every_branch:
            return drafts, probs[:, 0]
        return drafts, verify.mixture_proposal(None, probs, drafts, jnp.exp(draw_logp), vocab)
    chains = greedy_chains(core, dv, tparams, anchor_pos, cache, start,
                           None if every_branch else z, tcfg=tcfg, dcfg=dcfg)
    return verify.greedy_chain_proposal(chains, z, jnp.exp(draw_logp), vocab, every_branch)
