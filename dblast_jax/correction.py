"""Drafting with a serial correction head (`DrafterConfig.correction = "previous-token"`).

The drafter's parallel pass gives every block position's branch state h_i as before.
The correction head (`models/drafter.py`, `Correction`) then adds to position i's logits
a rank-r term that depends on the token drafted at position i - 1 (the anchor for i = 1):

    logits_i = lm_head(h_i) + silu(e(x_{i-1}) W_p + h_i W_c) @ lm_head(W_o)

so the drafts are taken left to right, in b - 1 serial steps of a `lax.scan`. Everything
with the vocabulary in it comes from the parallel part: lm_head(h_i) for all positions
(the block's head pass of today) and the rank-r basis lm_head(W_o) [r, V]. The basis
depends on the parameters only; inside the sampler's while_loop, XLA's loop-invariant
code motion computes it once per generate call (seen in the compiled CPU program). A
serial step is an embedding-row lookup, an [H] x [H, r] product and an [r] x [r, V]
product: never a drafter pass nor an LM head row. With a draft-time vocabulary
(dblast_jax/draft_vocab.py) both head products run over its N ids only. The rms in
`models/drafter.py` normalises e(x_{i-1}) (no learned scale).

Exactness (docs/METHOD.md section 3.1). The proposal recorded for position i is the
corrected q_i that the draft was actually taken from, given the drafted prefix, so
`verify.verify_block` checks each draft against its own conditional:

* `greedy-branch`: z ~ pi', then d_i = argmax of branch z's corrected logits given
  d_{i-1}; Q_i = one-hot(d_i).
* `sampled-branch`: d_i ~ softmax(corrected logits / T_d) given d_{i-1}; Q_i is that
  softmax.
* `mixture`: every branch drafts its own greedy chain (its own previous tokens), d is
  branch z's chain, and Q_i = sum_z post(z | d_<i) one-hot(chain_z[i]): the joint the
  draft came from is sum_z pi'(z) [d = chain_z], whose conditionals these are.
* `sampled-mixture`: d is sampled from branch z, and every branch's corrected q_i is
  evaluated on the same drafted prefix; Q_i = sum_z post(z | d_<i) q_i(. | z, d_{i-1})
  with post proportional to pi'(z) prod_{j<i} q_j(d_j | z, d_{j-1}), the exact
  conditional of the autoregressive mixture sum_z pi'(z) prod_i q_i(d_i | z, d_{i-1}).
* T = 0: the argmax chains, checked by prefix match against the target's argmax.

The draft draws use the same key and noise shape as the uncorrected sampler (Gumbel noise
[B, b-1, N] of the draft stream, `jax.random.categorical` being argmax(logits + Gumbel)):
a correction head whose W_o is zero drafts exactly what the drafter without it drafts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dblast_jax import draft_vocab, verify
from dblast_jax.config import DrafterConfig, SamplingConfig, TargetConfig
from dblast_jax.models import drafter as drafter_lm

Array = jax.Array


def serial_scan(base: Array, ctx: Array, basis: Array, anchor: Array, prev_features,
                to_target_ids, *, noise: Array | None = None, branch: Array | None = None,
                temperature: float = 1.0) -> tuple[Array, Array | None]:
    """Take the drafts left to right.

    base [B, M, P, N] float32 uncorrected logits of M chains (M = 1: the chosen branch;
    M = K: every branch); ctx [B, M, P, r] = h W_c; basis [r, N] = lm_head(W_o); anchor
    [B] the anchor token (the previous token of position 1); prev_features: target ids
    [..] -> e W_p [.., r]; to_target_ids: draft-vocabulary index -> target id.

    noise None: greedy chains, each of the M chains feeds its own argmax forward; returns
    (tokens [B, M, P] target ids, None).
    noise [B, P, N] (Gumbel): sampled at `temperature`, one shared prefix drawn from chain
    `branch` [B] (0 when M = 1), every chain evaluated on it; returns (drafts [B, P],
    log q [B, M, P, N] of every chain given that prefix: the q each draft was drawn from).
    """
    bsz, m = base.shape[:2]
    xs = (jnp.moveaxis(base, 2, 0), jnp.moveaxis(ctx, 2, 0))
    sampled = noise is not None
    if sampled:
        xs = xs + (jnp.moveaxis(noise, 1, 0),)
        branch = jnp.zeros((bsz,), jnp.int32) if branch is None else branch.astype(jnp.int32)

    def step(prev, x):  # prev [B, M] target ids
        logits = x[0] + jnp.einsum("bmr,rn->bmn", jax.nn.silu(prev_features(prev) + x[1]),
                                   basis, preferred_element_type=jnp.float32)
        if not sampled:
            tok = to_target_ids(jnp.argmax(logits, axis=-1))  # [B, M]
            return tok, tok
        log_q = jax.nn.log_softmax(logits / temperature, axis=-1)  # [B, M, N]
        chosen = jnp.take_along_axis(log_q, branch[:, None, None], axis=1)[:, 0]
        tok = to_target_ids(jnp.argmax(chosen + x[2], axis=-1))  # [B]
        return jnp.broadcast_to(tok[:, None], (bsz, m)), (tok, log_q)

    init = jnp.broadcast_to(anchor.astype(jnp.int32)[:, None], (bsz, m))
    _, out = jax.lax.scan(step, init, xs)
    if not sampled:
        return jnp.moveaxis(out, 0, 2), None  # [B, M, P]
    return jnp.moveaxis(out[0], 0, 1), jnp.moveaxis(out[1], 0, 2)


def draft(core, dv, tparams, hidden: Array, draw_logp: Array, z: Array, anchor: Array,
          k_draft: Array, tcfg: TargetConfig, dcfg: DrafterConfig,
          sampling: SamplingConfig) -> tuple[Array, Array]:
    """The drafts [B, b-1] and dense proposal [B, b-1, V] of a drafter with a correction
    head (called by sampler._trained_draft). hidden [B, K, b-1, H] are the parallel
    pass's branch states, draw_logp [B, K] log pi' and z [B] the drawn category."""
    vocab = tcfg.vocab_size
    mode = sampling.verify_mode
    sampled = sampling.temperature > 0  # at T = 0 every mode drafts argmaxes
    every_branch = mode in ("mixture", "sampled-mixture")
    h = hidden if every_branch else drafter_lm.select_branch(hidden, z)[:, None]
    base = draft_vocab.draft_logits(tparams, dv, h, tcfg)  # [B, M, P, N]
    ctx, w_out = drafter_lm.correction_parts(core, h, drafter_config=dcfg)
    basis = draft_vocab.draft_logits(tparams, dv, w_out, tcfg)  # [r, N]
    prev_features = lambda toks: drafter_lm.correction_prev_features(  # noqa: E731
        core, tparams, toks, drafter_config=dcfg)
    to_ids = lambda idx: draft_vocab.to_target_ids(dv, idx)  # noqa: E731
    anchor = anchor.astype(jnp.int32)
    if sampled and mode in ("sampled-branch", "sampled-mixture"):
        noise = jax.random.gumbel(k_draft, (h.shape[0],) + base.shape[2:], jnp.float32)
        drafts, log_q = serial_scan(base, ctx, basis, anchor, prev_features, to_ids,
                                    noise=noise, branch=z if every_branch else None,
                                    temperature=sampling.draft_temperature)
        probs = draft_vocab.to_target_probs(dv, jnp.exp(log_q), vocab)  # [B, M, P, V]
        if mode == "sampled-branch":
            return drafts, probs[:, 0]
        return drafts, verify.mixture_proposal(None, probs, drafts, jnp.exp(draw_logp), vocab)
    chains, _ = serial_scan(base, ctx, basis, anchor, prev_features, to_ids)  # [B, M, P]
    return verify.greedy_chain_proposal(chains, z, jnp.exp(draw_logp), vocab, every_branch)
