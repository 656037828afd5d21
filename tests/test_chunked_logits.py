"""Chunked vocabulary log-probs == the naive full-logit computation (values, argmax,
entropy, gradients wrt hidden and head), and the chunked backward holds far less memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dblast_jax.chunked_logits import TokenLogprobs, token_logprobs, token_logprobs_naive


def _case(n=37, h=16, v=1000, seed=0, dtype=jnp.float32, lead=None):
    rng = np.random.default_rng(seed)
    shape = (n,) if lead is None else lead
    hidden = jnp.asarray(rng.normal(size=shape + (h,)), dtype)
    w = jnp.asarray(rng.normal(size=(v, h)) * 0.5, dtype)
    targets = jnp.asarray(rng.integers(0, v, size=shape), jnp.int32)
    return hidden, w, targets


def _weight(w, layout):
    return w if layout == "vh" else w.T


def _loss(fn, layout, temperature, chunk, rows=None):
    """Scalar mixing logprob and entropy with fixed weights, so both gradients are tested."""
    def f(hidden, w, targets):
        out = fn(hidden, w, layout, targets, temperature, chunk, with_entropy=True,
                 row_chunk_size=rows)
        c = jnp.cos(jnp.arange(out.logprob.size, dtype=out.logprob.dtype)).reshape(
            out.logprob.shape)
        return jnp.sum(c * out.logprob) + 0.3 * jnp.sum(out.entropy)
    return f


@pytest.mark.parametrize("layout", ["vh", "hv"])
@pytest.mark.parametrize("chunk,temperature,rows", [(128, 1.0, None), (96, 0.7, 16),
                                                    (5000, 1.5, None)])
def test_values_and_gradients_match_naive(layout, chunk, temperature, rows):
    hidden, w, targets = _case()
    w = _weight(w, layout)
    got = jax.jit(lambda h_, w_, t_: token_logprobs(h_, w_, layout, t_, temperature, chunk,
                                                    with_entropy=True, row_chunk_size=rows)
                  )(hidden, w, targets)
    want = token_logprobs_naive(hidden, w, layout, targets, temperature, with_entropy=True)
    assert isinstance(got, TokenLogprobs)
    np.testing.assert_allclose(got.logprob, want.logprob, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.entropy, want.entropy, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got.argmax, want.argmax)
    # naive itself is right: against numpy
    z = np.asarray(hidden, np.float64) @ np.asarray(_weight(w, layout), np.float64).T / temperature
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    np.testing.assert_allclose(want.logprob, z[np.arange(len(z)), targets] - lse, rtol=1e-4,
                               atol=1e-4)
    np.testing.assert_array_equal(want.argmax, z.argmax(-1))

    g_got = jax.jit(jax.grad(_loss(token_logprobs, layout, temperature, chunk, rows),
                             argnums=(0, 1)))(hidden, w, targets)
    g_want = jax.jit(jax.grad(_loss(token_logprobs_naive, layout, temperature, chunk),
                              argnums=(0, 1)))(hidden, w, targets)
    for a, b in zip(g_got, g_want):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_tiny_chunks_leading_dims_and_x64():
    # V = 37 in chunks of 5 (last chunk overlaps), [2, 3, 4] leading shape, float64 exactness.
    with jax.enable_x64(True):
        hidden, w, targets = _case(h=8, v=37, lead=(2, 3, 4), dtype=jnp.float64)
        got = jax.jit(lambda *a: token_logprobs(*a, 1.2, 5, with_entropy=True),
                      static_argnums=2)(hidden, w, "vh", targets)
        want = jax.jit(lambda *a: token_logprobs_naive(*a, 1.2, with_entropy=True),
                       static_argnums=2)(hidden, w, "vh", targets)
        assert got.logprob.shape == (2, 3, 4) and got.logprob.dtype == jnp.float64
        np.testing.assert_allclose(got.logprob, want.logprob, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got.entropy, want.entropy, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(got.argmax, want.argmax)
        g1 = jax.jit(jax.grad(_loss(token_logprobs, "vh", 1.2, 5), argnums=(0, 1)))(
            hidden, w, targets)
        g2 = jax.jit(jax.grad(_loss(token_logprobs_naive, "vh", 1.2, 5), argnums=(0, 1)))(
            hidden, w, targets)
        for a, b in zip(g1, g2):
            np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)


def test_bf16_inputs_compute_in_float32():
    hidden, w, targets = _case(dtype=jnp.bfloat16)
    got = jax.jit(lambda *a: token_logprobs(*a, "vh", targets, 1.0, 128))(hidden, w)
    want = token_logprobs_naive(hidden, w, "vh", targets, 1.0)
    assert got.logprob.dtype == jnp.float32 and got.entropy is None
    np.testing.assert_allclose(got.logprob, want.logprob, rtol=1e-5, atol=1e-5)


def test_chunked_backward_holds_much_less_memory():
    n, h, v, chunk = 256, 32, 40000, 2048
    hidden = jnp.ones((n, h))
    w = jnp.ones((v, h))
    t = jnp.zeros((n,), jnp.int32)

    def temp_bytes(fn):
        g = jax.jit(jax.grad(lambda x: fn(x, w, "vh", t, 1.0, chunk).logprob.sum()))
        analysis = g.lower(hidden).compile().memory_analysis()
        if analysis is None:
            pytest.skip("no compiled memory analysis on this backend")
        return analysis.temp_size_in_bytes

    chunked, naive = temp_bytes(token_logprobs), temp_bytes(token_logprobs_naive)
    full = n * v * 4  # one [N, V] float32 array
    assert naive >= full
    assert chunked < full / 4, (chunked, naive, full)


def test_errors_name_the_problem():
    hidden, w, targets = _case(v=50)
    with pytest.raises(ValueError, match="head_layout"):
        token_logprobs(hidden, w, "xx", targets)
    with pytest.raises(ValueError, match=r"head_weight shape \(50, 16\) \(layout 'hv'\)"):
        token_logprobs(hidden, w, "hv", targets)
    with pytest.raises(ValueError, match="targets shape"):
        token_logprobs(hidden, w, "vh", targets[:-1])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(hidden, w, "vh", targets, 0.0)
