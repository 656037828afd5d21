"""The DBlast drafter: a DFlash block drafter plus a latent-mixture head (Flax NNX).

Architecture (docs/METHOD.md section 2): target hidden states tapped after
`target_layer_ids` are concatenated along features and mapped by `fc` + `hidden_norm`
to *context features*. A block `[anchor, MASK x (b - 1)]` embedded with the target's
embedding runs through Qwen3-style decoder layers whose attention keys/values are
`[context ; block]` (the context features go through the same `k_proj` / `v_proj` /
`k_norm` as the block, without the layer's input norm) and is not causal. A final norm
gives the base hidden state `u`. The drafter owns no embedding and no LM head: the
target's are passed in on every call (`tparams`) and never copied.

DBlast additions (K = `num_categories`):
* **Category hidden expander** (present when `expander_width > 0`): branch z uses
  `u + offset_z(u)` with `offset_z(u) = W2_z silu(W1_z u)`, a per-category low-rank MLP
  of width `expander_width` on the final-normed state. The offset is added *after* the
  final norm, so branch z's logits are DFlash's logits plus `lm_head(offset_z(u))`;
  zero offsets give DFlash exactly.
* **Category prior head** (K > 1): `prior_logits = u_anchor @ W + c`, read from the
  final-normed hidden state of block slot 0 (the anchor). Why that state: it gets no
  token loss, so it is free to summarise; attention is not causal, so it has seen all
  visible context and the whole block; and it exists before any branch is chosen, so a
  sampler can draw z first and then project only that branch through the (expensive)
  LM head. Pooling over MASK slots would mix in states specialised to one position's
  token. The head starts at zero (uniform prior), which is harmless: symmetry is broken
  by the expander, see `Expander`.

Serial correction head (`correction = "previous-token"`, rank r; dblast_jax/correction.py
drafts with it): position i's branch state gets `+ offset(x_{i-1}, h_i)`, a rank-r map of
the token at position i - 1 (the anchor for i = 1) and of the branch's own state, see
`Correction`. `train_hidden` applies it teacher-forced (x_{i-1} is the data token);
`draft_hidden` returns the uncorrected parallel states and the sampler adds the
correction serially, left to right, from the tokens it drafts.

Causal block (`block_attention = "causal"`; dblast_jax/block_causal.py drafts with it):
block position i attends to the context and to block positions <= i only (its own input
is MASK while it is drafted, so it conditions on the anchor and the tokens before it).
Drafting is left to right, one pass per position over [anchor, d_1 .. d_{i-1}, MASK ..]
(`causal_pass` reruns the block, `causal_step` computes only the two positions that
change, keeping the drafted positions' keys / values); `train_hidden` computes every
such pass at once, teacher-forced, with two streams in one block
(`teacher_forced_layout`). `draft_hidden` runs one causal pass over [anchor, MASK ..]
(position 1's state is the first drafting pass's).

Parameters are a plain nested dict (see `PARAM_LAYOUT`), separate from the target's.
All public functions are jittable with the configs (keyword arguments) static.

Draft KV cache: a `target.KVCache` with one `[B, S, Nkv, D]` buffer per drafter layer
holding **context** keys/values only (post k_norm, roped at absolute positions); the
index is the absolute position, as in the target's cache. A block anchored at `s`
sees entries with index `< s` strictly; entries at or beyond `s` may be stale (rejected
positions, prompt padding) and are never visible. The block's own keys/values are
recomputed in every draft pass and never stored.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dblast_jax import sharding
from dblast_jax.config import DrafterConfig, TargetConfig
from dblast_jax.models import _nnx_params
from dblast_jax.models import target as target_lib
from dblast_jax.models.layers import DecoderLayer, RMSNorm, RowLinear, rope_inverse_frequencies
from dblast_jax.models._nnx_params import dtype_of as _dtype_of
from dblast_jax.models.target import KVCache

Array = jax.Array
Params = dict[str, Any]

PARAM_LAYOUT = """
fc/kernel                        [n_taps*H, H]
hidden_norm/scale                [H]
layers/{i}/input_norm/scale      [H]
layers/{i}/attn/q_proj/kernel    [H, Nq*D]
layers/{i}/attn/k_proj/kernel    [H, Nkv*D]
layers/{i}/attn/v_proj/kernel    [H, Nkv*D]
layers/{i}/attn/o_proj/kernel    [Nq*D, H]
layers/{i}/attn/q_norm/scale     [D]
layers/{i}/attn/k_norm/scale     [D]
layers/{i}/post_attn_norm/scale  [H]
layers/{i}/mlp/gate_proj/kernel  [H, F]
layers/{i}/mlp/up_proj/kernel    [H, F]
layers/{i}/mlp/down_proj/kernel  [F, H]
final_norm/scale                 [H]
mask_embedding                   [H]        (learned mask mode: mask_token_id is None)
expander/in_kernel               [K, H, E]  (expander_width E > 0)
expander/out_kernel              [K, E, H]  (expander_width E > 0)
prior/kernel                     [H, K]     (K > 1)
prior/bias                       [K]        (K > 1)
correction/prev_kernel           [H, r]     (correction "previous-token", rank r)
correction/ctx_kernel            [H, r]     (correction "previous-token")
correction/out_kernel            [r, H]     (correction "previous-token"; starts at zero)
"""

DraftCache = KVCache  # same layout and convention as the target's cache

# Offsets start with rms ~ EXPANDER_INIT_OFFSET_RMS (u itself has rms ~ 1): small enough
# that every branch starts close to the DFlash prediction, large enough that the
# branches already differ at step 0.
EXPANDER_INIT_OFFSET_RMS = 0.1


# ---- modules ----------------------------------------------------------------------------

class Expander(nnx.Module):
    """K per-category low-rank MLPs: offset_z(u) = silu(u @ W1_z) @ W2_z.

    Symmetry breaking. Branches z and z' are interchangeable in every loss (the mixture
    sums over z and the prior starts uniform), so if their parameters are equal they
    produce equal outputs, receive equal gradients and stay equal forever: the mixture
    collapses to K copies of one branch and K > 1 buys nothing. Zero-initialising both
    matrices is worse still: silu(0 @ W1) = 0 kills the gradient of W2 and W2 = 0 kills
    the gradient of W1, a stationary point where no branch ever moves off DFlash. So
    W1_z and W2_z are drawn independently per category (one normal draw of the stacked
    [K, ...] tensors): the offsets, hence the branches, differ from the first step, while
    their small scale (offset rms ~ EXPANDER_INIT_OFFSET_RMS against |u| rms ~ 1) keeps
    every branch close to the shared DFlash prediction — important when the body starts
    from a pretrained DFlash checkpoint.
    """

    def __init__(self, num_categories: int, hidden_size: int, width: int, rngs: nnx.Rngs,
                 dtype=jnp.float32):
        k, h, e = num_categories, hidden_size, width
        in_std = 1.0 / math.sqrt(h)  # u has rms ~ 1 -> pre-activations of rms ~ 1
        out_std = EXPANDER_INIT_OFFSET_RMS / math.sqrt(e)
        self.in_kernel = nnx.Param(
            (in_std * jax.random.normal(rngs.params(), (k, h, e), jnp.float32)).astype(dtype))
        self.out_kernel = nnx.Param(
            (out_std * jax.random.normal(rngs.params(), (k, e, h), jnp.float32)).astype(dtype))

    def __call__(self, u: Array) -> Array:
        """u [.., J, H] -> offsets [.., K, J, H]."""
        a = jax.nn.silu(jnp.einsum("...jh,zhe->...zje", u, self.in_kernel[...]))
        return jnp.einsum("...zje,zeh->...zjh", a, self.out_kernel[...])


class PriorHead(nnx.Module):
    """Linear head on the anchor slot's final-normed state -> logits of pi(z | y)."""

    def __init__(self, hidden_size: int, num_categories: int, dtype=jnp.float32):
        self.kernel = nnx.Param(jnp.zeros((hidden_size, num_categories), dtype))
        self.bias = nnx.Param(jnp.zeros((num_categories,), dtype))

    def __call__(self, u_anchor: Array) -> Array:
        """u_anchor [.., H] -> float32 logits [.., K]."""
        logits = jnp.einsum("...h,hk->...k", u_anchor, self.kernel[...],
                            preferred_element_type=jnp.float32)
        return logits + self.bias[...].astype(jnp.float32)


def rms_normalize(x: Array, eps: float) -> Array:
    """x / rms(x) over the last axis, in float32 (no learned scale)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class Correction(nnx.Module):
    """The serial correction head: offset(x_prev, h) = silu(e W_p + h W_c) W_o, rank r.

    e is the target's (frozen) input embedding of the previous token x_prev, RMS-normalised
    (no learned scale); h is the branch's final-normed state at this position; W_p, W_c
    are [H, r] and W_o [r, H]. The offset is added to h, so the corrected logits are
    `lm_head(h + offset) = lm_head(h) + silu(a) @ lm_head(W_o)`.

    Why this shape. (1) It reuses the target's embedding and LM head, so it owns 3 H r
    parameters and no [V]-sized table. (2) The part that depends on x_prev is one row
    lookup and an [H] x [H, r] product, and the part that reaches the vocabulary is a rank-r
    basis lm_head(W_o) [r, V]: a serial step costs O(H r + r V), far below one LM head row
    (O(H V)) or a drafter pass, and h W_c comes from the parallel pass for every position
    at once. (3) Mixing h into the activation makes the correction depend on what
    position i was about to say, not only on a bigram of x_prev. (4) In hidden space every
    training path (chunked log-softmax, the sampled head, distillation) takes the corrected
    state unchanged.

    Initialisation: W_o = 0 (so a new head is exactly the drafter without it, and W_p, W_c
    get gradients once W_o moves, as in LoRA), W_p and W_c normal with std 1 / sqrt(H)
    (e and h have rms ~ 1: pre-activations of rms ~ sqrt(2))."""

    def __init__(self, hidden_size: int, rank: int, eps: float, rngs: nnx.Rngs,
                 dtype=jnp.float32):
        std = 1.0 / math.sqrt(hidden_size)
        self.prev_kernel = nnx.Param((std * jax.random.normal(
            rngs.params(), (hidden_size, rank), jnp.float32)).astype(dtype))
        self.ctx_kernel = nnx.Param((std * jax.random.normal(
            rngs.params(), (hidden_size, rank), jnp.float32)).astype(dtype))
        self.out_kernel = nnx.Param(jnp.zeros((rank, hidden_size), dtype))
        self.eps = eps

    def prev_features(self, prev_embed: Array) -> Array:
        """Target embeddings of the previous tokens [.., H] -> [.., r] float32."""
        e = rms_normalize(prev_embed, self.eps).astype(self.prev_kernel[...].dtype)
        return jnp.einsum("...h,hr->...r", e, self.prev_kernel[...],
                          preferred_element_type=jnp.float32)

    def ctx_features(self, hidden: Array) -> Array:
        """Branch states [.., H] -> [.., r] float32."""
        return jnp.einsum("...h,hr->...r", hidden, self.ctx_kernel[...],
                          preferred_element_type=jnp.float32)

    def __call__(self, prev_embed: Array, hidden: Array) -> Array:
        """prev_embed, hidden [.., H] (broadcastable) -> offsets [.., H] in hidden's dtype."""
        a = jax.nn.silu(self.prev_features(prev_embed) + self.ctx_features(hidden))
        return jnp.einsum("...r,rh->...h", a.astype(self.out_kernel[...].dtype),
                          self.out_kernel[...]).astype(hidden.dtype)


class Drafter(nnx.Module):
    def __init__(self, config: DrafterConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        c = config
        n_taps = len(c.target_layer_ids)
        self.fc = RowLinear(n_taps * c.hidden_size, c.hidden_size, use_bias=False,
                            dtype=dtype, param_dtype=dtype,
                            kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.layers = nnx.List([
            DecoderLayer(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
                         c.head_dim, True, c.rms_norm_eps, rngs, dtype)
            for _ in range(c.num_layers)])
        self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        if c.mask_token_id is None:
            self.mask_embedding = nnx.Param(
                (0.02 * jax.random.normal(rngs.params(), (c.hidden_size,), jnp.float32))
                .astype(dtype))
        if c.expander_width > 0:
            self.expander = Expander(c.num_categories, c.hidden_size, c.expander_width,
                                     rngs, dtype)
        if c.num_categories > 1:
            self.prior = PriorHead(c.hidden_size, c.num_categories, dtype)
        if c.correction != "none":
            self.correction = Correction(c.hidden_size, c.correction_rank, c.rms_norm_eps,
                                         rngs, dtype)


# ---- params <-> module ------------------------------------------------------------------

def _module(dparams: Params, config: DrafterConfig) -> Drafter:
    return _nnx_params.module_from_params(Drafter, dparams, config)


def check_drafter_fits_target(drafter_config: DrafterConfig,
                              target_config: TargetConfig) -> None:
    """Raise ValueError (naming both values) if the drafter cannot run on this target."""
    d, t = drafter_config, target_config
    if d.hidden_size != t.hidden_size:
        raise ValueError(f"drafter hidden_size {d.hidden_size} does not match the target's "
                         f"hidden_size {t.hidden_size}: the drafter uses the target's "
                         "embedding, LM head and hidden states")
    if d.num_target_layers != t.num_layers:
        raise ValueError(f"drafter was built for a {d.num_target_layers}-layer target, but "
                         f"the target ({t.name}) has {t.num_layers} layers")
    bad = [i for i in d.target_layer_ids if not 0 <= i < t.num_layers]
    if bad:
        raise ValueError(f"target_layer_ids {list(d.target_layer_ids)} do not fit a "
                         f"{t.num_layers}-layer target (out of range: {bad})")
    if d.mask_token_id is not None and not 0 <= d.mask_token_id < t.vocab_size:
        raise ValueError(f"mask_token_id {d.mask_token_id} is outside the target's "
                         f"vocabulary (size {t.vocab_size})")
    if d.vocab_size and d.vocab_size != t.vocab_size:
        raise ValueError(f"drafter vocab_size {d.vocab_size} does not match the target's "
                         f"vocab_size {t.vocab_size}")


def abstract_drafter_params(drafter_config: DrafterConfig,
                            target_config: Optional[TargetConfig], dtype=jnp.float32) -> Params:
    """Parameter shapes/dtypes (`jax.ShapeDtypeStruct` leaves) without allocating.
    target_config None: the drafter's own shapes, without checking it fits a target
    (restoring a training checkpoint needs no target)."""
    if target_config is not None:
        check_drafter_fits_target(drafter_config, target_config)
    return _nnx_params.abstract_params(Drafter, drafter_config, dtype)


def init_drafter_params(drafter_config: DrafterConfig, target_config: TargetConfig,
                        rng: Array | int = 0, dtype=jnp.float32) -> Params:
    """Random drafter parameters: normal(0.02) kernels and mask embedding, unit norms,
    small independent per-category expander weights, zero prior head (see `Expander`),
    and a correction head that starts at zero (`Correction`).

    The values follow the module initialisers but are drawn with numpy on the host:
    on CPU that is seconds faster than dispatching or compiling hundreds of small XLA
    ops, and it is deterministic in `rng` (an int seed or a JAX key)."""
    check_drafter_fits_target(drafter_config, target_config)
    seed = rng if isinstance(rng, int) else int(jax.random.randint(rng, (), 0, 2**31 - 1))
    gen = np.random.default_rng(seed)
    abstract = abstract_drafter_params(drafter_config, target_config, dtype)
    np_dtype = np.dtype(jnp.dtype(dtype))
    h, e = drafter_config.hidden_size, max(drafter_config.expander_width, 1)

    def leaf(path, a):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if name.endswith("scale"):
            x = np.ones(a.shape, np.float32)
        elif name.startswith("prior/") or name == "correction/out_kernel":
            x = np.zeros(a.shape, np.float32)
        else:
            std = {"expander/in_kernel": 1.0 / math.sqrt(h),
                   "correction/prev_kernel": 1.0 / math.sqrt(h),
                   "correction/ctx_kernel": 1.0 / math.sqrt(h),
                   "expander/out_kernel": EXPANDER_INIT_OFFSET_RMS / math.sqrt(e)}.get(name, 0.02)
            x = std * gen.standard_normal(a.shape, np.float32)
        return jnp.asarray(x.astype(np_dtype))

    return jax.tree_util.tree_map_with_path(leaf, abstract)


def tempered_prior_params(dparams: Params, category_temperature: float) -> Params:
    """The same drafter with prior logits divided by Z_T = `category_temperature`.

    The prior head is affine (`u W + c`), so scaling W and c by 1 / Z_T is exact: every
    function that reads the prior (losses, validation, the sampler's draw) then sees
    pi' = softmax(prior_logits / Z_T) without a Z_T argument of its own. K = 1 drafters
    have no prior and are returned unchanged."""
    if category_temperature <= 0:
        raise ValueError(f"category_temperature must be > 0, got {category_temperature}")
    if "prior" not in dparams or category_temperature == 1.0:
        return dparams
    scale = 1.0 / float(category_temperature)
    prior = {k: (v.astype(jnp.float32) * scale).astype(v.dtype)
             for k, v in dparams["prior"].items()}
    return {**dparams, "prior": prior}


def num_drafter_params(dparams: Params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(dparams))


# ---- pure functions ---------------------------------------------------------------------

def _inv_freq(config: DrafterConfig) -> Array:
    return rope_inverse_frequencies(config.head_dim, config.rope_theta)


def _features(model: Drafter, taps: Array, dtype) -> Array:
    b, t, n, h = taps.shape
    x = taps.astype(dtype).reshape(b, t, n * h)
    return model.hidden_norm(model.fc(x))


def context_features(dparams: Params, taps: Array, *, drafter_config: DrafterConfig) -> Array:
    """taps [B, T, n_taps, H] (target layer order) -> context features [B, T, H]:
    concatenate along features, `fc`, `hidden_norm`."""
    _check_taps(taps, drafter_config)
    return _features(_module(dparams, drafter_config), taps, _dtype_of(dparams))


def _check_draft_cache(fn: str, cache: KVCache, batch: int, config: DrafterConfig) -> None:
    target_lib.check_cache(fn, cache, batch, config.num_layers, config.num_kv_heads,
                           config.head_dim)


def _check_taps(taps, config: DrafterConfig) -> None:
    n = len(config.target_layer_ids)
    if taps.ndim != 4 or taps.shape[2] != n or taps.shape[3] != config.hidden_size:
        raise ValueError(f"taps must be [B, T, {n}, {config.hidden_size}] (one slice per "
                         f"target layer id {list(config.target_layer_ids)}); got "
                         f"{tuple(taps.shape)}")
    chex.assert_type(taps, float, custom_message="taps (target hidden states) must be "
                     "floating point")


def init_draft_cache(drafter_config: DrafterConfig, batch: int, size: int,
                     dtype=jnp.float32) -> KVCache:
    """An empty draft cache: per drafter layer a [batch, size, Nkv, D] K and V buffer."""
    shape = (batch, size, drafter_config.num_kv_heads, drafter_config.head_dim)
    n = drafter_config.num_layers
    return KVCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(n)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(n)),
                   lengths=jnp.zeros((batch,), jnp.int32))


def append_context(dparams: Params, taps: Array, positions: Array, cache: KVCache, *,
                   drafter_config: DrafterConfig) -> KVCache:
    """Project new target features into every drafter layer's context K/V.

    taps: [B, T, n_taps, H] features of the tokens at absolute positions
    `positions[b] .. positions[b] + T - 1` (positions: [B] int, the start). Each layer's
    `k_proj` -> `k_norm` -> RoPE (absolute positions) and `v_proj` are written at those
    indices; `lengths = positions + T`. Writing more than was accepted is fine: entries
    at or beyond the next anchor are never visible and get overwritten later.
    """
    _check_taps(taps, drafter_config)
    b, t = taps.shape[:2]
    positions = jnp.asarray(positions)
    chex.assert_shape(positions, (b,), custom_message=f"append_context: positions must be "
                      f"[batch] = [{b}] like taps {tuple(taps.shape)}")
    chex.assert_type(positions, int, custom_message="append_context: positions must be integers")
    _check_draft_cache("append_context", cache, b, drafter_config)
    if t > cache.size:
        raise ValueError(f"{t} context positions do not fit in a draft cache of size "
                         f"{cache.size}")
    if target_lib._is_concrete(positions):
        arr = np.asarray(positions)
        if arr.size and (arr.min() < 0 or arr.max() + t > cache.size):
            raise ValueError(f"writing {t} context positions at position {arr.max()} "
                             f"overflows the draft cache of size {cache.size}")
    positions = jnp.asarray(positions, jnp.int32)
    model = _module(dparams, drafter_config)
    feats = _features(model, taps, _dtype_of(dparams))
    pos = positions[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    inv_freq = _inv_freq(drafter_config)
    ks, vs = [], []
    for i, layer in enumerate(model.layers):
        k, v = layer.attn.keys_values(feats, pos, inv_freq)
        ks.append(target_lib._write_rows(cache.k[i], k, positions))
        vs.append(target_lib._write_rows(cache.v[i], v, positions))
    return KVCache(k=tuple(ks), v=tuple(vs), lengths=positions + t)


def _block_attend(q: Array, k_ctx: Array, v_ctx: Array, ctx_visible: Array,
                  k_blk: Array, v_blk: Array, blk_visible: Optional[np.ndarray] = None) -> Array:
    """Attention of A blocks over [shared context ; own block] (block-sparse, no loop).

    q: [B, A, b, Nq, D]; k_ctx, v_ctx: [B, S, Nkv, D]; ctx_visible: [B, A, S] bool;
    k_blk, v_blk: [B, A, b, Nkv, D]. Block a's queries see the context entries marked
    visible for it and all b keys of block a, none of any other block. One softmax over
    the S + b logits in float32 -> [B, A, b, Nq * D]. Equivalent to a dense mask over
    [context ; all A blocks] without materialising the A*b x A*b block part.
    blk_visible: a static [b, b] bool (query slot, key slot) mask inside every block, each
    row with its diagonal set (a causal block); None: all b keys (bidirectional).
    """
    n, a, j, nq, d = q.shape
    nkv = k_ctx.shape[2]
    q = q.reshape(n, a, j, nkv, nq // nkv, d)
    scale = d ** -0.5
    s_ctx = jnp.einsum("najkgd,nskd->nakgjs", q, k_ctx,
                       preferred_element_type=jnp.float32) * scale
    s_ctx = jnp.where(ctx_visible[:, :, None, None, None, :], s_ctx, -jnp.inf)
    s_blk = jnp.einsum("najkgd,naikd->nakgji", q, k_blk,
                       preferred_element_type=jnp.float32) * scale
    if blk_visible is not None:
        s_blk = jnp.where(jnp.asarray(blk_visible), s_blk, -jnp.inf)
    scores = jnp.concatenate([s_ctx, s_blk], axis=-1)
    weights = jax.nn.softmax(scores, axis=-1)  # block keys always visible: finite max
    w_ctx = weights[..., :k_ctx.shape[1]].astype(v_ctx.dtype)
    w_blk = weights[..., k_ctx.shape[1]:].astype(v_blk.dtype)
    out = (jnp.einsum("nakgjs,nskd->najkgd", w_ctx, v_ctx)
           + jnp.einsum("nakgji,naikd->najkgd", w_blk, v_blk))
    return out.reshape(n, a, j, nq * d)


def _block_embeddings(model: Drafter, config: DrafterConfig, tparams: Params,
                      anchor_tokens: Array, dtype) -> Array:
    """anchor_tokens [B, A] -> block inputs [B, A, b, H]: [anchor, MASK x (b - 1)]."""
    anchor = target_lib.embed(tparams, anchor_tokens).astype(dtype)  # [B, A, H]
    if config.mask_token_id is None:
        mask = model.mask_embedding[...].astype(dtype)
    else:
        mask = tparams["embed"]["embedding"][config.mask_token_id].astype(dtype)
    masks = jnp.broadcast_to(mask, anchor.shape[:2] + (config.block_size - 1, mask.shape[-1]))
    return jnp.concatenate([anchor[:, :, None, :], masks], axis=2)


def _mask_embedding(model: Drafter, config: DrafterConfig, tparams: Params, dtype) -> Array:
    if config.mask_token_id is None:
        return model.mask_embedding[...].astype(dtype)
    return tparams["embed"]["embedding"][config.mask_token_id].astype(dtype)


def _token_block_embeddings(model: Drafter, config: DrafterConfig, tparams: Params,
                            block_tokens: Array, dtype) -> Array:
    """block_tokens [B, A, J] int -> block inputs [B, A, J, H]: each token's embedding,
    the MASK input where the id is negative (a position not drafted yet)."""
    emb = target_lib.embed(tparams, jnp.maximum(block_tokens, 0)).astype(dtype)
    return jnp.where(block_tokens[..., None] < 0,
                     _mask_embedding(model, config, tparams, dtype), emb)


def causal_block_mask(block_size: int) -> np.ndarray:
    """The in-block mask of a causal block when drafting: slot i sees slots 0 .. i (the
    anchor, the drafted tokens before it, and its own MASK input)."""
    return np.tril(np.ones((block_size, block_size), bool))


def teacher_forced_layout(block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, in-block mask) of a causal block's training pass: two streams in one
    block of 2 (b - 1) slots. Content slots 0 .. b-2 hold the anchor and the data tokens
    x_1 .. x_{b-2} at offsets 0 .. b-2 and see content slots up to themselves; the query
    slot of position i (1 .. b-1) holds MASK at offset i and sees content slots 0 .. i-1
    and itself. A content slot computes exactly what the drafting pass computes at a slot
    holding a drafted token, and query slot i what it computes at the MASK slot i once
    slots 1 .. i-1 hold tokens: the drafting passes' states, all in one pass."""
    c = block_size - 1
    offsets = np.concatenate([np.arange(c), np.arange(1, block_size)]).astype(np.int32)
    visible = np.zeros((2 * c, 2 * c), bool)
    visible[:c, :c] = np.tril(np.ones((c, c), bool))
    for i in range(1, block_size):
        visible[c + i - 1, :i] = True
        visible[c + i - 1, c + i - 1] = True
    return offsets, visible


def _blocks_forward(model: Drafter, config: DrafterConfig, x: Array, anchors: Array,
                    ctx_kv, ctx_visible: Array, offsets: Optional[np.ndarray] = None,
                    blk_visible: Optional[np.ndarray] = None) -> Array:
    """x [B, A, b, H] block inputs anchored at anchors [B, A]; ctx_kv per layer
    (k, v) [B, S, Nkv, D]; ctx_visible [B, A, S]. Returns final-normed u [B, A, b, H].
    offsets: the slots' static positions after the anchor (None: 0 .. b - 1);
    blk_visible: the static in-block mask of `_block_attend` (None: bidirectional)."""
    n, a, j, h = x.shape
    inv_freq = _inv_freq(config)
    offsets = (jnp.arange(j, dtype=jnp.int32) if offsets is None
               else jnp.asarray(offsets, jnp.int32))
    pos = (anchors[:, :, None] + offsets).reshape(n, a * j)
    xf = x.reshape(n, a * j, h)
    for layer, (k_ctx, v_ctx) in zip(model.layers, ctx_kv):
        hn = layer.input_norm(xf)
        q = layer.attn.queries(hn, pos, inv_freq)
        k, v = layer.attn.keys_values(hn, pos, inv_freq)
        out = _block_attend(q.reshape(n, a, j, *q.shape[2:]), k_ctx, v_ctx, ctx_visible,
                            k.reshape(n, a, j, *k.shape[2:]), v.reshape(n, a, j, *v.shape[2:]),
                            blk_visible)
        xf = layer.finish(xf, out.reshape(n, a * j, -1))
    return model.final_norm(xf).reshape(n, a, j, h)


def _heads(model: Drafter, config: DrafterConfig, u: Array) -> tuple[Array, Array]:
    """u [B, A, b, H] -> (branch hidden [B, A, K, b-1, H], prior logits [B, A, K] f32)."""
    tail = u[:, :, 1:]
    if config.expander_width > 0:
        branch = tail[:, :, None] + model.expander(tail).astype(tail.dtype)
    else:
        branch = tail[:, :, None]
    if config.num_categories > 1:
        prior = model.prior(u[:, :, 0])
    else:
        prior = jnp.zeros(u.shape[:2] + (1,), jnp.float32)
    return branch, prior


def draft_hidden(dparams: Params, tparams: Params, anchor_tokens: Array,
                 anchor_positions: Array, cache: KVCache, *, drafter_config: DrafterConfig,
                 target_config: TargetConfig) -> tuple[Array, Array]:
    """One draft pass per row (inference).

    anchor_tokens: [B] int, the last verified token of each row; anchor_positions: [B]
    int, its absolute position s. The block [anchor, MASK x (b - 1)] sits at positions
    s .. s + b - 1 and attends to cache entries with index < s plus the whole block.
    Returns (branch_hidden [B, K, b-1, H] final-normed incl. expander offsets, in the
    drafter dtype; prior_logits [B, K] float32, zeros when K = 1). Project a branch with
    `branch_logits`; for greedy-branch decoding pick it first with `select_branch`.
    A correction head is not applied here: the states are the parallel pass's, and
    dblast_jax/correction.py adds the correction serially from the drafted tokens.
    A causal block runs here with the causal mask over MASK positions: only position 1
    is a drafting pass's state; the sampler drafts with `causal_pass` (block_causal.py).
    """
    del target_config  # the target's embedding comes in via tparams
    anchor_tokens = jnp.asarray(anchor_tokens)
    chex.assert_rank(anchor_tokens, 1, custom_message="draft_hidden: anchor_tokens must be "
                     "[batch] (one anchor per row)")
    chex.assert_type(anchor_tokens, int, custom_message="draft_hidden: anchor_tokens must be "
                     "integer ids")
    anchor_positions = jnp.asarray(anchor_positions)
    chex.assert_shape(anchor_positions, anchor_tokens.shape,
                      custom_message="draft_hidden: anchor_positions must be [batch] like "
                                     "anchor_tokens")
    chex.assert_type(anchor_positions, int,
                     custom_message="draft_hidden: anchor_positions must be integers")
    _check_draft_cache("draft_hidden", cache, anchor_tokens.shape[0], drafter_config)
    anchor_positions = anchor_positions.astype(jnp.int32)
    model = _module(dparams, drafter_config)
    x = _block_embeddings(model, drafter_config, tparams, anchor_tokens[:, None],
                          _dtype_of(dparams))
    visible = (jnp.arange(cache.size, dtype=jnp.int32)[None, None, :]
               < anchor_positions[:, None, None])  # [B, 1, S]
    causal = drafter_config.block_attention == "causal"
    u = _blocks_forward(model, drafter_config, x, anchor_positions[:, None],
                        list(zip(cache.k, cache.v)), visible,
                        blk_visible=causal_block_mask(drafter_config.block_size)
                        if causal else None)
    branch, prior = _heads(model, drafter_config, u)
    return branch[:, 0], prior[:, 0]


def causal_pass(dparams: Params, tparams: Params, block_tokens: Array,
                anchor_positions: Array, cache: KVCache, slot, *,
                drafter_config: DrafterConfig) -> tuple[Array, Array]:
    """One left-to-right drafting pass of a causal block, the whole block recomputed: the
    definition (the sampler's `causal_step` computes the same incrementally).

    block_tokens [B, M, b] int: M blocks per row, all anchored at anchor_positions [B]
    (slot 0 the anchor, slots 1 .. slot-1 the tokens drafted so far, -1 = MASK at `slot`
    and after); slot: the position read, 1 .. b-1 (may be traced). The whole block runs
    with the causal mask, so what sits after `slot` does not matter. Returns (branch
    states of `slot` [B, M, K, H], prior logits [B, M, K] float32 of the anchor slot)."""
    model = _module(dparams, drafter_config)
    n, m, j = block_tokens.shape
    x = _token_block_embeddings(model, drafter_config, tparams, block_tokens,
                                _dtype_of(dparams))
    anchors = jnp.broadcast_to(anchor_positions.astype(jnp.int32)[:, None], (n, m))
    visible = jnp.broadcast_to(jnp.arange(cache.size, dtype=jnp.int32)[None, None, :]
                               < anchors[:, :, None], (n, m, cache.size))
    u = _blocks_forward(model, drafter_config, x, anchors, list(zip(cache.k, cache.v)),
                        visible, blk_visible=causal_block_mask(j))
    u_slot = jax.lax.dynamic_index_in_dim(u, slot, axis=2, keepdims=True)
    branch, prior = _heads(model, drafter_config, jnp.concatenate([u[:, :, :1], u_slot], 2))
    return branch[:, :, :, 0], prior


def init_block_cache(drafter_config: DrafterConfig, batch: int, num_blocks: int,
                     dtype=jnp.float32) -> tuple[tuple[Array, ...], tuple[Array, ...]]:
    """Empty per-layer keys / values [B, M, b, Nkv, D] of a causal block's drafted slots
    (`causal_step`)."""
    c = drafter_config
    shape = (batch, num_blocks, c.block_size, c.num_kv_heads, c.head_dim)
    return (tuple(jnp.zeros(shape, dtype) for _ in range(c.num_layers)),
            tuple(jnp.zeros(shape, dtype) for _ in range(c.num_layers)))


def causal_step(dparams: Params, tparams: Params, prev_tokens: Array, block_kv,
                anchor_positions: Array, cache: KVCache, slot, *,
                drafter_config: DrafterConfig):
    """`causal_pass` for position `slot` (1 .. b-1, may be traced), incrementally: only
    two slots are computed, slot - 1 holding prev_tokens [B, M] (the anchor for slot 1,
    else the token drafted there) and `slot` holding MASK. Slot - 1's keys / values are
    written into block_kv (`init_block_cache`; slots 0 .. slot-2 written by the earlier
    steps), and both slots attend to the context, to block_kv's slots <= slot - 1 and
    (slot `slot`) to themselves: the same mask as the whole block's, without recomputing
    the slots before. Returns (branch states of `slot` [B, M, K, H], prior logits
    [B, M, K] of slot - 1's state (the anchor's at slot 1), the updated block_kv)."""
    model = _module(dparams, drafter_config)
    n, m = prev_tokens.shape
    j = drafter_config.block_size
    dtype = _dtype_of(dparams)
    tokens = jnp.stack([prev_tokens.astype(jnp.int32), jnp.full((n, m), -1, jnp.int32)], 2)
    x = _token_block_embeddings(model, drafter_config, tparams, tokens, dtype)  # [B, M, 2, H]
    h = x.shape[-1]
    anchors = jnp.broadcast_to(anchor_positions.astype(jnp.int32)[:, None], (n, m))
    slot = jnp.asarray(slot, jnp.int32)
    pos = (anchors[:, :, None] + slot - 1 + jnp.arange(2, dtype=jnp.int32)).reshape(n, 2 * m)
    ctx_visible = jnp.broadcast_to(jnp.arange(cache.size, dtype=jnp.int32)[None, None, :]
                                   < anchors[:, :, None], (n, m, cache.size))
    written = jnp.arange(j, dtype=jnp.int32) <= slot - 1  # [b]
    blk_visible = jnp.stack([jnp.append(written, False), jnp.append(written, True)])
    inv_freq = _inv_freq(drafter_config)
    xf = x.reshape(n, 2 * m, h)
    ks, vs = [], []
    for layer, k_ctx, v_ctx, kb, vb in zip(model.layers, cache.k, cache.v, *block_kv):
        hn = layer.input_norm(xf)
        q = layer.attn.queries(hn, pos, inv_freq)
        k, v = layer.attn.keys_values(hn, pos, inv_freq)
        q, k, v = (a.reshape(n, m, 2, *a.shape[2:]) for a in (q, k, v))
        kb = jax.lax.dynamic_update_index_in_dim(kb, k[:, :, 0].astype(kb.dtype), slot - 1, 2)
        vb = jax.lax.dynamic_update_index_in_dim(vb, v[:, :, 0].astype(vb.dtype), slot - 1, 2)
        ks.append(kb)
        vs.append(vb)
        out = _block_attend(q, k_ctx, v_ctx, ctx_visible,
                            jnp.concatenate([kb, k[:, :, 1:].astype(kb.dtype)], axis=2),
                            jnp.concatenate([vb, v[:, :, 1:].astype(vb.dtype)], axis=2),
                            blk_visible)
        xf = layer.finish(xf, out.reshape(n, 2 * m, -1))
    u = model.final_norm(xf).reshape(n, m, 2, h)
    branch, prior = _heads(model, drafter_config, u)
    return branch[:, :, :, 0], prior, (tuple(ks), tuple(vs))


def train_hidden(dparams: Params, tparams: Params, taps: Array, tokens: Array,
                 anchors: Array, *, drafter_config: DrafterConfig,
                 target_config: TargetConfig) -> tuple[Array, Array]:
    """Many blocks per sequence in one pass (training).

    taps: [B, T, n_taps, H] target features of tokens [B, T] int at positions 0..T-1;
    anchors: [B, A] int in [0, T) — block j of row b is [tokens[b, anchors[b, j]],
    MASK x (b - 1)] at positions anchors[b, j] + 0..b-1 and sees context features at
    positions < anchors[b, j] plus its own block only. Labels of block slot i (1..b-1)
    are tokens[b, anchor + i]: the caller gathers and masks them.
    Returns (branch_hidden [B, A, K, b-1, H], prior_logits [B, A, K] float32), equal to
    `draft_hidden` on the same anchor and context (without a correction head). Anchors may repeat (the outputs are
    then equal); masking anchors that are padding is the caller's job.

    A causal block is teacher-forced too (`teacher_forced_layout`): position i's state is
    the drafting pass's for the prefix tokens[b, anchor + 1 .. anchor + i - 1], in one
    pass over 2 (b - 1) slots per block.

    With a correction head the branch states are corrected teacher-forced: slot i's
    previous token is the data token tokens[b, anchor + i - 1] (the anchor for i = 1), so
    they equal what the sampler projects when it drafts that same prefix.

    Cost: attention scores are [B, A, Nq, b, T + b] float32 (the A*b x A*b block-to-
    block part of a dense mask is never built); for very many anchors over long T,
    call this on anchor chunks.
    """
    del target_config
    _check_taps(taps, drafter_config)
    chex.assert_rank(tokens, 2, custom_message="train_hidden: tokens must be [batch, time]")
    chex.assert_type(tokens, int, custom_message="train_hidden: tokens must be integer ids")
    b, t = tokens.shape
    if taps.shape[:2] != (b, t):
        raise ValueError(f"taps {tuple(taps.shape)} and tokens {tuple(tokens.shape)} "
                         "disagree on [B, T]")
    anchors = jnp.asarray(anchors)
    chex.assert_rank(anchors, 2, custom_message="train_hidden: anchors must be [batch, anchors]")
    chex.assert_axis_dimension(anchors, 0, b, custom_message=f"train_hidden: anchors must have "
                               f"batch {b} like tokens {tuple(tokens.shape)}")
    chex.assert_type(anchors, int, custom_message="train_hidden: anchors must be integers")
    anchors = anchors.astype(jnp.int32)
    model = _module(dparams, drafter_config)
    feats = _features(model, taps, _dtype_of(dparams))
    ctx_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    inv_freq = _inv_freq(drafter_config)
    ctx_kv = [layer.attn.keys_values(feats, ctx_pos, inv_freq) for layer in model.layers]
    visible = jnp.arange(t, dtype=jnp.int32)[None, None, :] < anchors[:, :, None]
    if drafter_config.block_attention == "causal":  # teacher forced, two streams
        c = drafter_config.block_size - 1
        idx = anchors[:, :, None] + jnp.arange(c, dtype=jnp.int32)  # anchor, x_1 .. x_{b-2}
        content = jnp.take_along_axis(tokens, jnp.clip(idx, 0, t - 1).reshape(b, -1),
                                      axis=1).reshape(idx.shape)
        x = _token_block_embeddings(model, drafter_config, tparams, jnp.concatenate(
            [content, jnp.full(idx.shape, -1, content.dtype)], axis=2), _dtype_of(dparams))
        offsets, blk_visible = teacher_forced_layout(drafter_config.block_size)
        u = _blocks_forward(model, drafter_config, x, anchors, ctx_kv, visible, offsets,
                            blk_visible)
        u = jnp.concatenate([u[:, :, :1], u[:, :, c:]], axis=2)  # anchor + query slots
    else:
        anchor_tokens = jnp.take_along_axis(tokens, jnp.clip(anchors, 0, t - 1), axis=1)
        x = _block_embeddings(model, drafter_config, tparams, anchor_tokens,
                              _dtype_of(dparams))
        u = _blocks_forward(model, drafter_config, x, anchors, ctx_kv, visible)
    branch, prior = _heads(model, drafter_config, u)
    if drafter_config.correction != "none":
        idx = anchors[:, :, None] + jnp.arange(drafter_config.block_size - 1, dtype=jnp.int32)
        prev = jnp.take_along_axis(tokens, jnp.clip(idx, 0, t - 1).reshape(b, -1), axis=1)
        prev_embed = target_lib.embed(tparams, prev).reshape(idx.shape + (-1,))
        branch = branch + model.correction(prev_embed[:, :, None], branch)
    return branch, prior


def correction_parts(dparams: Params, branch_hidden: Array, *,
                     drafter_config: DrafterConfig) -> tuple[Array, Array]:
    """The parallel half of the correction, for the sampler's serial steps
    (dblast_jax/correction.py): (ctx [.., r] float32 = branch_hidden W_c for every
    position at once, out_kernel W_o [r, H]). See `Correction`."""
    corr = _module(dparams, drafter_config).correction
    return corr.ctx_features(branch_hidden), corr.out_kernel[...]


def correction_prev_features(dparams: Params, tparams: Params, prev_tokens: Array, *,
                             drafter_config: DrafterConfig) -> Array:
    """Previous tokens [..] int -> e W_p [.., r] float32 (one serial step's input side)."""
    model = _module(dparams, drafter_config)
    return model.correction.prev_features(jnp.take(tparams["embed"]["embedding"],
                                                   prev_tokens, axis=0))


def select_branch(branch_hidden: Array, branch: Array) -> Array:
    """branch_hidden [B, K, J, H], branch [B] int -> that branch's hidden [B, J, H].

    Greedy-branch decoding samples z from the prior first and then projects only branch
    z, avoiding the K-fold LM head (the dominant draft cost, see docs/METHOD.md section 6)."""
    branch = jnp.asarray(branch)
    chex.assert_rank(branch_hidden, 4, custom_message="select_branch: branch_hidden must be "
                     "[batch, K, positions, hidden]")
    chex.assert_shape(branch, branch_hidden.shape[:1],
                      custom_message="select_branch: branch must be [batch]")
    chex.assert_type(branch, int, custom_message="select_branch: branch must be integers")
    idx = branch.astype(jnp.int32)[:, None, None, None]
    return jnp.take_along_axis(branch_hidden, idx, axis=1)[:, 0]


def branch_logits(tparams: Params, branch_hidden: Array, target_config: TargetConfig) -> Array:
    """Branch hidden states [.., H] -> float32 logits [.., V] via the target's LM head."""
    return target_lib.lm_head(tparams, branch_hidden, target_config)


# ---- sharding ---------------------------------------------------------------------------

def drafter_partition_specs(dparams_or_abstract: Params, mesh) -> Params:
    """PartitionSpec pytree for mesh axes ("data", "fsdp", "tensor") from
    `sharding.DRAFTER_RULES`; non-dividing dimensions are replicated and a parameter no
    rule covers raises (so a new parameter cannot silently go unhandled)."""
    return sharding.partition_specs(dparams_or_abstract, mesh, sharding.DRAFTER_RULES)


def shard_drafter_params(dparams: Params, mesh) -> Params:
    """Place drafter parameters on `mesh` according to `drafter_partition_specs`."""
    return sharding.shard_params(dparams, mesh, sharding.DRAFTER_RULES)
