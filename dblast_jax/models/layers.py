"""Building blocks shared by the target LM and the drafter (Flax NNX).

Numerics: matmuls run in the parameter dtype; RMSNorm statistics, RoPE angles and the
attention softmax run in float32 (as the Hugging Face reference does), so bfloat16
parameters lose as little as possible.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from dblast_jax.config import RopeScaling

Array = jax.Array


class RowLinear(nnx.Linear):
    """nnx.Linear applied to the rows of x flattened to 2-D, then reshaped back.

    Why: the same product with several leading (batch) axes compiles, on XLA's CPU
    backend, into transposing copies in the backward pass; a drafter training step's
    SwiGLU MLP over [batch, anchors, block, H] ran 1.6x slower that way
    (benchmarks/bench_train_step.py). Same parameters, same results."""

    def __call__(self, x: Array) -> Array:
        if x.ndim <= 2:
            return super().__call__(x)
        y = super().__call__(x.reshape(-1, x.shape[-1]))
        return y.reshape(*x.shape[:-1], y.shape[-1])


def _linear(din: int, dout: int, rngs: nnx.Rngs, dtype, std: float = 0.02) -> nnx.Linear:
    return RowLinear(din, dout, use_bias=False, dtype=dtype, param_dtype=dtype,
                     kernel_init=nnx.initializers.normal(std), rngs=rngs)


class RMSNorm(nnx.Module):
    """y = x / rms(x) * scale, statistics in float32, result in the input dtype."""

    def __init__(self, dim: int, eps: float, dtype=jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * normed.astype(x.dtype)


def rope_inverse_frequencies(head_dim: int, theta: float,
                             scaling: Optional[RopeScaling] = None) -> Array:
    """[head_dim // 2] float32 inverse frequencies, with optional Llama-3 scaling."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = ((scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def apply_rope(x: Array, positions: Array, inv_freq: Array) -> Array:
    """Rotate-half RoPE (HF convention). x: [B, T, N, D]; positions: [B, T] int."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def attend(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """Grouped-query attention.

    q: [B, T, Nq, D]; k, v: [B, S, Nkv, D]; mask: [B, T, S] bool (True = may attend).
    Returns [B, T, Nq * D]. Softmax in float32; rows with no visible key give zeros.
    """
    b, t, nq, d = q.shape
    nkv = k.shape[2]
    q = q.reshape(b, t, nkv, nq // nkv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k,
                        preferred_element_type=jnp.float32) * (d ** -0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(scores - row_max)
    weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-30)
    out = jnp.einsum("bkgts,bskd->btkgd", weights.astype(v.dtype), v)
    return out.reshape(b, t, nq * d)


class Attention(nnx.Module):
    """Multi-head attention with GQA and optional per-head q/k RMSNorm (Qwen3)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 use_qk_norm: bool, eps: float, rngs: nnx.Rngs, dtype=jnp.float32):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = _linear(hidden_size, num_heads * head_dim, rngs, dtype)
        self.k_proj = _linear(hidden_size, num_kv_heads * head_dim, rngs, dtype)
        self.v_proj = _linear(hidden_size, num_kv_heads * head_dim, rngs, dtype)
        self.o_proj = _linear(num_heads * head_dim, hidden_size, rngs, dtype)
        self.use_qk_norm = use_qk_norm
        if use_qk_norm:
            self.q_norm = RMSNorm(head_dim, eps, dtype)
            self.k_norm = RMSNorm(head_dim, eps, dtype)

    def queries(self, x: Array, positions: Array, inv_freq: Array) -> Array:
        """x: [B, T, H] -> roped queries [B, T, Nq, D]."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        if self.use_qk_norm:
            q = self.q_norm(q)
        return apply_rope(q, positions, inv_freq)

    def keys_values(self, x: Array, positions: Array, inv_freq: Array) -> tuple[Array, Array]:
        """x: [B, T, H] -> roped keys and values, each [B, T, Nkv, D]."""
        b, t, _ = x.shape
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:
            k = self.k_norm(k)
        return apply_rope(k, positions, inv_freq), v


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, rngs: nnx.Rngs,
                 dtype=jnp.float32):
        self.gate_proj = _linear(hidden_size, intermediate_size, rngs, dtype)
        self.up_proj = _linear(hidden_size, intermediate_size, rngs, dtype)
        self.down_proj = _linear(intermediate_size, hidden_size, rngs, dtype)

    def __call__(self, x: Array) -> Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm decoder layer; the attention step is supplied by the caller.

    Splitting the layer lets the target (causal attention over a KV cache) and the
    drafter (non-causal attention over [context ; block]) share parameters layout and
    code while attending differently.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, use_qk_norm: bool, eps: float,
                 rngs: nnx.Rngs, dtype=jnp.float32):
        self.input_norm = RMSNorm(hidden_size, eps, dtype)
        self.attn = Attention(hidden_size, num_heads, num_kv_heads, head_dim, use_qk_norm,
                              eps, rngs, dtype)
        self.post_attn_norm = RMSNorm(hidden_size, eps, dtype)
        self.mlp = MLP(hidden_size, intermediate_size, rngs, dtype)

    def finish(self, x: Array, attn_out: Array) -> Array:
        """Residual after attention (attn_out: [B, T, Nq * D]), then the MLP block."""
        x = x + self.attn.o_proj(attn_out)
        return x + self.mlp(self.post_attn_norm(x))
