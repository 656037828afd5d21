"""On-device generation loops (`lax.while_loop`): plain sampling and speculative decoding.

Two loops, each one jitted call from prefill to the last token (fixed-size buffers,
per-row state, no host round trip per step; the state is a `flax.struct.dataclass`):

* `generate_tokens`: plain autoregressive sampling from the target, one token per
  step; `_plain_cond` documents when the loop stops. `generate_scored_tokens` is the
  same loop that also keeps each emitted token's log-probability and entropy at given
  temperatures, from the logits it sampled from (corpus regeneration: no second pass).
* `speculative_generate_tokens`: speculative decoding; each step the drafter proposes a
  block (`_draft`), the target scores it in one pass and `verify` accepts a prefix plus
  one corrected / bonus token (`_spec_body`); `_spec_cond` says when it stops.
  `python_driven_speculative` runs the same step from Python (what the loop saves).
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import chex
import jax
import jax.numpy as jnp
from flax import struct

from dblast_jax import block_causal, correction, draft_vocab, ngram, verify
from dblast_jax.config import (CombinedDrafterConfig, NgramConfig, SamplingConfig, TargetConfig,
                               trained_drafter_config)
from dblast_jax.models import drafter as drafter_lm
from dblast_jax.models import target as target_lm
from dblast_jax.sampling import sample_tokens, sampling_logprobs, token_logprobs_and_entropies

Array = jax.Array

PAD_ID = -1  # written into output buffers after a row has stopped


def cache_size_for(prompt_width: int, max_new_tokens: int, extra: int = 0,
                   multiple: int = 64) -> int:
    """KV cache length: prompt + new tokens (+ a verify block), rounded up to limit recompiles."""
    need = prompt_width + max_new_tokens + extra
    return int(math.ceil(need / multiple) * multiple)


def _check_prompts(fn: str, prompt_tokens: Array, prompt_lengths: Array) -> None:
    """Right-padded prompts [B, T] int and their lengths [B] int (trace-time, free under jit)."""
    chex.assert_rank(prompt_tokens, 2, custom_message=f"{fn}: prompt_tokens must be "
                     "[batch, width] (right-padded, see pad_prompts)")
    chex.assert_type(prompt_tokens, int, custom_message=f"{fn}: prompt_tokens must be "
                     "integer ids")
    chex.assert_shape(prompt_lengths, prompt_tokens.shape[:1], custom_message=f"{fn}: "
                      f"prompt_lengths must be [batch] = [{prompt_tokens.shape[0]}]")
    chex.assert_type(prompt_lengths, int, custom_message=f"{fn}: prompt_lengths must be "
                     "integers")


def _is_stop(tokens: Array, stop_tokens: Sequence[int]) -> Array:
    if not stop_tokens:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(stop_tokens, jnp.int32))


@struct.dataclass
class PlainState:
    step: Array  # [] int32: number of tokens generated so far (per the longest row)
    last: Array  # [B] int32: the most recent token of each row (not yet in the cache)
    positions: Array  # [B] int32: absolute position of `last`
    done: Array  # [B] bool: the row emitted a stop token or hit max_new_tokens
    num_generated: Array  # [B] int32
    out: Array  # [B, max_new_tokens] int32, PAD_ID after a row stops
    cache: target_lm.KVCache
    rng: Array
    # generate_scored_tokens only (None otherwise): [n_T, B, max_new_tokens] float32, the
    # log-prob / entropy at each score temperature of the token in `out` at that column
    logp: Array | None = None
    entropy: Array | None = None


def _with_scores(state: PlainState, logits: Array, token: Array, column: Array,
                 temperatures: tuple[float, ...]) -> PlainState:
    """Write the scores of `token` [B] under `logits` [B, V] into column `column`."""
    if not temperatures:
        return state
    lp, en = token_logprobs_and_entropies(logits, token, temperatures)  # [n_T, B]
    put = lambda buf, x: jax.lax.dynamic_update_slice(buf, x[:, :, None], (0, 0, column))
    return state.replace(logp=put(state.logp, lp), entropy=put(state.entropy, en))


def _plain_cond(state: PlainState, max_new_tokens: int) -> Array:
    """Continue while some row is still generating and the buffer has room."""
    return jnp.logical_and(state.step < max_new_tokens, jnp.logical_not(jnp.all(state.done)))


def _plain_body(state: PlainState, params, config: TargetConfig,
                sampling: SamplingConfig,
                score_temperatures: tuple[float, ...] = ()) -> PlainState:
    logits, _, cache = target_lm.extend(params, state.last[:, None], state.positions,
                                        state.cache, config=config)
    rng = jax.random.fold_in(state.rng, state.step)
    token = sample_tokens(rng, logits[:, 0], sampling.temperature, sampling.top_k,
                          sampling.top_p)
    active = jnp.logical_not(state.done)
    token = jnp.where(active, token, PAD_ID)
    out = jax.lax.dynamic_update_slice(state.out, token[:, None], (0, state.step))
    done = state.done | _is_stop(token, sampling.stop_tokens) | (
        state.num_generated + 1 >= sampling.max_new_tokens)
    scored = _with_scores(state, logits[:, 0], token, state.step, score_temperatures)
    return PlainState(
        step=state.step + 1,
        last=jnp.where(active, token, state.last),
        positions=jnp.where(active, state.positions + 1, state.positions),
        done=done,
        num_generated=state.num_generated + active.astype(jnp.int32),
        out=out, cache=cache, rng=state.rng, logp=scored.logp, entropy=scored.entropy)


def _plain_loop(params, prompt_tokens: Array, prompt_lengths: Array, rng: Array, *,
                config: TargetConfig, sampling: SamplingConfig, cache_size: int,
                score_temperatures: tuple[float, ...]) -> PlainState:
    n = sampling.max_new_tokens
    logits, _, cache = target_lm.prefill(params, prompt_tokens, prompt_lengths, config=config,
                                         cache_size=cache_size, last_logits_only=True)
    first = sample_tokens(jax.random.fold_in(rng, n + 1), logits[:, 0], sampling.temperature,
                          sampling.top_k, sampling.top_p)
    b = prompt_tokens.shape[0]
    out = jnp.full((b, n), PAD_ID, jnp.int32).at[:, 0].set(first)
    scores = (jnp.zeros((len(score_temperatures), b, n), jnp.float32)
              if score_temperatures else None)
    state = PlainState(
        step=jnp.int32(1), last=first, positions=prompt_lengths.astype(jnp.int32),
        done=_is_stop(first, sampling.stop_tokens) | (n <= 1),
        num_generated=jnp.ones((b,), jnp.int32), out=out, cache=cache, rng=rng,
        logp=scores, entropy=scores)
    state = _with_scores(state, logits[:, 0], first, jnp.int32(0), score_temperatures)
    return jax.lax.while_loop(functools.partial(_plain_cond, max_new_tokens=n),
                              functools.partial(_plain_body, params=params, config=config,
                                                sampling=sampling,
                                                score_temperatures=score_temperatures),
                              state)


@functools.partial(jax.jit, static_argnames=("config", "sampling", "cache_size"))
def generate_tokens(params, prompt_tokens: Array, prompt_lengths: Array, rng: Array, *,
                    config: TargetConfig, sampling: SamplingConfig, cache_size: int):
    """Plain sampling of a right-padded batch, entirely on device.

    prompt_tokens: [B, T] int32 (right-padded); prompt_lengths: [B] int32.
    Returns (tokens [B, max_new_tokens] int32 with PAD_ID after each row's end,
    num_generated [B] int32 counting the stop token if one was emitted).
    """
    _check_prompts("generate_tokens", prompt_tokens, prompt_lengths)
    state = _plain_loop(params, prompt_tokens, prompt_lengths, rng, config=config,
                        sampling=sampling, cache_size=cache_size, score_temperatures=())
    return state.out, state.num_generated


@functools.partial(jax.jit, static_argnames=("config", "sampling", "cache_size",
                                             "score_temperatures"))
def generate_scored_tokens(params, prompt_tokens: Array, prompt_lengths: Array, rng: Array, *,
                           config: TargetConfig, sampling: SamplingConfig, cache_size: int,
                           score_temperatures: tuple[float, ...]):
    """`generate_tokens` that also scores every emitted token at each score temperature T:
    log softmax(logits / T) at the token and that softmax's entropy, from the very logits
    the token was sampled from (untruncated, whatever top-k / top-p the sampling uses).

    Why: a regenerated corpus stores these per response token; a separate teacher-forced
    pass over prompt + answer (`data.regenerate.teacher_forced`, equal up to float
    rounding) cost about a quarter of regeneration. The sampled tokens are those of
    `generate_tokens` with the same key.
    Returns (tokens, num_generated, logp, entropy); logp and entropy are
    [len(score_temperatures), B, max_new_tokens] float32, column j scoring tokens[:, j]
    (meaningless past a row's num_generated).
    """
    _check_prompts("generate_scored_tokens", prompt_tokens, prompt_lengths)
    if not score_temperatures or min(score_temperatures) <= 0:
        raise ValueError(f"score_temperatures must be positive temperatures, got "
                         f"{score_temperatures!r}")
    state = _plain_loop(params, prompt_tokens, prompt_lengths, rng, config=config,
                        sampling=sampling, cache_size=cache_size,
                        score_temperatures=tuple(float(t) for t in score_temperatures))
    return state.out, state.num_generated, state.logp, state.entropy


def pad_prompts(prompts: Sequence[Sequence[int]], multiple: int = 16,
                pad_id: int = 0) -> tuple[Array, Array]:
    """Right-pad token lists to a width rounded up to `multiple` (limits recompiles)."""
    if not prompts:
        raise ValueError("no prompts given")
    lengths = [len(p) for p in prompts]
    if min(lengths) == 0:
        raise ValueError("empty prompt: every prompt needs at least one token")
    width = int(math.ceil(max(lengths) / multiple) * multiple)
    import numpy as np
    arr = np.full((len(prompts), width), pad_id, np.int32)
    for i, p in enumerate(prompts):
        arr[i, :len(p)] = p
    return jnp.asarray(arr), jnp.asarray(lengths, jnp.int32)


# ---- speculative decoding ------------------------------------------------------------------

# Independent PRNG streams per random decision (folded into the per-step key).
STREAM_CATEGORY, STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_FIRST = range(5)


def step_keys(rng: Array, step: Array) -> tuple[Array, Array, Array, Array]:
    """(category, draft, accept, residual) keys of loop iteration `step`."""
    key = jax.random.fold_in(rng, step)
    return tuple(jax.random.fold_in(key, s) for s in
                 (STREAM_CATEGORY, STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL))


@struct.dataclass
class SpecState:
    step: Array  # [] int32: loop iterations so far
    anchor: Array  # [B] int32: last emitted token (not yet in the target cache)
    anchor_pos: Array  # [B] int32: its absolute position s
    done: Array  # [B] bool
    num_generated: Array  # [B] int32
    out: Array  # [B, max_new_tokens + b] int32, PAD_ID past each row's end
    accepted: Array  # [B, max_steps] int32 accepted drafts per step, -1 = no step
    expected: Array  # [B, max_steps] float32 exact expected accepted drafts per step
    target_cache: target_lm.KVCache
    draft_cache: target_lm.KVCache | None  # None: n-gram drafting (no trained drafter)
    history: Array  # [B, cache_size] int32: prompt + emitted tokens, valid to anchor_pos
    rng: Array


def max_spec_steps(sampling: SamplingConfig) -> int:
    # every step emits at least one token and the prefill emits the first
    return max(sampling.max_new_tokens - 1, 1)


def _spec_cond(state: SpecState, sampling: SamplingConfig) -> Array:
    """Continue while some row still generates (each step emits >= 1 token per row)."""
    return jnp.logical_and(state.step < max_spec_steps(sampling),
                           jnp.logical_not(jnp.all(state.done)))


def _draft(dparams, tparams, state: SpecState, keys, tcfg, dcfg, sampling: SamplingConfig):
    """Propose d_1..d_{b-1} per row and the dense proposal Q used to verify them: the
    trained drafter's, or per row the n-gram's (deterministic: Q = one-hot)."""
    if isinstance(dcfg, CombinedDrafterConfig):
        ng_drafts, match = _ngram_drafts(state, dcfg.ngram)
        use_ngram = match >= dcfg.min_match  # [B]: a function of the text so far only
        ng_proposal = verify.one_hot_proposal(ng_drafts, tcfg.vocab_size)

        def with_trained(_):
            drafts, proposal = _trained_draft(dparams, tparams, state, keys, tcfg,
                                              dcfg.drafter, sampling)
            return (jnp.where(use_ngram[:, None], ng_drafts, drafts),
                    jnp.where(use_ngram[:, None, None], ng_proposal, proposal))

        # every row copies: skip the drafter's pass and its LM head altogether
        return jax.lax.cond(jnp.all(use_ngram), lambda _: (ng_drafts, ng_proposal),
                            with_trained, None)
    return _trained_draft(dparams, tparams, state, keys, tcfg, dcfg, sampling)


def _ngram_drafts(state: SpecState, config: NgramConfig) -> tuple[Array, Array]:
    return ngram.propose(state.history, state.anchor_pos + 1,
                         num_drafts=config.block_size - 1, min_n=config.min_n,
                         max_n=config.max_n)


def _trained_draft(dparams, tparams, state: SpecState, keys, tcfg, dcfg,
                   sampling: SamplingConfig):
    """The trained drafter's drafts [B, b-1] and dense proposal [B, b-1, V]. With a
    draft-time vocabulary (`draft_vocab.attach`) every q is the softmax over its N ids and
    0 elsewhere: drawn from and verified against that same q (exact). A drafter with a
    correction head drafts left to right (`correction.draft`), each q_i corrected by the
    token drafted before it. A causal-block drafter drafts left to right too, one drafter
    pass per position (`block_causal.draft`)."""
    k_cat, k_draft = keys[0], keys[1]
    core, dv = draft_vocab.split(dparams)
    if dcfg.block_attention == "causal":
        return block_causal.draft(core, dv, tparams, state.anchor, state.anchor_pos,
                                  state.draft_cache, keys, tcfg, dcfg, sampling)
    hidden, prior = drafter_lm.draft_hidden(core, tparams, state.anchor, state.anchor_pos,
                                            state.draft_cache, drafter_config=dcfg,
                                            target_config=tcfg)
    draw_logp = jax.nn.log_softmax(prior.astype(jnp.float32) / sampling.category_temperature,
                                   axis=-1)  # [B, K]: pi', the law z is drawn from
    z = jax.random.categorical(k_cat, draw_logp, axis=-1)
    if dcfg.correction != "none":
        return correction.draft(core, dv, tparams, hidden, draw_logp, z, state.anchor,
                                k_draft, tcfg, dcfg, sampling)
    vocab = tcfg.vocab_size
    head = lambda h: draft_vocab.draft_logits(tparams, dv, h, tcfg)  # [.., N] (N = V: full)
    sampled = sampling.temperature > 0  # at T = 0 every mode drafts argmaxes
    if sampling.verify_mode == "sampled-mixture" and sampled:
        # d ~ q(. | z) like sampled-branch, verified against the mixture's conditionals
        log_q = jax.nn.log_softmax(head(hidden) / sampling.draft_temperature,
                                   axis=-1)  # [B, K, b-1, N]
        log_q_z = jnp.take_along_axis(log_q, z[:, None, None, None], axis=1)[:, 0]
        drafts = draft_vocab.to_target_ids(
            dv, jax.random.categorical(k_draft, log_q_z, axis=-1))
        proposal = verify.mixture_proposal(
            None, draft_vocab.to_target_probs(dv, jnp.exp(log_q), vocab), drafts,
            jnp.exp(draw_logp), vocab)
        return drafts, proposal
    if sampling.verify_mode in ("mixture", "sampled-mixture"):
        branch_tokens = draft_vocab.to_target_ids(dv, jnp.argmax(head(hidden), axis=-1))
        drafts = jnp.take_along_axis(branch_tokens, z[:, None, None], axis=1)[:, 0]
        proposal = verify.mixture_proposal(branch_tokens, None, drafts, jnp.exp(draw_logp),
                                           vocab)
        return drafts, proposal
    logits = head(drafter_lm.select_branch(hidden, z))  # [B, b-1, N]
    if sampling.verify_mode == "sampled-branch" and sampled:
        log_q = jax.nn.log_softmax(logits / sampling.draft_temperature, axis=-1)
        drafts = draft_vocab.to_target_ids(dv, jax.random.categorical(k_draft, log_q, axis=-1))
        return drafts, draft_vocab.to_target_probs(dv, jnp.exp(log_q), vocab)
    drafts = draft_vocab.to_target_ids(dv, jnp.argmax(logits, axis=-1))
    return drafts, verify.one_hot_proposal(drafts, vocab)


def _per_row_write(buf: Array, new: Array, starts: Array) -> Array:
    """buf [B, N], new [B, n]: row b written at starts[b]."""
    return jax.vmap(lambda r, x, s: jax.lax.dynamic_update_slice(r, x, (s,)))(buf, new, starts)


def _spec_body(state: SpecState, tparams, dparams, tcfg: TargetConfig, dcfg,
               sampling: SamplingConfig) -> SpecState:
    keys = step_keys(state.rng, state.step)
    step = functools.partial(_verify_step, keys=keys, tparams=tparams, dparams=dparams,
                             tcfg=tcfg, dcfg=dcfg, sampling=sampling)
    if isinstance(dcfg, NgramConfig):
        drafts, match = _ngram_drafts(state, dcfg)
        proposal = verify.one_hot_proposal(drafts, tcfg.vocab_size)
        # No active row found a suffix of min_n tokens to copy from: a plain one-token step
        # (the anchor alone, no drafts), which on a compute-bound machine costs a fraction
        # of verifying b tokens. The choice depends on the text so far only: still exact.
        copy = jnp.any((match > 0) & jnp.logical_not(state.done))
        return jax.lax.cond(copy, lambda s: step(s, drafts, proposal),
                            lambda s: step(s, drafts[:, :0], proposal[:, :0]), state)
    drafts, proposal = _draft(dparams, tparams, state, keys, tcfg, dcfg, sampling)
    return step(state, drafts, proposal)


def _verify_step(state: SpecState, drafts: Array, proposal: Array, *, keys, tparams, dparams,
                 tcfg: TargetConfig, dcfg, sampling: SamplingConfig) -> SpecState:
    """Verify drafts [B, n] (n <= b - 1; 0 is a plain step) against their proposal
    [B, n, V], emit the accepted prefix and one more token, and advance the caches."""
    block = jnp.concatenate([state.anchor[:, None], drafts], axis=1)  # [B, b]
    logits, taps, target_cache = target_lm.extend(
        tparams, block, state.anchor_pos, state.target_cache, config=tcfg,
        tap_layers=dcfg.target_layer_ids)  # () for n-gram drafting
    if sampling.temperature <= 0:
        verdict = verify.verify_greedy(logits, drafts)
    else:
        probs = jnp.exp(sampling_logprobs(logits, sampling.temperature, sampling.top_k,
                                          sampling.top_p))
        verdict = verify.verify_block(keys[2], keys[3], probs, drafts, proposal)
    n = verdict.num_accepted
    b = block.shape[1]
    idx = jnp.arange(b, dtype=jnp.int32)[None, :]
    padded = jnp.concatenate([drafts, jnp.full((drafts.shape[0], 1), PAD_ID, drafts.dtype)],
                             axis=1)
    emitted = jnp.where(idx < n[:, None], padded,
                        jnp.where(idx == n[:, None], verdict.next_token[:, None], PAD_ID))
    stop_hit = _is_stop(emitted, sampling.stop_tokens) & (idx <= n[:, None])
    first_stop = jnp.where(jnp.any(stop_hit, axis=1), jnp.argmax(stop_hit, axis=1), b)
    active = jnp.logical_not(state.done)
    count = jnp.minimum(jnp.minimum(n + 1, first_stop + 1),
                        sampling.max_new_tokens - state.num_generated)
    count = jnp.where(active, count, 0)
    emitted = jnp.where(idx < count[:, None], emitted, PAD_ID)
    out = _per_row_write(state.out, emitted, state.num_generated)
    num_generated = state.num_generated + count
    done = state.done | jnp.any(stop_hit & (idx < count[:, None]), axis=1) | (
        num_generated >= sampling.max_new_tokens)
    trained = trained_drafter_config(dcfg)
    new_pos = jnp.where(active, state.anchor_pos + n + 1, state.anchor_pos)
    draft_cache = None
    if trained is not None:
        draft_cache = drafter_lm.append_context(draft_vocab.split(dparams)[0], taps,
                                                state.anchor_pos, state.draft_cache,
                                                drafter_config=trained)
        draft_cache = draft_cache.replace(lengths=new_pos)
    target_cache = target_cache.replace(lengths=new_pos)
    step_col = lambda buf, val, fill: jax.lax.dynamic_update_slice(
        buf, jnp.where(active, val, fill)[:, None].astype(buf.dtype), (0, state.step))
    return SpecState(
        step=state.step + 1,
        anchor=jnp.where(active, verdict.next_token, state.anchor),
        anchor_pos=new_pos, done=done, num_generated=num_generated, out=out,
        accepted=step_col(state.accepted, n, -1),
        expected=step_col(state.expected, verdict.expected_accepted, 0.0),
        target_cache=target_cache, draft_cache=draft_cache,
        history=_per_row_write(state.history, emitted, state.anchor_pos + 1), rng=state.rng)


def _spec_init(tparams, dparams, prompt_tokens: Array, prompt_lengths: Array, rng: Array,
               tcfg: TargetConfig, dcfg, sampling: SamplingConfig, cache_size: int) -> SpecState:
    """Target prefill (with feature taps), the first token, and the draft cache."""
    _check_prompts("speculative_generate_tokens", prompt_tokens, prompt_lengths)
    trained = trained_drafter_config(dcfg)
    if trained is not None:
        drafter_lm.check_drafter_fits_target(trained, tcfg)
    logits, taps, target_cache = target_lm.prefill(
        tparams, prompt_tokens, prompt_lengths, config=tcfg, cache_size=cache_size,
        tap_layers=dcfg.target_layer_ids, last_logits_only=True)
    first = sample_tokens(jax.random.fold_in(rng, 0x7FFFFFFF), logits[:, 0],
                          sampling.temperature, sampling.top_k, sampling.top_p)
    bsz = prompt_tokens.shape[0]
    lengths = prompt_lengths.astype(jnp.int32)
    draft_cache = None
    if trained is not None:
        core, _ = draft_vocab.split(dparams)  # the draft vocabulary is for drafting only
        draft_cache = drafter_lm.init_draft_cache(trained, bsz, cache_size,
                                                  jax.tree.leaves(core)[0].dtype)
        draft_cache = drafter_lm.append_context(core, taps, jnp.zeros((bsz,), jnp.int32),
                                                draft_cache, drafter_config=trained)
        draft_cache = draft_cache.replace(lengths=lengths)
    history = jnp.zeros((bsz, cache_size), jnp.int32)
    history = history.at[:, :prompt_tokens.shape[1]].set(prompt_tokens.astype(jnp.int32))
    history = _per_row_write(history, first[:, None].astype(jnp.int32), lengths)
    n, b, steps = sampling.max_new_tokens, dcfg.block_size, max_spec_steps(sampling)
    return SpecState(
        step=jnp.int32(0), anchor=first, anchor_pos=lengths,
        done=_is_stop(first, sampling.stop_tokens) | (n <= 1),
        num_generated=jnp.ones((bsz,), jnp.int32),
        out=jnp.full((bsz, n + b), PAD_ID, jnp.int32).at[:, 0].set(first),
        accepted=jnp.full((bsz, steps), -1, jnp.int32),
        expected=jnp.zeros((bsz, steps), jnp.float32),
        target_cache=target_cache, draft_cache=draft_cache, history=history, rng=rng)


def spec_cache_size(prompt_width: int, sampling: SamplingConfig, block_size: int) -> int:
    return cache_size_for(prompt_width, sampling.max_new_tokens, extra=block_size)


@functools.partial(jax.jit, static_argnames=("target_config", "drafter_config", "sampling",
                                             "cache_size"))
def speculative_generate_tokens(tparams, dparams, prompt_tokens: Array, prompt_lengths: Array,
                                rng: Array, *, target_config: TargetConfig, drafter_config,
                                sampling: SamplingConfig, cache_size: int):
    """Speculative decoding of a right-padded batch in one jitted while_loop.

    Returns (tokens [B, max_new_tokens] with PAD_ID past each row's end,
    num_generated [B], accepted [B, max_steps] (-1 = no step), expected [B, max_steps]).
    """
    state = _spec_init(tparams, dparams, prompt_tokens, prompt_lengths, rng, target_config,
                       drafter_config, sampling, cache_size)
    state = jax.lax.while_loop(
        functools.partial(_spec_cond, sampling=sampling),
        functools.partial(_spec_body, tparams=tparams, dparams=dparams, tcfg=target_config,
                          dcfg=drafter_config, sampling=sampling),
        state)
    n = sampling.max_new_tokens
    return state.out[:, :n], state.num_generated, state.accepted, state.expected


def python_driven_speculative(tparams, dparams, prompt_tokens, prompt_lengths, rng, *,
                              target_config, drafter_config, sampling, cache_size):
    """The same steps driven from Python (one jitted, state-donating step per iteration).

    Exists to measure what the on-device loop saves; results equal the while_loop's.
    """
    init = jax.jit(_spec_init, static_argnums=(5, 6, 7, 8))
    step = jax.jit(functools.partial(_spec_body, tcfg=target_config, dcfg=drafter_config,
                                     sampling=sampling), donate_argnums=0)
    state = init(tparams, dparams, prompt_tokens, prompt_lengths, rng, target_config,
                 drafter_config, sampling, cache_size)
    while bool(_spec_cond(state, sampling)):
        state = step(state, tparams, dparams)
    n = sampling.max_new_tokens
    return state.out[:, :n], state.num_generated, state.accepted, state.expected
