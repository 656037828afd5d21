"""Speculative verification: accept / reject a drafted block exactly losslessly.

Notation (docs/METHOD.md section 3): the anchor sits at position s; the drafter proposed
d_1..d_{b-1}; the target scored [anchor, d_1..d_{b-1}] and gives its *sampling*
distributions p_1..p_b (p_i for position s + i). Q_i is the proposal's conditional for
position i given the drafted prefix. For i = 1..b-1, d_i is accepted with probability
alpha_i = min(1, p_i(d_i) / Q_i(d_i)); at the first rejection a token is drawn from the
residual normalise(max(0, p_i - Q_i)); if every draft is accepted a bonus token is drawn
from p_b. This is the standard rejection-sampling argument applied position by position:
conditioned on the accepted prefix, the emitted token is distributed exactly as p_i.

Every mode reduces to a dense proposal Q [B, b-1, V] (float32 probabilities):
  * greedy-branch: Q_i = one-hot(d_i)
  * sampled-branch: Q_i = q_i(. | z) at the draft temperature
  * mixture: Q_i = sum_z post(z | d_<i) q_i(. | z), the exact conditional of the joint
    the draft was drawn from (see `mixture_proposal`), with greedy branches (q_i(. | z)
    = one-hot of branch z's argmax);
  * sampled-mixture: the same with d_i ~ q_i(. | z) at the draft temperature (the mode
    whose expected acceptance `al_estimate_mixture` estimates from data).
Temperature 0 is the argmax prefix match (`verify_greedy`).
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

Array = jax.Array


def _check_block(fn: str, target: Array, drafts: Array) -> None:
    """target [B, b, V] (logits or probabilities) and drafts [B, b-1] int: trace-time checks."""
    chex.assert_rank(target, 3, custom_message=f"{fn}: the target's scores must be "
                     "[batch, block, vocab]")
    chex.assert_type(target, float, custom_message=f"{fn}: the target's scores must be "
                     "floating point")
    b, blk = target.shape[:2]
    chex.assert_shape(drafts, (b, blk - 1), custom_message=f"{fn}: drafts must be "
                      f"[batch, block - 1] = {(b, blk - 1)} for target scores "
                      f"{tuple(target.shape)}")
    chex.assert_type(drafts, int, custom_message=f"{fn}: drafts must be integer token ids")


class Verdict(NamedTuple):
    num_accepted: Array  # [B] int32 in [0, b-1]: accepted drafts (leading run)
    next_token: Array  # [B] int32: residual draw at the first rejection, or the bonus
    alphas: Array  # [B, b-1] float32: acceptance probability of each draft
    expected_accepted: Array  # [B] float32: sum_k prod_{i<=k} alpha_i


def leading_run(accepted: Array) -> Array:
    """accepted [B, n] bool -> [B] int32 length of the leading run of True."""
    return jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=-1), axis=-1)


def expected_accepted(alphas: Array) -> Array:
    """Exact expected number of accepted drafts for this draft: sum_k prod_{i<=k} alpha_i."""
    return jnp.sum(jnp.cumprod(alphas, axis=-1), axis=-1)


def verify_greedy(target_logits: Array, drafts: Array) -> Verdict:
    """Temperature 0: accept the longest prefix equal to the target's argmax.

    target_logits: [B, b, V]; drafts: [B, b-1] int32.
    """
    _check_block("verify_greedy", target_logits, drafts)
    best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, b]
    match = drafts == best[:, :-1]
    n = leading_run(match)
    next_token = jnp.take_along_axis(best, n[:, None], axis=1)[:, 0]
    alphas = match.astype(jnp.float32)
    return Verdict(n, next_token, alphas, expected_accepted(alphas))


def verify_block(rng_accept: Array, rng_residual: Array, target_probs: Array, drafts: Array,
                 proposal: Array) -> Verdict:
    """Lossless verification against a dense proposal.

    target_probs: [B, b, V] float32 sampling probabilities p_1..p_b.
    drafts: [B, b-1] int32; proposal: [B, b-1, V] float32 Q_1..Q_{b-1} (rows sum to 1,
    and Q_i(d_i) > 0 since d_i was drawn from Q_i).
    Independent keys for the acceptance uniforms and the residual / bonus draw.
    All of it runs in float32: narrower inputs (bfloat16 probabilities) are upcast first
    (a no-op for float32 inputs).
    """
    _check_block("verify_block", target_probs, drafts)
    chex.assert_shape(proposal, drafts.shape + target_probs.shape[-1:],
                      custom_message="verify_block: proposal must be [batch, block - 1, vocab] "
                                     f"= {drafts.shape + target_probs.shape[-1:]}")
    chex.assert_type(proposal, float, custom_message="verify_block: proposal must be "
                     "floating point (probabilities)")
    target_probs = target_probs.astype(jnp.float32)
    proposal = proposal.astype(jnp.float32)
    b1 = drafts.shape[1]
    p_draft = jnp.take_along_axis(target_probs[:, :b1], drafts[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(proposal, drafts[..., None], axis=-1)[..., 0]
    alphas = jnp.where(q_draft > 0, jnp.minimum(1.0, p_draft / jnp.maximum(q_draft, 1e-30)),
                       0.0)
    uniforms = jax.random.uniform(rng_accept, drafts.shape, jnp.float32)
    n = leading_run(uniforms < alphas)

    # The distribution to draw the emitted token from: residual at the first rejection,
    # p_b (the bonus) when all drafts are accepted.
    residual = jnp.maximum(target_probs[:, :b1] - proposal, 0.0)  # [B, b-1, V]
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # mass == 0 only when p_i == Q_i, where rejection has probability 0; fall back to p_i.
    residual = jnp.where(mass > 0, residual / jnp.maximum(mass, 1e-30), target_probs[:, :b1])
    choices = jnp.concatenate([residual, target_probs[:, b1:]], axis=1)  # [B, b, V]
    dist = jnp.take_along_axis(choices, n[:, None, None], axis=1)[:, 0]  # [B, V]
    log_dist = jnp.where(dist > 0, jnp.log(jnp.maximum(dist, 1e-38)), -jnp.inf)
    next_token = jax.random.categorical(rng_residual, log_dist, axis=-1).astype(jnp.int32)
    return Verdict(n, next_token, alphas, expected_accepted(alphas))


def one_hot_proposal(drafts: Array, vocab_size: int) -> Array:
    """greedy-branch: Q_i = one-hot(d_i). drafts [B, n] -> [B, n, V] float32."""
    chex.assert_rank(drafts, 2, custom_message="one_hot_proposal: drafts must be [batch, n]")
    chex.assert_type(drafts, int, custom_message="one_hot_proposal: drafts must be integer ids")
    return jax.nn.one_hot(drafts, vocab_size, dtype=jnp.float32)


def greedy_chain_proposal(chains: Array, z: Array, draw_probs: Array, vocab_size: int,
                          every_branch: bool) -> tuple[Array, Array]:
    """Drafts and proposal from argmax chains drafted left to right (serial drafters):
    chains [B, K, n] every branch's chain (mixture: Q is the posterior-weighted one-hot)
    or [B, 1, n] the drawn branch z's (greedy-branch: Q = one-hot of the drafts)."""
    if every_branch:
        drafts = jnp.take_along_axis(chains, z[:, None, None], axis=1)[:, 0]
        return drafts, mixture_proposal(chains, None, drafts, draw_probs, vocab_size)
    drafts = chains[:, 0]
    return drafts, one_hot_proposal(drafts, vocab_size)


def mixture_proposal(branch_tokens: Array, branch_probs: Array | None, drafts: Array,
                     draw_probs: Array, vocab_size: int) -> Array:
    """Exact conditional of the latent mixture: Q_i = sum_z post(z | d_<i) q_i(. | z).

    branch_tokens: [B, K, n] int32, each branch's greedy tokens (used when
    `branch_probs` is None: q_i(. | z) = one-hot(branch_tokens[z, i])).
    branch_probs: [B, K, n, V] float32 per-branch distributions, or None.
    drafts: [B, n] the drafted tokens; draw_probs: [B, K] the distribution pi' the
    category was actually drawn from (prior at category temperature).
    post(z | d_<i) is proportional to pi'(z) prod_{j<i} q_j(d_j | z).
    Computed in float32 whatever the input dtype; returns [B, n, V] float32.
    """
    chex.assert_rank(drafts, 2, custom_message="mixture_proposal: drafts must be [batch, n]")
    chex.assert_type(drafts, int, custom_message="mixture_proposal: drafts must be integer ids")
    chex.assert_rank(draw_probs, 2, custom_message="mixture_proposal: draw_probs must be "
                     "[batch, K]")
    (b, n), k = drafts.shape, draw_probs.shape[1]
    chex.assert_shape(draw_probs, (b, k), custom_message=f"mixture_proposal: draw_probs must "
                      f"be [batch, K] with the batch {b} of drafts")
    if branch_probs is None:
        chex.assert_not_both_none(branch_tokens, branch_probs,
                                  custom_message="mixture_proposal: pass branch_tokens "
                                                 "(greedy branches) or branch_probs")
        chex.assert_shape(branch_tokens, (b, k, n), custom_message="mixture_proposal: "
                          f"branch_tokens must be [batch, K, n] = {(b, k, n)}")
        chex.assert_type(branch_tokens, int, custom_message="mixture_proposal: branch_tokens "
                         "must be integer ids")
        branch_probs = jax.nn.one_hot(branch_tokens, vocab_size, dtype=jnp.float32)
    v = vocab_size if isinstance(vocab_size, int) else None  # None: any (a traced size)
    chex.assert_shape(branch_probs, (b, k, n, v), custom_message="mixture_proposal: "
                      f"branch_probs must be [batch, K, n, vocab] = {(b, k, n, v)}")
    branch_probs = branch_probs.astype(jnp.float32)
    draw_probs = draw_probs.astype(jnp.float32)
    q_at_draft = jnp.take_along_axis(
        branch_probs, jnp.broadcast_to(drafts[:, None, :, None], branch_probs.shape[:3] + (1,)),
        axis=-1)[..., 0]  # [B, K, n]
    # likelihood of the drafted prefix d_<i under each branch: exclusive cumulative product
    prefix_lik = jnp.cumprod(
        jnp.concatenate([jnp.ones_like(q_at_draft[..., :1]), q_at_draft[..., :-1]], axis=-1),
        axis=-1)  # [B, K, n]
    weights = draw_probs[:, :, None] * prefix_lik
    post = weights / jnp.maximum(jnp.sum(weights, axis=1, keepdims=True), 1e-30)
    return jnp.einsum("bkn,bknv->bnv", post, branch_probs)
