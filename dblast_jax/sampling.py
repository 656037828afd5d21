"""The target's sampling distribution: temperature, then top-k, then top-p.

Plain decoding and speculative verification must use *the same* distribution p, or the
speculative sampler would not be lossless with respect to plain sampling; both call
`sampling_logprobs`. The filter order and tie handling follow Hugging Face's logits
warpers (top-k keeps every token tied with the k-th; top-p keeps the smallest set of
most-likely tokens whose mass reaches top_p, and always at least one token).
All math is float32 whatever the model dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def filter_logits(logits: Array, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Array:
    """logits [..., V] -> float32 scaled logits with filtered entries at -inf.

    `temperature` must be > 0 here (greedy decoding never needs a distribution).
    `top_k`, `top_p` are Python numbers (static): 0 / 1.0 disable the filters.
    """
    if temperature <= 0:
        raise ValueError("filter_logits needs temperature > 0; use argmax for greedy decoding")
    x = logits.astype(jnp.float32) / jnp.float32(temperature)
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = jax.lax.top_k(x, top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if top_p < 1.0:
        order = jnp.argsort(-x, axis=-1)
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
        probs = jax.nn.softmax(sorted_x, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly likelier tokens
        keep_sorted = mass_before < top_p
        keep_sorted = keep_sorted.at[..., 0].set(True)
        inverse = jnp.argsort(order, axis=-1)
        keep = jnp.take_along_axis(keep_sorted, inverse, axis=-1)
        x = jnp.where(keep, x, -jnp.inf)
    return x


def sampling_logprobs(logits: Array, temperature: float, top_k: int = 0,
                      top_p: float = 1.0) -> Array:
    """Normalised float32 log-probabilities of the sampling distribution, -inf if filtered."""
    return jax.nn.log_softmax(filter_logits(logits, temperature, top_k, top_p), axis=-1)


def sample_tokens(rng: Array, logits: Array, temperature: float, top_k: int = 0,
                  top_p: float = 1.0) -> Array:
    """Draw one token per row from logits [..., V]; greedy (argmax) at temperature 0."""
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    x = filter_logits(logits, temperature, top_k, top_p)
    return jax.random.categorical(rng, x, axis=-1).astype(jnp.int32)


def token_logprobs_and_entropies(logits: Array, tokens: Array,
                                 temperatures: tuple[float, ...]) -> tuple[Array, Array]:
    """Per temperature T, log softmax(logits / T) at `tokens` and the entropy of that
    softmax: the per-token statistics a regenerated corpus stores (untruncated: no top-k /
    top-p, whatever the generation used). logits [N, V], tokens [N] int ->
    (logp, entropy), each [len(temperatures), N] float32."""
    logits = logits.astype(jnp.float32)
    logps, entropies = [], []
    for t in temperatures:
        logp_all = jax.nn.log_softmax(logits / jnp.float32(t), axis=-1)
        logps.append(jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0])
        entropies.append(-jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1))
    return jnp.stack(logps), jnp.stack(entropies)
