"""Training objectives for block drafters (docs/METHOD.md section 4).

Every function here is a pure, jittable function of arrays laid out as

    logq          [B, A, K, P]  drafter branch z's log-prob of the data token x*_i
    prior_logits  [B, A, K]     category prior logits (pi = softmax(prior_logits))
    logp          [B, A, P]     target log-prob of x*_i given x*_<i at the verify temperature
    mask          [B, A, P] or [B, A]   True where a position (or anchor) is real

with B batch rows, A anchors per row, K mixture categories and P = b - 1 block positions
(block positions 1..b-1; position 0 is the anchor and gets no loss). Position p of the
arrays is block position i = p + 1. Nothing loops over prefixes in Python: the prefix
structure is a cumulative sum (prefix weights) and a triangular logsumexp (tails).

Derivation
----------
Sequential verification of a draft d_1..d_P drawn from branch z (``sampled-branch``):
position i is accepted with probability min(1, p_i(d_i | d_<i) / q_{z,i}(d_i)), and only
if all earlier ones were. So the probability that the first k drafts are all accepted is

    A_{z,k} = sum_{d_1..d_k} prod_{i<=k} q_{z,i}(d_i) min(1, p_i / q_{z,i})
            = sum_{d_1..d_k} prod_{i<=k} min(q_{z,i}(d_i), p_i(d_i | d_<i)),

and the expected number of accepted drafts is AL = sum_z pi_z sum_k A_{z,k}.
Rewrite the sum as an expectation over the target's own text x* ~ p:

    A_{z,k} = E_{x*~p}[ prod_{i<=k} min(1, q_{z,i}(x*_i) / p_i(x*_i | x*_<i)) ] = E[W_{z,k}],

so with alpha_{z,i} = min(1, q/p) (clipped importance ratio, log alpha = min(0, logq - logp))
and W_{z,k} = prod_{i<=k} alpha_{z,i} (log W = cumsum of log alpha: every prefix at once),

    AL_hat = sum_z pi_z sum_k W_{z,k}                                   (al_estimate)

is an unbiased estimate of AL from one data block, needing only the target's log-probs of
the data tokens (which do not depend on the drafter and can be stored with the data).

Why a log-domain surrogate rather than -AL_hat: W_{z,k} is a product of k ratios, so for a
weak drafter it is tiny and d W / d theta = W * d log W vanishes with it. Taking the log of a
sum instead gives a self-normalised gradient:

    S_k = log sum_{z, j>=k} pi_z W_{z,j}                                (al_surrogate)
    d S_k = sum_{z, j>=k} [pi_z W_{z,j} / sum(...)] * d(log pi_z + log W_{z,j}),

a convex combination of log-gradients whose weights sum to 1 however small the W are, so
the signal does not vanish when drafter and target overlap little. S_k is the log of the
expected accepted length counted from prefix k on: with W_k = sum_z pi_z W_{z,k} the mixture
prefix weight and l_k = sum_{j>=k} W_j / W_k the conditional accepted length given prefix
k was accepted, S_k = log W_k + log l_k (a reverse cumulative logsumexp over positions).

Why truncation: W_k is a product of importance ratios; for long prefixes it is a
high-variance estimate resting on a single sample, and log of a near-zero weight has a
huge, noisy magnitude that would dominate the mean. Only prefixes whose mixture weight
W_k >= tau (equivalently logsumexp_z(log pi_z + log W_{z,k}) >= log tau) enter the loss;
as W_k is non-increasing in k, the retained prefixes are always 1..k_max. The retention
test is a discrete choice and carries no gradient. Loss = -(sum of retained S_k) /
max(number retained, 1), pooled over the whole batch: a batch with no retained prefix
contributes exactly 0 (and a zero gradient), never 0/0.

Mixture NLL: -log sum_z pi_z prod_i q_{z,i}(x*_i) = -logsumexp_z(log pi_z + sum_i logq),
optionally with position weights w_i on the log-probs inside the product. With K = 1 it is
the plain cross-entropy summed over positions; the DFlash loss is the K = 1 case with
w_i = exp(-(i - 1) / gamma).

Why -inf is safe: filtered tokens (top-k / top-p) give log-probs of -inf. The code never
forms inf - inf or 0 * inf: log alpha is set by `jnp.where` (q = 0 -> log alpha = -inf, the
draft can never be proposed; p = 0 with q > 0 -> log alpha = 0, i.e. min(1, q/0) = 1), and
every logsumexp is `safe_logsumexp`, which returns -inf with a zero gradient when all
terms are -inf instead of log(0) with an infinite one. `jnp.where` only routes gradients,
so the discarded branch never multiplies an infinity into a gradient. Invalid positions and
anchors (padding, beyond the sequence end) are masked the same way.

Mask semantics: a mask position is a real data token. For NLL / DFlash, masked positions
are dropped from the product / sum. For the AL terms a prefix k needs every position
1..k to be real, so the position mask is made prefix-closed (cumulative product). An
anchor is valid when it has at least one valid position; means are over valid anchors
("document normalisation": every valid anchor counts once, whatever its length).
"""

from __future__ import annotations

from typing import Optional

import chex
import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

__all__ = [
    "safe_logsumexp",
    "masked_anchor_mean",
    "dflash_position_weights",
    "dflash_loss",
    "dflash_loss_per_anchor",
    "mixture_nll",
    "mixture_nll_per_anchor",
    "log_prefix_weights",
    "greedy_accepted",
    "al_estimate",
    "predicted_tau",
    "al_surrogate",
    "al_surrogate_terms",
    "combined_loss",
    "mixture_posterior",
    "topk_distill_per_anchor",
    "linear_warmup_schedule",
    "tau_schedule",
]


# ----------------------------------------------------------------------------- helpers


def _as_float(x) -> Array:
    """float32 for anything narrower (bf16 logits), float64 kept (x64 gradient tests)."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def safe_logsumexp(x: Array, axis: int) -> Array:
    """logsumexp over `axis` that returns -inf with a zero (not NaN) gradient when every
    term is -inf. The max shift is constant for the gradient (the value does not depend on
    it), so the gradient is exactly softmax(x) where any term is finite."""
    mx = jnp.max(x, axis=axis, keepdims=True)
    mx = lax.stop_gradient(jnp.where(jnp.isfinite(mx), mx, jnp.zeros_like(mx)))
    s = jnp.sum(jnp.exp(x - mx), axis=axis)
    positive = s > 0
    out = jnp.log(jnp.where(positive, s, jnp.ones_like(s))) + jnp.squeeze(mx, axis)
    return jnp.where(positive, out, -jnp.inf)


def _check_logq(logq: Array, name: str = "logq") -> Array:
    logq = _as_float(logq)
    if logq.ndim != 4:
        raise ValueError(f"{name} must be [batch, anchors, K, positions], got shape {logq.shape}")
    return logq


def _position_mask(mask, shape_bap: tuple[int, int, int]) -> Array:
    """mask None / [B, A] / [B, A, P] (bool or 0-1) -> bool [B, A, P]."""
    if mask is None:
        return jnp.ones(shape_bap, bool)
    m = jnp.asarray(mask)
    if m.ndim == 2:
        if m.shape != shape_bap[:2]:
            raise ValueError(f"anchor mask shape {m.shape} does not match [batch, anchors] = "
                             f"{shape_bap[:2]} of the log-probs")
        m = jnp.broadcast_to(m[..., None], shape_bap)
    elif m.ndim != 3 or m.shape != shape_bap:
        raise ValueError(f"mask shape {m.shape} must be [batch, anchors] = {shape_bap[:2]} or "
                         f"[batch, anchors, positions] = {shape_bap}")
    return m.astype(bool)


def _prefix_closed(valid: Array) -> Array:
    """valid [.., P] -> prefix k valid iff positions 1..k are all valid."""
    return jnp.cumprod(valid.astype(jnp.int32), axis=-1).astype(bool)


def _log_prior(prior_logits: Optional[Array], shape_bak: tuple[int, int, int], dtype) -> Array:
    if prior_logits is None:
        if shape_bak[2] != 1:
            raise ValueError(f"prior_logits is required for K = {shape_bak[2]} categories")
        return jnp.zeros(shape_bak, dtype)
    prior_logits = _as_float(prior_logits)
    if prior_logits.shape != shape_bak:
        raise ValueError(f"prior_logits shape {prior_logits.shape} must be [batch, anchors, K] = "
                         f"{shape_bak} to match logq")
    return jax.nn.log_softmax(prior_logits, axis=-1)


def _check_logp(logp: Array, shape_bap: tuple[int, int, int]) -> Array:
    logp = _as_float(logp)
    if logp.shape != shape_bap:
        raise ValueError(f"logp shape {logp.shape} must be [batch, anchors, positions] = "
                         f"{shape_bap} to match logq")
    return logp


def masked_anchor_mean(per_anchor: Array, anchor_valid: Array) -> Array:
    """Mean of per-anchor values [B, A] over valid anchors; 0 when there are none."""
    chex.assert_equal_shape([per_anchor, anchor_valid],
                            custom_message="masked_anchor_mean: per_anchor values and "
                                           "anchor_valid must both be [batch, anchors]")
    valid = anchor_valid.astype(bool)
    total = jnp.sum(jnp.where(valid, per_anchor, jnp.zeros_like(per_anchor)))
    return total / jnp.maximum(jnp.sum(valid).astype(per_anchor.dtype), 1.0)


def _anchor_valid(pos_mask: Array) -> Array:
    return jnp.any(pos_mask, axis=-1)


# ----------------------------------------------------------------------------- NLL terms


def dflash_position_weights(num_positions: int, gamma: Optional[float]) -> Array:
    """w_i = exp(-(i - 1) / gamma) for block positions i = 1..num_positions (all 1 if gamma
    is None). DFlash uses gamma = 7 for b = 16 and 4 for b = 8."""
    i = jnp.arange(num_positions, dtype=jnp.float32)
    if gamma is None:
        return jnp.ones_like(i)
    if isinstance(gamma, (int, float)) and not gamma > 0:
        raise ValueError(f"gamma must be > 0 (or None for uniform weights), got {gamma}")
    return jnp.exp(-i / gamma)


def dflash_loss_per_anchor(logq: Array, mask=None, gamma: Optional[float] = 7.0) -> Array:
    """Per-anchor DFlash loss [B, A]: sum over valid positions of w_i * (-log q_i(x*_i)).

    logq: [B, A, P] or [B, A, 1, P] (K = 1). Invalid anchors give 0."""
    logq = _as_float(logq)
    if logq.ndim == 4:
        if logq.shape[2] != 1:
            raise ValueError(f"dflash_loss is the K = 1 loss; got logq with K = {logq.shape[2]} "
                             f"(shape {logq.shape}); use mixture_nll for K > 1")
        logq = logq[:, :, 0, :]
    if logq.ndim != 3:
        raise ValueError(f"logq must be [batch, anchors, positions] or [batch, anchors, 1, "
                         f"positions], got shape {logq.shape}")
    valid = _position_mask(mask, logq.shape)
    w = dflash_position_weights(logq.shape[-1], gamma).astype(logq.dtype)
    ce = jnp.where(valid, -logq, jnp.zeros_like(logq))
    return jnp.sum(w * ce, axis=-1)


def dflash_loss(logq: Array, mask=None, gamma: Optional[float] = 7.0) -> Array:
    """DFlash position-decayed cross-entropy, averaged over valid anchors (scalar)."""
    per = dflash_loss_per_anchor(logq, mask, gamma)
    shape = per.shape + (jnp.shape(logq)[-1],)
    return masked_anchor_mean(per, _anchor_valid(_position_mask(mask, shape)))


def mixture_nll_per_anchor(logq: Array, prior_logits: Optional[Array], mask=None,
                           position_weights: Optional[Array] = None) -> Array:
    """Per-anchor -log sum_z pi_z prod_i q_{z,i}(x*_i)^{w_i}  [B, A]; invalid anchors give 0.

    position_weights: broadcastable to [B, A, P] (e.g. dflash_position_weights), or None."""
    logq = _check_logq(logq)
    b, a, k, p = logq.shape
    valid = _position_mask(mask, (b, a, p))
    log_pi = _log_prior(prior_logits, (b, a, k), logq.dtype)
    if position_weights is None:
        w = jnp.ones((b, a, p), logq.dtype)
    else:
        chex.assert_is_broadcastable(jnp.shape(position_weights), (b, a, p))
        w = jnp.broadcast_to(_as_float(position_weights).astype(logq.dtype), (b, a, p))
    use = (valid & (w != 0))[:, :, None, :]
    # where() before the multiply: w * (-inf) with w = 0 or on a masked slot would be NaN.
    lq = jnp.where(use, logq, jnp.zeros_like(logq))
    loglik = jnp.sum(jnp.where(use, w[:, :, None, :] * lq, jnp.zeros_like(lq)), axis=-1)
    nll = -safe_logsumexp(log_pi + loglik, axis=-1)
    return jnp.where(_anchor_valid(valid), nll, jnp.zeros_like(nll))


def mixture_nll(logq: Array, prior_logits: Optional[Array], mask=None,
                position_weights: Optional[Array] = None) -> Array:
    """Mixture NLL averaged over valid anchors (scalar). +inf only if the data block has
    probability 0 under every branch (gradients stay finite)."""
    per = mixture_nll_per_anchor(logq, prior_logits, mask, position_weights)
    b, a, _, p = jnp.shape(logq)
    return masked_anchor_mean(per, _anchor_valid(_position_mask(mask, (b, a, p))))


# ----------------------------------------------------------------------------- AL terms


def log_prefix_weights(logq: Array, logp: Array, mask=None) -> tuple[Array, Array]:
    """log W_{z,k} = sum_{i<=k} min(0, logq_{z,i} - logp_i)  ->  (log_W [B, A, K, P],
    prefix_valid [B, A, P]). Prefixes touching an invalid position have log W = -inf."""
    logq = _check_logq(logq)
    b, a, k, p = logq.shape
    logp = _check_logp(logp, (b, a, p)).astype(logq.dtype)
    prefix_valid = _prefix_closed(_position_mask(mask, (b, a, p)))
    lp = logp[:, :, None, :]
    q_zero = logq == -jnp.inf
    p_zero = lp == -jnp.inf
    # Finite stand-ins so the discarded branch never computes inf - inf.
    lq_safe = jnp.where(q_zero, jnp.zeros_like(logq), logq)
    lp_safe = jnp.where(p_zero, jnp.zeros_like(lp), lp)
    log_alpha = jnp.minimum(lq_safe - lp_safe, 0.0)
    log_alpha = jnp.where(p_zero, jnp.zeros_like(log_alpha), log_alpha)  # min(1, q/0) = 1
    log_alpha = jnp.where(q_zero, -jnp.inf, log_alpha)                    # q = 0: never proposed
    pv = prefix_valid[:, :, None, :]
    log_alpha = jnp.where(pv, log_alpha, jnp.zeros_like(log_alpha))
    log_w = jnp.cumsum(log_alpha, axis=-1)
    log_w = jnp.where(pv, log_w, -jnp.inf)
    return log_w, prefix_valid


def prefix_acceptance(logq: Array, prior_logits: Optional[Array], logp: Array,
                      mask=None) -> Array:
    """Per-anchor sum_z pi_z W_{z,k}: the probability that the first k drafts are all
    accepted, k = 1..P  [B, A, P] (0 where the prefix is not real). Where along the block
    a drafter loses acceptance; its sum over k is `al_estimate`."""
    log_w, _ = log_prefix_weights(logq, logp, mask)
    b, a, k, _ = log_w.shape
    log_pi = _log_prior(prior_logits, (b, a, k), log_w.dtype)
    return jnp.sum(jnp.exp(log_pi[..., None] + log_w), axis=-2)


def al_estimate(logq: Array, prior_logits: Optional[Array], logp: Array, mask=None) -> Array:
    """Per-anchor AL_hat = sum_z pi_z sum_k W_{z,k}  [B, A] (0 for invalid anchors).

    Unbiased for the expected number of accepted drafts under `sampled-branch` verification
    when the data block x* is drawn from the target at the verify temperature."""
    return jnp.sum(prefix_acceptance(logq, prior_logits, logp, mask), axis=-1)


def greedy_accepted(hit: Array, pi: Array, mask: Array) -> Array:
    """Per-anchor leading run of drafts equal to the data tokens, prior-weighted over
    branches  [B, A]. hit: [B, A, K, P] (the branch's argmax == the data token), pi:
    [B, A, K] branch weights, mask: [B, A, P] real positions (a run stops at the first
    unreal one). When the data are the target's own greedy text (a T = 0 corpus), this is
    the number of drafts greedy verification accepts (for K > 1 in expectation over the
    branch, which the sampler draws from pi), with no generation: greedy tau - 1 held out."""
    ok = jnp.logical_and(hit, mask[:, :, None, :]).astype(jnp.float32)
    run = jnp.sum(jnp.cumprod(ok, axis=-1), axis=-1)  # [B, A, K]
    return jnp.einsum("bak,bak->ba", pi.astype(jnp.float32), run)


def predicted_tau(al_hat: Array) -> Array:
    """Acceptance length as reported (accepted drafts + the bonus token): 1 + AL."""
    return 1.0 + al_hat


def _log_tau(tau) -> Array:
    if isinstance(tau, (int, float)) and not tau >= 0:
        raise ValueError(f"AL truncation threshold tau must be >= 0, got {tau}")
    tau = _as_float(tau)
    return jnp.where(tau > 0, jnp.log(jnp.where(tau > 0, tau, 1.0)), -jnp.inf)


def _surrogate_parts(log_w: Array, log_pi: Array, prefix_valid: Array, tau) -> tuple[Array, Array]:
    """-> (S [B, A, P], retained [B, A, P] bool)."""
    log_mix = safe_logsumexp(log_pi[..., None] + log_w, axis=-2)  # log W_k, [B, A, P]
    p = log_mix.shape[-1]
    tail = jnp.arange(p)[None, :] >= jnp.arange(p)[:, None]        # [k, j]: j >= k
    tails = jnp.where(tail, log_mix[..., None, :], -jnp.inf)       # [B, A, k, j]
    s = safe_logsumexp(tails, axis=-1)                              # S_k, [B, A, P]
    gate = lax.stop_gradient(log_mix)
    retained = prefix_valid & (gate > -jnp.inf) & (gate >= _log_tau(tau).astype(gate.dtype))
    return s, retained


def al_surrogate_terms(logq: Array, prior_logits: Optional[Array], logp: Array, mask=None,
                       tau=0.0) -> tuple[Array, Array]:
    """Per-anchor pieces of the surrogate: (sum of retained S_k [B, A], retained count [B, A]).
    For custom reductions (gradient accumulation: add both over micro-batches, then divide)."""
    log_w, prefix_valid = log_prefix_weights(logq, logp, mask)
    b, a, k, _ = log_w.shape
    log_pi = _log_prior(prior_logits, (b, a, k), log_w.dtype)
    s, retained = _surrogate_parts(log_w, log_pi, prefix_valid, tau)
    s_sum = jnp.sum(jnp.where(retained, s, jnp.zeros_like(s)), axis=-1)
    return s_sum, jnp.sum(retained, axis=-1).astype(jnp.int32)


def al_surrogate(logq: Array, prior_logits: Optional[Array], logp: Array, mask=None,
                 tau=0.0) -> Array:
    """Truncated log-domain AL surrogate (scalar, to minimise):
    -(sum over retained (anchor, k) of S_k) / max(number retained, 1).

    Prefix k is retained when it is valid and its mixture weight W_k >= tau (> 0 too, so a
    retained S_k is always finite); tau = 0 keeps every reachable prefix. No retained prefix
    in the batch -> 0 with zero gradient."""
    s_sum, count = al_surrogate_terms(logq, prior_logits, logp, mask, tau)
    return -jnp.sum(s_sum) / jnp.maximum(jnp.sum(count), 1).astype(s_sum.dtype)


# ----------------------------------------------------------------------------- combined


def combined_loss(logq: Array, prior_logits: Optional[Array], logp: Optional[Array], mask=None,
                  *, lam=0.0, tau=0.0, position_weights: Optional[Array] = None
                  ) -> tuple[Array, dict[str, Array]]:
    """loss = mixture NLL + lam * AL surrogate, and metrics (all scalars):

    nll (the objective's NLL: position-weighted when position_weights is given),
    block_nll (unweighted mixture NLL per block, comparable across objectives),
    al_surrogate, al_estimate (mean over valid anchors), predicted_tau (1 + that),
    retained_fraction (retained prefixes / valid prefixes), valid_anchors, lam, tau, loss.
    With logp None only the NLL is used (no target log-probs available)."""
    logq = _check_logq(logq)
    b, a, k, p = logq.shape
    pos_mask = _position_mask(mask, (b, a, p))
    anchor_valid = _anchor_valid(pos_mask)
    nll = masked_anchor_mean(
        mixture_nll_per_anchor(logq, prior_logits, pos_mask, position_weights), anchor_valid)
    # the unweighted mixture NLL, comparable across objectives (== nll without weights)
    block_nll = nll if position_weights is None else masked_anchor_mean(
        mixture_nll_per_anchor(logq, prior_logits, pos_mask, None), anchor_valid)
    chex.assert_rank([lam, tau], 0, custom_message="combined_loss: lam and tau must be "
                     "scalars")
    lam_arr = jnp.asarray(lam, logq.dtype)
    metrics = {"nll": nll, "block_nll": block_nll, "lam": lam_arr,
               "valid_anchors": jnp.sum(anchor_valid).astype(jnp.int32)}
    if logp is None:
        metrics["loss"] = nll
        return nll, metrics
    log_w, prefix_valid = log_prefix_weights(logq, logp, pos_mask)
    log_pi = _log_prior(prior_logits, (b, a, k), logq.dtype)
    s, retained = _surrogate_parts(log_w, log_pi, prefix_valid, tau)
    n_ret = jnp.sum(retained)
    surrogate = -jnp.sum(jnp.where(retained, s, jnp.zeros_like(s))) / jnp.maximum(
        n_ret, 1).astype(s.dtype)
    al = jnp.sum(jnp.exp(log_pi[..., None] + log_w), axis=(-2, -1))
    al_mean = masked_anchor_mean(al, anchor_valid)
    loss = nll + lam_arr * surrogate
    metrics.update({
        "loss": loss,
        "al_surrogate": surrogate,
        "al_estimate": al_mean,
        "predicted_tau": predicted_tau(al_mean),
        "retained_fraction": n_ret / jnp.maximum(jnp.sum(prefix_valid), 1),
        "tau": jnp.asarray(tau, logq.dtype),
    })
    return loss, metrics


# ----------------------------------------------------------------------------- distillation


def mixture_posterior(logq: Array, prior_logits: Optional[Array], mask=None) -> Array:
    """log post(z | x*_<i) [B, A, K, P]: the mixture's branch posterior before position i,
    proportional to pi_z prod_{j<i} q_{z,j}(x*_j) (masked positions leave it alone).
    K = 1: zeros."""
    logq = _check_logq(logq)
    b, a, k, p = logq.shape
    pos_mask = _position_mask(mask, (b, a, p))
    lq = jnp.where(pos_mask[:, :, None, :], logq, 0.0)
    log_pi = _log_prior(prior_logits, (b, a, k), logq.dtype)
    prev = log_pi[..., None] + jnp.concatenate(
        [jnp.zeros_like(lq[..., :1]), jnp.cumsum(lq, axis=-1)[..., :-1]], axis=-1)
    norm = safe_logsumexp(prev, axis=2)[:, :, None, :]
    return jnp.where(jnp.isfinite(norm), prev - jnp.where(jnp.isfinite(norm), norm, 0.0),
                     -jnp.inf)


def topk_distill_per_anchor(logq_ids: Array, teacher_logp: Array, logq: Array,
                            prior_logits: Optional[Array], mask=None,
                            position_weights: Optional[Array] = None) -> tuple[Array, Array]:
    """Distillation from a top-k truncated teacher: (soft CE, KL) per anchor [B, A].

    logq_ids [B, A, K, P, k]: each branch's log q at the teacher's k token ids;
    teacher_logp [B, A, P, k]: the teacher's log p of those ids (tail mass 1 - sum p);
    logq [B, A, K, P]: each branch's log q of the data tokens (for the posterior).
    The student at position i is the mixture's conditional given the data prefix,
    Q_i = sum_z post(z | x*_<i) q_{z,i} (the proposal `sampled-mixture` verifies with;
    K = 1: q itself). Both distributions are coarsened to the k ids plus one "other"
    bucket, so the loss is KL(p_coarse || Q_coarse) up to the teacher's entropy:
    ce_i = -sum_j p_j log Q_i(v_j) - p_tail log(1 - sum_j Q_i(v_j)). Summed over valid
    positions (optionally weighted), like the NLL."""
    logq_ids = _as_float(logq_ids)
    if logq_ids.ndim != 5:
        raise ValueError(f"logq_ids must be [batch, anchors, K, positions, k], got "
                         f"{logq_ids.shape}")
    b, a, k, p, top = logq_ids.shape
    if teacher_logp.shape != (b, a, p, top):
        raise ValueError(f"teacher_logp must be {(b, a, p, top)}, got {teacher_logp.shape}")
    chex.assert_shape(logq, (b, a, k, p), custom_message="topk_distill_per_anchor: logq must "
                      f"be [batch, anchors, K, positions] = {(b, a, k, p)} like logq_ids "
                      f"{tuple(logq_ids.shape)}")
    if position_weights is not None:
        chex.assert_shape(position_weights, (p,), custom_message="topk_distill_per_anchor: "
                          f"position_weights must be [positions] = ({p},)")
    pos_mask = _position_mask(mask, (b, a, p))
    log_post = mixture_posterior(logq, prior_logits, pos_mask)
    log_q = safe_logsumexp(log_post[..., None] + logq_ids, axis=2)  # [B, A, P, k]
    t = _as_float(teacher_logp)
    p_top = jnp.exp(t)
    p_tail = jnp.clip(1.0 - jnp.sum(p_top, axis=-1), 0.0, 1.0)
    q_tail = jnp.clip(1.0 - jnp.sum(jnp.exp(log_q), axis=-1), 1e-6, 1.0)
    finite_q = jnp.where(jnp.isfinite(log_q), log_q, -1e4)  # a filtered id: large, finite
    ce = -(jnp.sum(p_top * finite_q, axis=-1) + p_tail * jnp.log(q_tail))
    ent = -(jnp.sum(jnp.where(p_top > 0, p_top * t, 0.0), axis=-1)
            + jnp.where(p_tail > 0, p_tail * jnp.log(jnp.where(p_tail > 0, p_tail, 1.0)), 0.0))
    w = pos_mask.astype(ce.dtype)
    if position_weights is not None:
        w = w * jnp.asarray(position_weights, ce.dtype)[None, None, :]
    return jnp.sum(ce * w, axis=-1), jnp.sum((ce - ent) * w, axis=-1)


# ----------------------------------------------------------------------------- schedules


def linear_warmup_schedule(step, *, end_value: float, warmup_steps: int,
                           start_value: float = 0.0, delay_steps: int = 0) -> Array:
    """start_value until `delay_steps`, then linear to end_value over `warmup_steps`, then
    constant. Pure in `step` (jittable). Typical use: the AL weight lambda, so the drafter
    first learns the data (NLL) before the acceptance term, whose weights need overlap."""
    step = jnp.asarray(step, jnp.float32)
    frac = jnp.clip((step - delay_steps) / max(int(warmup_steps), 1), 0.0, 1.0)
    if warmup_steps <= 0:
        frac = jnp.where(step >= delay_steps, 1.0, 0.0)
    return start_value + (end_value - start_value) * frac


def tau_schedule(step, *, start_value: float, end_value: float, transition_steps: int,
                 delay_steps: int = 0, geometric: bool = True) -> Array:
    """Truncation threshold moving from start_value to end_value over `transition_steps`
    after `delay_steps`. Geometric (log-linear) by default, since useful thresholds span
    orders of magnitude; linear when `geometric=False` or either end is 0."""
    step = jnp.asarray(step, jnp.float32)
    if start_value < 0 or end_value < 0:
        raise ValueError(f"tau must be >= 0, got start {start_value}, end {end_value}")
    frac = jnp.clip((step - delay_steps) / max(int(transition_steps), 1), 0.0, 1.0)
    if transition_steps <= 0:
        frac = jnp.where(step >= delay_steps, 1.0, 0.0)
    if geometric and start_value > 0 and end_value > 0:
        ls, le = jnp.log(jnp.float32(start_value)), jnp.log(jnp.float32(end_value))
        return jnp.exp(ls + (le - ls) * frac)
    return start_value + (end_value - start_value) * frac
