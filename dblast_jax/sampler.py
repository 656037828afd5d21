"""On-device generation loops (`lax.while_loop`): plain autoregressive sampling.

Everything from prefill to the last token is one jitted call: fixed-size buffers,
per-row state, no host round trip per step. The loop state is a
`flax.struct.dataclass`; `_plain_cond` documents when the loop stops.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import struct

from dblast_jax.config import SamplingConfig, TargetConfig
from dblast_jax.models import target as target_lm
from dblast_jax.sampling import sample_tokens

Array = jax.Array

PAD_ID = -1  # written into output buffers after a row has stopped


def cache_size_for(prompt_width: int, max_new_tokens: int, extra: int = 0,
                   multiple: int = 64) -> int:
    """KV cache length: prompt + new tokens (+ a verify block), rounded up to limit recompiles."""
    need = prompt_width + max_new_tokens + extra
    return int(math.ceil(need / multiple) * multiple)


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


def _plain_cond(state: PlainState, max_new_tokens: int) -> Array:
    """Continue while some row is still generating and the buffer has room."""
    return jnp.logical_and(state.step < max_new_tokens, jnp.logical_not(jnp.all(state.done)))


def _plain_body(state: PlainState, params, config: TargetConfig,
                sampling: SamplingConfig) -> PlainState:
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
    return PlainState(
        step=state.step + 1,
        last=jnp.where(active, token, state.last),
        positions=jnp.where(active, state.positions + 1, state.positions),
        done=done,
        num_generated=state.num_generated + active.astype(jnp.int32),
        out=out, cache=cache, rng=state.rng)


@functools.partial(jax.jit, static_argnames=("config", "sampling", "cache_size"))
def generate_tokens(params, prompt_tokens: Array, prompt_lengths: Array, rng: Array, *,
                    config: TargetConfig, sampling: SamplingConfig, cache_size: int):
    """Plain sampling of a right-padded batch, entirely on device.

    prompt_tokens: [B, T] int32 (right-padded); prompt_lengths: [B] int32.
    Returns (tokens [B, max_new_tokens] int32 with PAD_ID after each row's end,
    num_generated [B] int32 counting the stop token if one was emitted).
    """
    n = sampling.max_new_tokens
    logits, _, cache = target_lm.prefill(params, prompt_tokens, prompt_lengths, config=config,
                                         cache_size=cache_size, last_logits_only=True)
    first = sample_tokens(jax.random.fold_in(rng, n + 1), logits[:, 0], sampling.temperature,
                          sampling.top_k, sampling.top_p)
    b = prompt_tokens.shape[0]
    out = jnp.full((b, n), PAD_ID, jnp.int32).at[:, 0].set(first)
    state = PlainState(
        step=jnp.int32(1), last=first, positions=prompt_lengths.astype(jnp.int32),
        done=_is_stop(first, sampling.stop_tokens) | (n <= 1),
        num_generated=jnp.ones((b,), jnp.int32), out=out, cache=cache, rng=rng)
    state = jax.lax.while_loop(functools.partial(_plain_cond, max_new_tokens=n),
                               functools.partial(_plain_body, params=params, config=config,
                                                 sampling=sampling),
                               state)
    return state.out, state.num_generated


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
