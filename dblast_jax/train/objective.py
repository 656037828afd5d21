"""The training objective on one batch: anchors, target features, branch log-probs, loss.

Per sequence, A anchors s are drawn among response tokens whose whole block fits; block
slot i = 1..b-1 is labelled with the data token x*_i = tokens[s + i]. The frozen target
gives the drafter's feature taps and (unless the data carry them) log p_i(x*_i) at the
verification temperature T_v; the drafter gives the prior log pi_z and each branch's
log q_{z,i}(x*_i), z = 1..K, by vocabulary chunks. The loss (`losses.combined_loss`,
docs/METHOD.md section 4) is the DFlash loss sum_i w_i CE_i (w_i: position decay,
K = 1), the mixture NLL -log sum_z pi_z prod_i q_{z,i}(x*_i), or NLL + lambda * the
truncated log-domain AL surrogate, lambda and tau on schedules (`lam_at`, `tau_at`);
distillation to the target's top-k adds distill_weight * CE. AL estimates and top-1
agreement are metrics only.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
from jax import lax

from dblast_jax import draft_vocab, losses
from dblast_jax.chunked_logits import TokenLogprobs, token_logprobs
from dblast_jax.config import DrafterConfig, TargetConfig
from dblast_jax.models import drafter as drafter_lib
from dblast_jax.models import target as target_lib
from dblast_jax.train import distill
from dblast_jax.train.sampled_head import sampled_token_logprobs
from dblast_jax.train.config import TrainConfig

Array = jax.Array
Params = dict[str, Any]

__all__ = ["eligible_anchor_mask", "sample_anchors", "gather_block", "block_labels",
           "lam_at", "tau_at", "target_head", "target_features",
           "target_features_and_teacher", "mixture_conditional_logq", "loss_terms"]


# ---- anchors and blocks (jittable) --------------------------------------------------------

def eligible_anchor_mask(loss_mask: Array, lengths: Array, block_size: int) -> Array:
    """[B, T] bool: response token with a whole block inside the sequence (a + b <= len)."""
    t = loss_mask.shape[1]
    pos = jnp.arange(t, dtype=jnp.int32)[None, :]
    return loss_mask.astype(bool) & (pos + block_size <= lengths[:, None])


def sample_anchors(rng: Array, loss_mask: Array, lengths: Array, *, block_size: int,
                   num_anchors: int) -> tuple[Array, Array]:
    """Up to `num_anchors` distinct eligible anchors per row, uniformly without replacement
    (Gumbel top-k), deterministic in `rng`. Returns (anchors [B, A] int32, valid [B, A]
    bool); rows with fewer eligible positions get invalid anchors (position 0) at the end."""
    b, t = loss_mask.shape
    elig = eligible_anchor_mask(loss_mask, lengths, block_size)
    scores = jnp.where(elig, jax.random.gumbel(rng, (b, t), jnp.float32), -jnp.inf)
    k = min(num_anchors, t)
    vals, idx = lax.top_k(scores, k)
    valid = vals > -jnp.inf
    anchors = jnp.where(valid, idx, 0).astype(jnp.int32)
    if k < num_anchors:
        pad = num_anchors - k
        anchors = jnp.pad(anchors, ((0, 0), (0, pad)))
        valid = jnp.pad(valid, ((0, 0), (0, pad)))
    return anchors, valid


def gather_block(x: Array, anchors: Array, block_size: int) -> Array:
    """x [B, T, ...] -> x[b, anchors[b, j] + i] for i = 1..block_size-1: [B, A, b-1, ...]
    (indices clipped to T - 1; mask the result)."""
    b, t = x.shape[:2]
    idx = anchors[:, :, None] + jnp.arange(1, block_size, dtype=jnp.int32)[None, None, :]
    idx = jnp.clip(idx, 0, t - 1).reshape(b, -1)
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
    out = jnp.take_along_axis(x, idx, axis=1)
    return out.reshape((b, anchors.shape[1], block_size - 1) + x.shape[2:])


def block_labels(tokens: Array, loss_mask: Array, lengths: Array, anchors: Array,
                 anchor_valid: Array, block_size: int) -> tuple[Array, Array]:
    """Labels tokens[a + i] [B, A, b-1] and their mask (valid anchor, response token,
    inside the sequence)."""
    labels = gather_block(tokens, anchors, block_size)
    in_seq = (anchors[:, :, None] + jnp.arange(1, block_size, dtype=jnp.int32)
              < lengths[:, None, None])
    mask = anchor_valid[:, :, None] & in_seq & gather_block(loss_mask.astype(bool), anchors,
                                                            block_size)
    return jnp.where(mask, labels, 0), mask


# ---- lambda and tau schedules ------------------------------------------------------------------

def lam_at(config: TrainConfig, step) -> Array:
    if not config.uses_al:
        return jnp.float32(0.0)
    n = config.num_steps
    return losses.linear_warmup_schedule(
        step, end_value=config.lam, warmup_steps=int(round(config.lam_warmup_fraction * n)),
        delay_steps=int(round(config.lam_delay_fraction * n)))


def tau_at(config: TrainConfig, step) -> Array:
    return losses.tau_schedule(
        step, start_value=config.tau_start, end_value=config.tau_end,
        transition_steps=int(round(config.tau_transition_fraction * config.num_steps)),
        delay_steps=int(round(config.lam_delay_fraction * config.num_steps)))


# ---- the objective on one batch ----------------------------------------------------------------

def target_head(tparams: Params, target_config: TargetConfig) -> tuple[Array, str]:
    """(weight, layout) of the target's LM head for `token_logprobs`."""
    if target_config.tie_word_embeddings:
        return tparams["embed"]["embedding"], "vh"
    return tparams["lm_head"]["kernel"], "hv"


def _tap_plan(dcfg: DrafterConfig, tcfg: TargetConfig, need_final: bool
              ) -> tuple[tuple[int, ...], Optional[int]]:
    """Target layers to tap, and the index of the final (post-norm) hidden state among them
    (the target taps its last layer after the final norm, like HF's last hidden state)."""
    ids = tuple(dcfg.target_layer_ids)
    if not need_final:
        return ids, None
    last = tcfg.num_layers - 1
    if last in ids:
        return ids, ids.index(last)
    return ids + (last,), len(ids)


def target_features(tparams: Params, tokens: Array, *, drafter_config: DrafterConfig,
                    target_config: TargetConfig, logp_temperature: Optional[float] = None,
                    chunk_size: int = 8192, row_chunk_size: Optional[int] = None
                    ) -> tuple[Array, Optional[Array]]:
    """One frozen target pass over tokens [B, T] -> (drafter taps [B, T, n_taps, H],
    logp [B, T] or None). logp[t] = log p(tokens[t] | tokens[<t]) at `logp_temperature`
    (logp[:, 0] = 0), from the tapped final hidden state through the LM head by
    vocabulary chunks; the target's own [B, T, V] logits are never used (XLA drops them)."""
    taps, logp, _ = target_features_and_teacher(
        tparams, tokens, drafter_config=drafter_config, target_config=target_config,
        logp_temperature=logp_temperature, chunk_size=chunk_size,
        row_chunk_size=row_chunk_size)
    return taps, logp


def target_features_and_teacher(tparams: Params, tokens: Array, *,
                                drafter_config: DrafterConfig, target_config: TargetConfig,
                                logp_temperature: Optional[float] = None,
                                chunk_size: int = 8192, row_chunk_size: Optional[int] = None,
                                teacher_topk: int = 0, teacher_temperature: float = 1.0
                                ) -> tuple[Array, Optional[Array], Optional[distill.Teacher]]:
    """`target_features` plus, when teacher_topk > 0, the target's top-k distribution at
    `teacher_temperature` per position (distill.Teacher [B, T, k]) from the same pass."""
    tparams = lax.stop_gradient(tparams)
    need = logp_temperature is not None
    tap_layers, final_idx = _tap_plan(drafter_config, target_config, need or teacher_topk > 0)
    _, taps = target_lib.forward(tparams, tokens, config=target_config, tap_layers=tap_layers)
    taps = lax.stop_gradient(taps)
    logp = teacher = None
    head, layout = target_head(tparams, target_config)
    if need:
        final = taps[:, :, final_idx]
        nxt = token_logprobs(final[:, :-1], head, layout, tokens[:, 1:], logp_temperature,
                             chunk_size, row_chunk_size=row_chunk_size).logprob
        logp = lax.stop_gradient(jnp.pad(nxt, ((0, 0), (1, 0))))
    if teacher_topk > 0:
        teacher = distill.teacher_from_final(taps[:, :, final_idx], head, layout, teacher_topk,
                                             teacher_temperature, chunk_size)
    return taps[:, :, :len(drafter_config.target_layer_ids)], logp, teacher


def _dtype_of_tree(params: Params):
    return jax.tree.leaves(params)[0].dtype


def mixture_conditional_logq(logq: Array, prior_logits: Array, mask: Array) -> Array:
    """log Q_i(x*_i | x*_<i) [B, A, P] of the whole mixture, Q = sum_z pi_z prod_i q_{z,i}:
    the posterior over z given the prefix, times each branch's q (the proposal of
    `mixture` verification with sampled branches). K = 1: equals logq[:, :, 0]."""
    lq = jnp.where(mask[:, :, None, :], logq, 0.0)  # masked slots leave the posterior alone
    log_pi = jax.nn.log_softmax(prior_logits.astype(lq.dtype), axis=-1)
    joint = log_pi[..., None] + jnp.cumsum(lq, axis=-1)  # [B, A, K, P]: log pi_z q_z(x_<=i)
    prev = jnp.concatenate([log_pi[..., None], joint[..., :-1]], axis=-1)
    cur_l = losses.safe_logsumexp(joint, axis=2)
    prev_l = losses.safe_logsumexp(prev, axis=2)
    return jnp.where(jnp.isfinite(prev_l), cur_l - jnp.where(jnp.isfinite(prev_l), prev_l, 0.0),
                     -jnp.inf)


def _draft_vocab_logprobs(hidden: Array, dv: Params, labels: Array, vocab_size: int,
                          cfg: TrainConfig) -> TokenLogprobs:
    """log q(labels) with q the softmax over the draft vocabulary's ids only (-inf for a
    label outside it: never proposed), argmax as a target id: what the drafter's
    acceptance is when it drafts over those ids (dblast_jax/draft_vocab.py)."""
    ids = dv["ids"]
    index = jnp.full((vocab_size,), -1, jnp.int32).at[ids].set(
        jnp.arange(ids.shape[0], dtype=jnp.int32))[labels]
    tl = token_logprobs(hidden, dv["head"], "vh", jnp.maximum(index, 0), 1.0,
                        cfg.logits_chunk_size, row_chunk_size=cfg.logits_row_chunk_size or None)
    return TokenLogprobs(jnp.where(index >= 0, tl.logprob, -jnp.inf), ids[tl.argmax],
                         tl.entropy)


def loss_terms(dparams: Params, tparams: Params, batch: Mapping[str, Array], rng: Array,
               step: Array, *, config: TrainConfig, drafter_config: DrafterConfig,
               target_config: TargetConfig, logp_mode: Optional[str],
               head_ids: Optional[Array] = None) -> tuple[Array, dict[str, Array]]:
    """(loss, metrics) of one (micro-)batch. logp_mode: "data" (batch["logp"]), "target"
    (from the frozen target at T_v), or None (no target log-probs: NLL losses only).
    head_ids [F]: the frequent tokens of the sampled training head (config
    train_head_tokens > 0; then log q and every metric built on it are estimates)."""
    cfg, dcfg, tcfg = config, drafter_config, target_config
    # a draft-time vocabulary attached for scoring (`dblast validate NAME=DIR@draft_vocab=N`)
    dparams, dv = draft_vocab.split(dparams)
    if dv is not None and (cfg.train_head_tokens > 0 or cfg.distill_weight > 0):
        raise ValueError("a draft-time vocabulary is a decode-time setting: it is scored "
                         "(validation), not trained (no sampled head, no distillation)")
    b = dcfg.block_size
    tokens = batch["tokens"]
    loss_mask, lengths = batch["loss_mask"], batch["lengths"]
    anchors, anchor_valid = sample_anchors(
        rng, loss_mask, lengths, block_size=b, num_anchors=cfg.anchors_per_sequence)
    labels, pos_mask = block_labels(tokens, loss_mask, lengths, anchors,
                                                anchor_valid, b)

    # -- the frozen target: features (and log-probs of the data at T_v)
    tparams = lax.stop_gradient(tparams)
    head, layout = target_head(tparams, tcfg)
    teacher = None
    if "taps" in batch:  # cached features (feature_cache): the target pass was done once
        if logp_mode == "target":
            raise ValueError("cached features hold the drafter's taps only; target log-probs "
                             "must come with the data (logp_source 'data' / 'auto')")
        drafter_taps, logp_tok = batch["taps"].astype(_dtype_of_tree(tparams)), None
        if cfg.distill_weight > 0:
            if "teacher_ids" not in batch:
                raise ValueError("distill_weight > 0 with a feature cache built without the "
                                 "teacher's top-k: rebuild it (the cache key includes "
                                 "distill_topk)")
            teacher = distill.Teacher(batch["teacher_ids"], batch["teacher_logp"])
    else:
        drafter_taps, logp_tok, teacher = target_features_and_teacher(
            tparams, tokens, drafter_config=dcfg, target_config=tcfg,
            logp_temperature=cfg.verify_temperature if logp_mode == "target" else None,
            chunk_size=cfg.logits_chunk_size,
            row_chunk_size=cfg.logits_row_chunk_size or None,
            teacher_topk=cfg.distill_topk if cfg.distill_weight > 0 else 0,
            teacher_temperature=cfg.verify_temperature)
    if logp_mode == "data":
        logp_tok = batch["logp"].astype(jnp.float32)

    # -- the drafter: branch log-probs of the labels, chunked over the vocabulary
    branch_hidden, prior_logits = drafter_lib.train_hidden(
        dparams, tparams, drafter_taps, tokens, anchors, drafter_config=dcfg,
        target_config=tcfg)
    k = dcfg.num_categories
    branch_labels = jnp.broadcast_to(labels[:, :, None, :], labels.shape[:2] + (k,)
                                     + labels.shape[2:])
    if cfg.train_head_tokens > 0:  # normaliser from frequent + sampled columns
        if head_ids is None or head_ids.shape[0] != cfg.train_head_tokens:
            raise ValueError(f"train_head_tokens={cfg.train_head_tokens} needs that many "
                             "frequent token ids (head_ids; the Trainer counts them)")
        tl = sampled_token_logprobs(branch_hidden, head, layout, branch_labels, head_ids,
                                    jax.random.fold_in(rng, 1), cfg.train_head_sampled,
                                    row_chunk_size=cfg.logits_row_chunk_size or None)
    elif dv is not None:  # scored as drafted over a draft-time vocabulary (validation)
        tl = _draft_vocab_logprobs(branch_hidden, dv, branch_labels, tcfg.vocab_size, cfg)
    else:
        tl = token_logprobs(branch_hidden, head, layout, branch_labels, 1.0,
                            cfg.logits_chunk_size,
                            row_chunk_size=cfg.logits_row_chunk_size or None)
    logq = tl.logprob  # [B, A, K, P]

    # -- the objective
    n_pos = b - 1
    gamma = cfg.gamma if cfg.gamma > 0 else None
    decay = losses.dflash_position_weights(n_pos, gamma)
    logp_block = (gather_block(logp_tok, anchors, b)
                  if logp_tok is not None else None)
    if cfg.loss == "nll+al":
        if logp_block is None:
            raise ValueError("loss 'nll+al' needs target log-probs (logp_mode None)")
        weights = decay if cfg.nll_position_decay else None
        loss, metrics = losses.combined_loss(logq, prior_logits, logp_block, pos_mask,
                                             lam=lam_at(cfg, step), tau=tau_at(cfg, step),
                                             position_weights=weights)
    else:
        weights = decay if (cfg.loss == "dflash" or cfg.nll_position_decay) else None
        loss, metrics = losses.combined_loss(logq, prior_logits, None, pos_mask,
                                             position_weights=weights)
        if logp_block is not None:  # AL metrics only, no gradient
            sg = lax.stop_gradient
            per = losses.al_estimate(sg(logq), sg(prior_logits), logp_block, pos_mask)
            al = losses.masked_anchor_mean(per, jnp.any(pos_mask, axis=-1))
            metrics["al_estimate"] = al
            metrics["predicted_tau"] = losses.predicted_tau(al)
    if teacher is not None:  # distillation from the target's top-k distribution
        ids_blk = gather_block(teacher.ids, anchors, b)  # [B, A, P, k]
        tlogp_blk = gather_block(teacher.logp.astype(jnp.float32), anchors, b)
        logq_ids = distill.student_logq_at(branch_hidden, head, layout, ids_blk,
                                           branch_labels, logq)
        dweights = decay if (cfg.loss == "dflash" or cfg.nll_position_decay) else None
        ce, kl = losses.topk_distill_per_anchor(logq_ids, tlogp_blk, logq, prior_logits,
                                                pos_mask, dweights)
        valid_anchor = jnp.any(pos_mask, axis=-1)
        metrics["distill_ce"] = losses.masked_anchor_mean(ce, valid_anchor)
        metrics["distill_kl"] = losses.masked_anchor_mean(kl, valid_anchor)
        loss = loss + cfg.distill_weight * metrics["distill_ce"]
        metrics["loss"] = loss
    if logp_block is not None:
        # The AL of `sampled-mixture` verification (Q = the mixture's own conditionals):
        # where K > 1 can beat the best single product proposal. al_estimate above is `sampled-branch`,
        # which is linear in pi, so no mixture beats its best branch there.
        sg = lax.stop_gradient
        log_q_mix = mixture_conditional_logq(sg(logq), sg(prior_logits), pos_mask)
        # P(first k drafts accepted), k = 1..P, averaged over valid anchors: where along
        # the block acceptance is lost (sums to al_estimate / al_estimate_mixture)
        anchor_w = jnp.any(pos_mask, axis=-1).astype(jnp.float32)[..., None]
        n_anchor = jnp.maximum(jnp.sum(anchor_w), 1.0)
        for key, lq, prior in (("accept_prefix", sg(logq), sg(prior_logits)),
                               ("accept_prefix_mixture", log_q_mix[:, :, None, :], None)):
            acc = losses.prefix_acceptance(lq, prior, logp_block, pos_mask)
            metrics[key] = jnp.sum(acc.astype(jnp.float32) * anchor_w, axis=(0, 1)) / n_anchor
        metrics["al_estimate_mixture"] = jnp.sum(metrics["accept_prefix_mixture"])

    # -- per-position top-1 agreement, prior-weighted over branches
    pi = jax.nn.softmax(lax.stop_gradient(prior_logits).astype(jnp.float32), axis=-1)  # [B, A, K]
    hit = (tl.argmax == branch_labels).astype(jnp.float32)  # [B, A, K, P]
    agree = jnp.einsum("bak,bakp->bap", pi, hit)
    m = pos_mask.astype(jnp.float32)
    per_pos = jnp.sum(agree * m, axis=(0, 1)) / jnp.maximum(jnp.sum(m, axis=(0, 1)), 1.0)
    metrics["top1"] = per_pos
    metrics["top1_mean"] = jnp.sum(agree * m) / jnp.maximum(jnp.sum(m), 1.0)
    # leading drafts equal to the data: greedy verification's accepted drafts on T = 0 text
    run = losses.greedy_accepted(tl.argmax == branch_labels, pi, pos_mask)
    metrics["greedy_accepted"] = losses.masked_anchor_mean(run, jnp.any(pos_mask, axis=-1))

    # -- the latent prior: does the mixture use its branches (entropy, mean weight of each)?
    valid = jnp.any(pos_mask, axis=-1).astype(jnp.float32)  # [B, A]
    n_valid = jnp.maximum(jnp.sum(valid), 1.0)
    log_pi = jax.nn.log_softmax(lax.stop_gradient(prior_logits).astype(jnp.float32), axis=-1)
    entropy = -jnp.sum(jnp.exp(log_pi) * log_pi, axis=-1)  # [B, A]
    metrics["prior_entropy"] = jnp.sum(entropy * valid) / n_valid
    metrics["branch_usage"] = jnp.einsum("bak,ba->k", pi.astype(jnp.float32), valid) / n_valid
    metrics["tokens"] = jnp.sum(lengths).astype(jnp.int32)
    metrics["label_tokens"] = jnp.sum(pos_mask).astype(jnp.int32)
    return loss, metrics

