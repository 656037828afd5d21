"""Incremental decoding (prefill + extend over the KV cache) equals full forwards.

Pure JAX, no torch. Parameters are scaled up from `init_params` so attention is peaked
and norms are not all ones: a wrong mask, position or cache slot changes the logits by
far more than the tolerances used here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dblast_jax.config import TargetConfig
from dblast_jax.models import target

CONFIGS = [TargetConfig.tiny_llama(), TargetConfig.tiny_qwen3()]
IDS = [c.name for c in CONFIGS]
ATOL = 2e-5

# jitted entry points (one compile per config / shape; eager dispatch is slow on CPU)
_forward = jax.jit(target.forward, static_argnames=("config", "tap_layers"))
_prefill = jax.jit(target.prefill, static_argnames=("config", "cache_size", "tap_layers",
                                                    "last_logits_only"))
_extend = jax.jit(target.extend, static_argnames=("config", "tap_layers"))


@functools.lru_cache(maxsize=None)
def _params(config: TargetConfig, dtype_name: str = "float32"):
    rng = np.random.RandomState(0)

    def make(x):
        if x.ndim == 1:  # norm scales around 1
            return 1.0 + 0.3 * rng.standard_normal(x.shape)
        return rng.normal(0.0, 0.25, x.shape)
    return jax.tree.map(lambda x: jnp.asarray(make(x), jnp.dtype(dtype_name)),
                        target.abstract_params(config))


def _sequences(config, lengths, extra, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, config.vocab_size, n + extra).astype(np.int32) for n in lengths]


def _padded(seqs, lengths, width, config, seed=1):
    """Right-padded prompt batch; the padding is random ids (it must not matter)."""
    rng = np.random.RandomState(seed)
    out = rng.randint(0, config.vocab_size, (len(seqs), width)).astype(np.int32)
    for b, (s, n) in enumerate(zip(seqs, lengths)):
        out[b, :n] = s[:n]
    return out


# Every call below uses the same batch (3 rows), prompt width, cache size and taps, so
# each jitted function compiles once per config and is shared across tests.
B, WIDTH, CACHE = 3, 7, 16


def _taps(config):
    return tuple(range(config.num_layers))


def _run_prefill(params, config, prompt, lengths, **kw):
    return _prefill(params, jnp.asarray(prompt), jnp.asarray(lengths, jnp.int32),
                    config=config, cache_size=CACHE, tap_layers=_taps(config), **kw)


def _run_extend(params, config, tokens, positions, cache):
    return _extend(params, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32),
                   cache, config=config, tap_layers=_taps(config))


def _refs(params, config, rows):
    """One causal forward over the rows right-padded to CACHE with random ids: logits at
    position p depend only on row[:p + 1], so one compiled call covers every prefix.
    Returns (logits [B, CACHE, V], taps [B, CACHE, L, H]) as numpy."""
    batch = _padded(rows, [len(r) for r in rows], CACHE, config, seed=11)
    logits, tap = _forward(params, jnp.asarray(batch), config=config, tap_layers=_taps(config))
    return np.asarray(logits), np.asarray(tap)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_ragged_prefill_then_stepwise_extend_equals_full_forward(config):
    params = _params(config)
    lengths, steps = [5, 2, 7], 4
    seqs = _sequences(config, lengths, steps)
    ref_logits, ref_taps = _refs(params, config, seqs)
    prompt = _padded(seqs, lengths, WIDTH, config)

    logits, tap, cache = _run_prefill(params, config, prompt, lengths)
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    assert cache.size == CACHE
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(logits[b, :n]), ref_logits[b, :n], atol=ATOL)
        np.testing.assert_allclose(np.asarray(tap[b, :n]), ref_taps[b, :n], atol=ATOL)
    last, _, _ = _run_prefill(params, config, prompt, lengths, last_logits_only=True)
    assert last.shape == (B, 1, config.vocab_size)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(last[b, 0]), ref_logits[b, n - 1], atol=ATOL)

    for j in range(steps):
        pos = np.asarray(cache.lengths)
        np.testing.assert_array_equal(pos, np.asarray(lengths) + j)
        step = np.array([[s[p]] for s, p in zip(seqs, pos)], np.int32)
        logits, tap, cache = _run_extend(params, config, step, pos, cache)
        for b, p in enumerate(pos):
            np.testing.assert_allclose(np.asarray(logits[b, 0]), ref_logits[b, p], atol=ATOL,
                                       err_msg=f"row {b} step {j}")
            np.testing.assert_allclose(np.asarray(tap[b, 0]), ref_taps[b, p], atol=ATOL)
    np.testing.assert_array_equal(np.asarray(cache.lengths), np.asarray(lengths) + steps)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_block_extend_and_rollback_equal_forward_of_new_sequence(config):
    params = _params(config)
    lengths, blk = [6, 3, 7], 4
    rng = np.random.RandomState(7)
    seqs = _sequences(config, lengths, 0, seed=3)
    _, _, cache = _run_prefill(params, config, _padded(seqs, lengths, WIDTH, config), lengths)
    pos0 = np.asarray(lengths, np.int32)

    # a drafted block of 4 tokens per row, verified in one extend
    draft = rng.randint(0, config.vocab_size, (B, blk)).astype(np.int32)
    logits, _, cache = _run_extend(params, config, draft, pos0, cache)
    np.testing.assert_array_equal(np.asarray(cache.lengths), pos0 + blk)
    ref, _ = _refs(params, config, [np.concatenate([s, d]) for s, d in zip(seqs, draft)])
    for b in range(B):
        np.testing.assert_allclose(np.asarray(logits[b]), ref[b, pos0[b]:pos0[b] + blk],
                                   atol=ATOL)

    # roll back: keep a different number of accepted tokens per row, then extend with
    # new tokens from there (the stale cache entries beyond must stay invisible)
    keep = np.array([1, 3, 0], np.int32)
    new = rng.randint(0, config.vocab_size, (B, 3)).astype(np.int32)
    logits, _, cache = _run_extend(params, config, new, pos0 + keep, cache)
    np.testing.assert_array_equal(np.asarray(cache.lengths), pos0 + keep + 3)
    ref, _ = _refs(params, config, [np.concatenate([seqs[b], draft[b, :keep[b]], new[b]])
                                    for b in range(B)])
    for b in range(B):
        start = pos0[b] + keep[b]
        np.testing.assert_allclose(np.asarray(logits[b]), ref[b, start:start + 3], atol=ATOL)

    # roll back everything to the prompt and decode one token (T = 1)
    tok = rng.randint(0, config.vocab_size, (B, 1)).astype(np.int32)
    logits, _, cache = _run_extend(params, config, tok, pos0, cache)
    ref, _ = _refs(params, config, [np.concatenate([s, t]) for s, t in zip(seqs, tok)])
    for b in range(B):
        np.testing.assert_allclose(np.asarray(logits[b, 0]), ref[b, pos0[b]], atol=ATOL)


def test_prompt_longer_than_cache_raises():
    config = CONFIGS[0]
    tokens = jnp.zeros((B, CACHE + 1), jnp.int32)
    with pytest.raises(ValueError, match=f"prompt length {CACHE + 1} exceeds the KV cache "
                                         f"size {CACHE}"):
        target.prefill(_params(config), tokens, jnp.array([CACHE + 1, 4, 2]), config=config,
                       cache_size=CACHE)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_extend_past_cache_end_raises(config):
    params = _params(config)
    lengths = [5, 3, 7]
    _, _, cache = _run_prefill(params, config, np.zeros((B, WIDTH), np.int32), lengths)
    # row 0 at position 13 + 4 tokens > 16 (the check runs before any compute)
    with pytest.raises(ValueError, match=f"overflows the KV cache of size {CACHE}"):
        target.extend(params, jnp.zeros((B, 4), jnp.int32), jnp.array([13, 3, 0]), cache,
                      config=config)
    with pytest.raises(ValueError, match="do not fit"):
        target.extend(params, jnp.zeros((B, CACHE + 1), jnp.int32), jnp.array([0, 0, 0]),
                      cache, config=config)
    # exactly filling the cache is fine
    _, _, cache = _run_extend(params, config, np.zeros((B, 4), np.int32), [12, 3, 0], cache)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [CACHE, 7, 4])


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_bfloat16_incremental_runs_and_is_close(config):
    p32, p16 = _params(config), _params(config, "bfloat16")
    lengths = [4, 6, 7]
    seqs = _sequences(config, lengths, 1, seed=5)
    prompt = _padded(seqs, lengths, WIDTH, config)
    _, _, c32 = _run_prefill(p32, config, prompt, lengths)
    logits16, taps16, c16 = _run_prefill(p16, config, prompt, lengths)
    assert logits16.dtype == jnp.float32 and c16.k[0].dtype == jnp.bfloat16
    assert taps16.dtype == jnp.bfloat16
    step = np.array([[s[n]] for s, n in zip(seqs, lengths)], np.int32)
    a, _, _ = _run_extend(p32, config, step, lengths, c32)
    b, _, c16 = _run_extend(p16, config, step, lengths, c16)
    a, b = np.asarray(a), np.asarray(b)
    assert np.isfinite(b).all()
    assert np.abs(a - b).max() <= 0.1 * np.abs(a).max()
    np.testing.assert_array_equal(np.asarray(c16.lengths), np.asarray(lengths) + 1)


def test_shape_and_dtype_errors_name_the_argument():
    """chex checks at the entry (trace time: free under jit) name the function, the
    argument and both shapes, before any compute."""
    config = CONFIGS[0]
    params = _params(config)
    tokens = jnp.zeros((B, WIDTH), jnp.int32)
    with pytest.raises(AssertionError, match=r"prefill: tokens must be \[batch, time\]"):
        target.prefill(params, tokens[0], jnp.array([2]), config=config, cache_size=CACHE)
    with pytest.raises(AssertionError, match=r"shape \(2,\) but expected \(3\).*prefill: lengths"):
        target.prefill(params, tokens, jnp.array([2, 2]), config=config, cache_size=CACHE)
    with pytest.raises(AssertionError, match="prefill: tokens must be integer ids"):
        target.prefill(params, tokens.astype(jnp.float32), jnp.array([2, 2, 2]),
                       config=config, cache_size=CACHE)
    cache = target.init_cache(config, B, CACHE)
    with pytest.raises(AssertionError, match=r"extend: positions must be \[batch\]"):
        target.extend(params, tokens[:, :1], jnp.zeros((B, 1), jnp.int32), cache,
                      config=config)
    small = target.init_cache(config, B - 1, CACHE)
    with pytest.raises(AssertionError, match=r"extend: every KV cache buffer must be"):
        target.extend(params, tokens[:, :1], jnp.zeros((B,), jnp.int32), small, config=config)
    with pytest.raises(AssertionError, match="lm_head: hidden must be"):
        target.lm_head(params, jnp.zeros((B, config.hidden_size + 1)), config)
