"""The target decoder LM (Llama / Qwen3) and its pure-functional API.

Public functions take a parameter pytree (a nested dict of arrays, see `PARAM_LAYOUT`)
and arrays; they are jittable with `config` (and the other keyword options) static.

Padding and cache convention
----------------------------
* Prompts are **right-padded**: `tokens[b, :lengths[b]]` are real, the rest is padding
  (any id). Token `t` of row `b` sits at absolute position `t`.
* The KV cache is a fixed-size buffer `[B, S, Nkv, D]` per layer whose index **is** the
  absolute position. `cache.lengths[b]` is the number of valid positions of row `b`.
* A query at position `p` attends to cache entries `0..p`. Entries at or beyond a row's
  length hold stale values (prompt padding, rejected drafts) that are never visible,
  because the next `extend` at that position overwrites them before any query can see
  them. Rolling back a rejected draft is therefore just a smaller `lengths` value.
* `extend(tokens [B, T], positions [B])` writes the new keys/values at
  `positions[b] .. positions[b] + T - 1` and sets `lengths = positions + T`.
"""

from __future__ import annotations

from typing import Any, Sequence

import chex
import jax
import jax.numpy as jnp
from flax import nnx, struct

from dblast_jax.config import TargetConfig
from dblast_jax.models import _nnx_params
from dblast_jax.models._nnx_params import dtype_of as _dtype_of, plain_dict as _plain_dict
from dblast_jax.models.layers import DecoderLayer, RMSNorm, attend, rope_inverse_frequencies

Array = jax.Array
Params = dict[str, Any]

PARAM_LAYOUT = """
embed/embedding                 [V, H]
layers/{i}/input_norm/scale     [H]
layers/{i}/attn/q_proj/kernel   [H, Nq*D]
layers/{i}/attn/k_proj/kernel   [H, Nkv*D]
layers/{i}/attn/v_proj/kernel   [H, Nkv*D]
layers/{i}/attn/o_proj/kernel   [Nq*D, H]
layers/{i}/attn/q_norm/scale    [D]        (Qwen3 only)
layers/{i}/attn/k_norm/scale    [D]        (Qwen3 only)
layers/{i}/post_attn_norm/scale [H]
layers/{i}/mlp/gate_proj/kernel [H, F]
layers/{i}/mlp/up_proj/kernel   [H, F]
layers/{i}/mlp/down_proj/kernel [F, H]
final_norm/scale                [H]
lm_head/kernel                  [H, V]     (untied heads only)
"""


@struct.dataclass
class KVCache:
    """Per-layer key/value buffers (tuples, one entry per layer) and per-row lengths."""

    k: tuple[Array, ...]  # each [B, S, Nkv, D]
    v: tuple[Array, ...]  # each [B, S, Nkv, D]
    lengths: Array  # [B] int32

    @property
    def size(self) -> int:
        return self.k[0].shape[1]


class TargetLM(nnx.Module):
    def __init__(self, config: TargetConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        c = config
        self.embed = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype,
                               embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.layers = nnx.List([
            DecoderLayer(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
                         c.head_dim, c.use_qk_norm, c.rms_norm_eps, rngs, dtype)
            for _ in range(c.num_layers)])
        self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        if not c.tie_word_embeddings:
            self.lm_head = nnx.Linear(c.hidden_size, c.vocab_size, use_bias=False, dtype=dtype,
                                      param_dtype=dtype,
                                      kernel_init=nnx.initializers.normal(0.02), rngs=rngs)


# ---- params <-> module ------------------------------------------------------------------

def _module(params: Params, config: TargetConfig) -> TargetLM:
    return _nnx_params.module_from_params(TargetLM, params, config)


def abstract_params(config: TargetConfig, dtype=jnp.float32) -> Params:
    """Parameter shapes/dtypes (`jax.ShapeDtypeStruct` leaves) without allocating."""
    return _nnx_params.abstract_params(TargetLM, config, dtype)


def init_params(config: TargetConfig, rng: Array | int = 0, dtype=jnp.float32) -> Params:
    """Random parameters (normal(0.02) kernels, unit norms), for tests and benchmarks."""
    seed = rng if isinstance(rng, int) else jax.random.randint(rng, (), 0, 2**31 - 1)
    model = TargetLM(config, nnx.Rngs(seed), jnp.dtype(dtype))
    return _plain_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def num_params(params: Params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))


# ---- pure functions ---------------------------------------------------------------------

def embed(params: Params, tokens: Array) -> Array:
    """tokens [B, T] int -> embeddings [B, T, H] in the parameter dtype."""
    chex.assert_type(tokens, int, custom_message="embed: token ids must be integers")
    return jnp.take(params["embed"]["embedding"], tokens, axis=0)


def lm_head(params: Params, hidden: Array, config: TargetConfig) -> Array:
    """Final-normed hidden [.., H] -> float32 logits [.., V] (tied or untied head)."""
    chex.assert_axis_dimension(hidden, -1, config.hidden_size,
                               custom_message="lm_head: hidden must be [.., hidden_size]")
    chex.assert_type(hidden, float, custom_message="lm_head: hidden must be floating point")
    if config.tie_word_embeddings:
        w = params["embed"]["embedding"]
        return jnp.einsum("...h,vh->...v", hidden, w, preferred_element_type=jnp.float32)
    w = params["lm_head"]["kernel"]
    return jnp.einsum("...h,hv->...v", hidden, w, preferred_element_type=jnp.float32)


def init_cache(config: TargetConfig, batch: int, size: int, dtype=jnp.float32) -> KVCache:
    shape = (batch, size, config.num_kv_heads, config.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
    return KVCache(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
                   lengths=jnp.zeros((batch,), jnp.int32))


def _check_tokens(fn: str, tokens, row_values, row_name: str) -> None:
    """Trace-time (free under jit) shape / dtype checks shared by `prefill` / `extend`:
    tokens [B, T] int and a per-row int vector [B] (prompt lengths or start positions)."""
    chex.assert_rank(tokens, 2, custom_message=f"{fn}: tokens must be [batch, time]")
    chex.assert_type(tokens, int, custom_message=f"{fn}: tokens must be integer ids")
    chex.assert_shape(row_values, (tokens.shape[0],),
                      custom_message=f"{fn}: {row_name} must be [batch] = "
                                     f"[{tokens.shape[0]}] like tokens {tuple(tokens.shape)}")
    chex.assert_type(row_values, int, custom_message=f"{fn}: {row_name} must be integers")


def check_cache(fn: str, cache: "KVCache", batch: int, num_layers: int, num_kv_heads: int,
                head_dim: int) -> None:
    """A KV cache of `num_layers` K and V buffers, each [batch, S, num_kv_heads, head_dim],
    and lengths [batch] (trace-time checks)."""
    if len(cache.k) != num_layers or len(cache.v) != num_layers:
        raise ValueError(f"{fn}: the KV cache has {len(cache.k)} K / {len(cache.v)} V "
                         f"buffers for a {num_layers}-layer model")
    shape = (batch, cache.size, num_kv_heads, head_dim)
    chex.assert_shape(cache.k + cache.v, shape,
                      custom_message=f"{fn}: every KV cache buffer must be [batch, size, "
                                     f"kv_heads, head_dim] = {shape}")
    chex.assert_shape(cache.lengths, (batch,),
                      custom_message=f"{fn}: cache.lengths must be [batch] = [{batch}]")


def _check_taps(tap_layers: Sequence[int], config: TargetConfig) -> tuple[int, ...]:
    taps = tuple(int(i) for i in tap_layers)
    for i in taps:
        if not 0 <= i < config.num_layers:
            raise ValueError(f"tap layer {i} out of range for a {config.num_layers}-layer target")
    return taps


def _write_rows(buf: Array, new: Array, starts: Array) -> Array:
    """buf [B, S, N, D], new [B, T, N, D]: row b written at starts[b] (per-row offset)."""
    def one(row_buf, row_new, start):
        return jax.lax.dynamic_update_slice(row_buf, row_new.astype(row_buf.dtype),
                                            (start, 0, 0))
    return jax.vmap(one)(buf, new, starts)


def _run_layers(model: TargetLM, config: TargetConfig, x: Array, positions: Array,
                attend_fn, taps: tuple[int, ...]):
    """Shared layer loop (unrolled: on CPU a scan over layers copies the caches)."""
    inv_freq = rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    tapped = {}
    new_k, new_v = [], []
    for i, layer in enumerate(model.layers):
        h = layer.input_norm(x)
        q = layer.attn.queries(h, positions, inv_freq)
        k, v = layer.attn.keys_values(h, positions, inv_freq)
        out, k_store, v_store = attend_fn(i, q, k, v)
        new_k.append(k_store)
        new_v.append(v_store)
        x = layer.finish(x, out)
        if i in taps:
            tapped[i] = x
    normed = model.final_norm(x)
    if config.num_layers - 1 in tapped:  # HF's last hidden_states entry is post-norm
        tapped[config.num_layers - 1] = normed
    tap_arr = (jnp.stack([tapped[i] for i in taps], axis=2) if taps else None)
    return normed, tap_arr, tuple(new_k), tuple(new_v)


def _gather_last(x: Array, lengths: Array) -> Array:
    """x [B, T, ...] -> x[b, lengths[b] - 1] as [B, 1, ...]."""
    idx = jnp.clip(lengths - 1, 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, idx.reshape((-1, 1) + (1,) * (x.ndim - 2)), axis=1)


def prefill(params: Params, tokens: Array, lengths: Array, *, config: TargetConfig,
            cache_size: int, tap_layers: Sequence[int] = (), last_logits_only: bool = False,
            cache_dtype=None):
    """Run right-padded prompts through the model and fill a fresh KV cache.

    tokens: [B, T] int; lengths: [B] int (1 <= lengths <= T <= cache_size).
    Returns (logits, taps, cache):
      logits [B, T, V] float32 ([B, 1, V] at each row's last real token if
      `last_logits_only`), taps [B, T, n_taps, H] (hidden states after each layer in
      `tap_layers`, HF `hidden_states[i + 1]`) or None, and the cache with `lengths` set.
    """
    lengths = jnp.asarray(lengths)
    _check_tokens("prefill", tokens, lengths, "lengths")
    b, t = tokens.shape
    if t > cache_size:
        raise ValueError(f"prompt length {t} exceeds the KV cache size {cache_size}; "
                         "raise cache_size or shorten the prompt")
    _check_concrete_lengths(lengths, t)
    taps = _check_taps(tap_layers, config)
    model = _module(params, config)
    dtype = cache_dtype or _dtype_of(params)
    cache = init_cache(config, b, cache_size, dtype)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    causal = jnp.tril(jnp.ones((t, t), bool))[None]
    mask = jnp.broadcast_to(causal, (b, t, t))

    def attend_fn(i, q, k, v):
        out = attend(q, k, v, mask)
        kb = jax.lax.dynamic_update_slice(cache.k[i], k.astype(dtype), (0, 0, 0, 0))
        vb = jax.lax.dynamic_update_slice(cache.v[i], v.astype(dtype), (0, 0, 0, 0))
        return out, kb, vb

    hidden, tap_arr, ks, vs = _run_layers(model, config, embed(params, tokens), positions,
                                          attend_fn, taps)
    if last_logits_only:
        hidden = _gather_last(hidden, lengths)
    logits = lm_head(params, hidden, config)
    return logits, tap_arr, KVCache(k=ks, v=vs, lengths=jnp.asarray(lengths, jnp.int32))


def extend(params: Params, tokens: Array, positions: Array, cache: KVCache, *,
           config: TargetConfig, tap_layers: Sequence[int] = ()):
    """Append T tokens per row at per-row start positions and attend over the cache.

    tokens: [B, T] int; positions: [B] int, the absolute position of tokens[:, 0]
    (positions + T <= cache size). Used for one-token decoding (T = 1) and for
    verifying a drafted block (T = b). Returns (logits [B, T, V] float32,
    taps [B, T, n_taps, H] or None, cache with lengths = positions + T).
    """
    positions = jnp.asarray(positions)
    _check_tokens("extend", tokens, positions, "positions")
    b, t = tokens.shape
    check_cache("extend", cache, b, config.num_layers, config.num_kv_heads, config.head_dim)
    taps = _check_taps(tap_layers, config)
    s = cache.size
    if t > s:
        raise ValueError(f"{t} new tokens do not fit in a KV cache of size {s}")
    _check_concrete_positions(positions, t, s)
    positions = jnp.asarray(positions, jnp.int32)
    model = _module(params, config)
    pos = positions[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    mask = jnp.arange(s, dtype=jnp.int32)[None, None, :] <= pos[:, :, None]  # [B, T, S]

    def attend_fn(i, q, k, v):
        kb = _write_rows(cache.k[i], k, positions)
        vb = _write_rows(cache.v[i], v, positions)
        return attend(q, kb, vb, mask), kb, vb

    hidden, tap_arr, ks, vs = _run_layers(model, config, embed(params, tokens), pos,
                                          attend_fn, taps)
    logits = lm_head(params, hidden, config)
    return logits, tap_arr, KVCache(k=ks, v=vs, lengths=positions + t)


def forward(params: Params, tokens: Array, *, config: TargetConfig,
            tap_layers: Sequence[int] = ()):
    """Full causal forward without padding: tokens [B, T] -> (logits [B, T, V], taps)."""
    chex.assert_rank(tokens, 2, custom_message="forward: tokens must be [batch, time]")
    b, t = tokens.shape
    lengths = jnp.full((b,), t, jnp.int32)
    logits, taps, _ = prefill(params, tokens, lengths, config=config, cache_size=t,
                              tap_layers=tap_layers)
    return logits, taps


# ---- host-side validation (skipped when traced) -------------------------------------------

def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_concrete_lengths(lengths, t: int) -> None:
    if _is_concrete(lengths):
        import numpy as np
        arr = np.asarray(lengths)
        if arr.size and (arr.min() < 1 or arr.max() > t):
            raise ValueError(f"prompt lengths must lie in [1, {t}] (the padded width); "
                             f"got min {arr.min()}, max {arr.max()}")


def _check_concrete_positions(positions, t: int, s: int) -> None:
    if _is_concrete(positions):
        import numpy as np
        arr = np.asarray(positions)
        if arr.size and (arr.min() < 0 or arr.max() + t > s):
            raise ValueError(f"writing {t} tokens at position {arr.max()} overflows the KV "
                             f"cache of size {s}; allocate a larger cache")
