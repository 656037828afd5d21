"""The sampling distribution (temperature -> top-k -> top-p) and the plain sampler."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import limit_traces

from dblast_jax import sampler as sampler_lib
from dblast_jax.config import SamplingConfig, TargetConfig
from dblast_jax.models import target as T
from dblast_jax.sampler import PAD_ID, generate_tokens, pad_prompts
from dblast_jax.sampling import filter_logits, sample_tokens, sampling_logprobs


def _numpy_filter(logits, temperature, top_k, top_p):
    """Straightforward reference: one row at a time, sorted lists."""
    out = []
    for row in np.asarray(logits, np.float64) / temperature:
        row = row.copy()
        if 0 < top_k < row.size:
            kth = np.sort(row)[::-1][top_k - 1]
            row[row < kth] = -np.inf
        if top_p < 1.0:
            order = np.argsort(-row, kind="stable")
            probs = np.exp(row[order] - row[order][0])
            probs /= probs.sum()
            keep = np.zeros(row.size, bool)
            mass = 0.0
            for rank, idx in enumerate(order):
                if rank == 0 or mass < top_p:
                    keep[idx] = True
                mass += probs[rank]
            row[~keep] = -np.inf
        out.append(row)
    return np.stack(out)


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 5, 1.0), (1.5, 0, 0.8), (1.0, 7, 0.5), (0.3, 1, 1.0), (2.0, 0, 0.05)])
def test_filter_matches_reference(temperature, top_k, top_p):
    logits = jax.random.normal(jax.random.key(0), (6, 33)) * 3
    ours = np.asarray(filter_logits(logits, temperature, top_k, top_p))
    ref = _numpy_filter(logits, temperature, top_k, top_p)
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(ours[finite], ref[finite], rtol=1e-6)
    lp = sampling_logprobs(logits, temperature, top_k, top_p)
    np.testing.assert_allclose(np.exp(np.asarray(lp)).sum(-1), 1.0, rtol=1e-5)


@pytest.mark.torch
def test_filter_matches_transformers_warpers():
    torch = pytest.importorskip("torch")
    gen = pytest.importorskip("transformers.generation.logits_process")
    logits = np.asarray(jax.random.normal(jax.random.key(1), (4, 50)) * 2, np.float32)
    for temperature, top_k, top_p in [(0.7, 10, 0.9), (1.5, 0, 0.6), (1.0, 3, 1.0)]:
        scores = torch.tensor(logits)
        scores = gen.TemperatureLogitsWarper(temperature)(None, scores)
        if top_k:
            scores = gen.TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1.0:
            scores = gen.TopPLogitsWarper(top_p)(None, scores)
        ref = scores.numpy()
        ours = np.asarray(filter_logits(jnp.asarray(logits), temperature, top_k, top_p))
        np.testing.assert_array_equal(np.isinf(ours), np.isinf(ref))
        np.testing.assert_allclose(ours[np.isfinite(ours)], ref[np.isfinite(ref)], rtol=1e-6)


def test_temperature_zero_is_argmax_and_filter_rejects_it():
    logits = jax.random.normal(jax.random.key(2), (3, 11))
    np.testing.assert_array_equal(sample_tokens(jax.random.key(0), logits, 0.0),
                                  np.argmax(np.asarray(logits), -1))
    with pytest.raises(ValueError, match="temperature > 0"):
        filter_logits(logits, 0.0)


def test_samples_follow_the_filtered_distribution():
    """Chi-square goodness of fit of 40k draws (false-alarm rate ~1e-4 per test)."""
    from scipy import stats
    logits = jnp.asarray([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    probs = np.exp(np.asarray(sampling_logprobs(logits, 1.3, 4, 0.9)))[0]
    keys = jax.random.split(jax.random.key(3), 40000)
    draws = np.asarray(jax.vmap(lambda k: sample_tokens(k, logits, 1.3, 4, 0.9))(keys))[:, 0]
    counts = np.bincount(draws, minlength=6)
    assert counts[probs == 0].sum() == 0
    support = probs > 0
    chi2 = ((counts[support] - 40000 * probs[support]) ** 2 / (40000 * probs[support])).sum()
    assert stats.chi2.sf(chi2, support.sum() - 1) > 1e-4


def _python_greedy(params, config, prompt, n):
    """Greedy decoding by full recomputation, one token at a time. The sequence is padded
    to one width so the forward compiles once: a causal model's logits at a position do
    not depend on the tokens after it."""
    forward = jax.jit(lambda p, t: T.forward(p, t, config=config)[0])
    width = len(prompt) + n
    seq = list(prompt)
    for _ in range(n):
        padded = np.zeros((1, width), np.int32)
        padded[0, :len(seq)] = seq
        logits = forward(params, jnp.asarray(padded))
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    return seq[len(prompt):]


@pytest.mark.parametrize("preset", ["tiny_llama", "tiny_qwen3"])
def test_greedy_while_loop_equals_python_loop_on_ragged_batch(preset):
    config = getattr(TargetConfig, preset)()
    params = T.init_params(config, 3)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    tokens, lengths = pad_prompts(prompts)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=9)
    out, counts = generate_tokens(params, tokens, lengths, jax.random.key(0), config=config,
                                  sampling=sampling, cache_size=64)
    np.testing.assert_array_equal(counts, [9, 9, 9])
    for row, prompt in zip(np.asarray(out), prompts):
        assert list(row) == _python_greedy(params, config, prompt, 9)


def test_stop_tokens_end_rows_and_pad_after():
    config = TargetConfig.tiny_llama()
    params = T.init_params(config, 3)
    tokens, lengths = pad_prompts([[5, 6, 7], [12, 13]])
    free = generate_tokens(params, tokens, lengths, jax.random.key(0), config=config,
                           sampling=SamplingConfig(temperature=0.0, max_new_tokens=8),
                           cache_size=64)[0]
    stop = int(np.asarray(free)[0, 2])  # the third greedy token of row 0
    out, counts = generate_tokens(params, tokens, lengths, jax.random.key(0), config=config,
                                  sampling=SamplingConfig(temperature=0.0, max_new_tokens=8,
                                                          stop_tokens=(stop,)),
                                  cache_size=64)
    out = np.asarray(out)
    first = list(np.asarray(free)[0]).index(stop)
    assert counts[0] == first + 1 and out[0, first] == stop
    assert (out[0, first + 1:] == PAD_ID).all()


def test_sampled_first_token_distribution_matches_target():
    """The while_loop sampler draws from softmax(logits / T) after top-k/top-p."""
    from scipy import stats
    config = TargetConfig.tiny_llama(vocab_size=13)
    params = T.init_params(config, 4)
    params["embed"]["embedding"] = params["embed"]["embedding"] * 40  # a peaked target
    prompt = jnp.asarray([[3, 4, 5]])
    logits, _ = T.forward(params, prompt, config=config)
    probs = np.exp(np.asarray(sampling_logprobs(logits[0, -1], 1.5, 0, 0.95)))
    n = 4000
    tokens = jnp.tile(prompt, (n, 1))
    sampling = SamplingConfig(temperature=1.5, top_p=0.95, max_new_tokens=1)
    out, _ = generate_tokens(params, tokens, jnp.full((n,), 3, jnp.int32), jax.random.key(7),
                             config=config, sampling=sampling, cache_size=16)
    counts = np.bincount(np.asarray(out)[:, 0], minlength=13)
    assert counts[probs == 0].sum() == 0
    support = probs > 0
    chi2 = ((counts[support] - n * probs[support]) ** 2 / (n * probs[support])).sum()
    assert stats.chi2.sf(chi2, max(support.sum() - 1, 1)) > 1e-4


def test_second_call_does_not_recompile(monkeypatch):
    """Other prompts of the same padded width, other lengths and seeds: one compile."""
    config = TargetConfig.tiny_llama()
    params = T.init_params(config, 0)
    tokens, lengths = pad_prompts([[1, 2, 3]])
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=4)
    traces = limit_traces(monkeypatch, sampler_lib, "_plain_body", n=1)
    generate_tokens(params, tokens, lengths, jax.random.key(0), config=config,
                    sampling=sampling, cache_size=32)
    before = generate_tokens._cache_size()
    generate_tokens(params, tokens + 1, lengths, jax.random.key(1), config=config,
                    sampling=sampling, cache_size=32)
    generate_tokens(params, tokens, lengths - 1, jax.random.key(2), config=config,
                    sampling=sampling, cache_size=32)
    assert generate_tokens._cache_size() == before
    assert len(traces) <= 1  # 0 if an earlier test compiled these shapes already
