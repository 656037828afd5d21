"""The speculative sampler: exactly lossless in every mode, equal to a reference loop.

Losslessness is tested statistically: a tiny target (vocabulary 6, 4 new tokens, so all
6**4 sequences can be enumerated), a random drafter unlike it, many samples in one
vectorised call, and a chi-square test against the exact target distribution. Each test
has a false-alarm rate of 1e-4 (P_VALUE); with the ~20 cases here the chance that a
correct sampler fails any of them is below 0.3%. The same test run on a deliberately
broken verifier must fail, which shows it has power.
"""

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import chi_square_pvalue  # tests/ is on sys.path (pytest "prepend" mode)
from conftest import limit_traces

from dblast_jax import sampler as sampler_lib
from dblast_jax import verify
from dblast_jax.config import DrafterConfig, SamplingConfig, TargetConfig
from dblast_jax.models import drafter as D
from dblast_jax.models import target as T
from dblast_jax.sampler import (PAD_ID, generate_tokens, pad_prompts, python_driven_speculative,
                                spec_cache_size, speculative_generate_tokens, step_keys)
from dblast_jax.sampling import sampling_logprobs

P_VALUE = 1e-4
VOCAB, NEW, BLOCK, SAMPLES = 6, 4, 3, 30000
PROMPT = [1, 4]


@pytest.fixture(scope="module")
def tiny():
    tc = TargetConfig.tiny_llama(vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
                                 num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)
    tp = T.init_params(tc, 11)
    # a peaked, context-dependent target: large embeddings make confident logits
    tp["embed"]["embedding"] = tp["embed"]["embedding"] * 4.0
    dc = DrafterConfig.for_target(tc, num_layers=1, block_size=BLOCK, num_categories=4,
                                  target_layer_ids=(0,))
    dp = D.init_drafter_params(dc, tc, jax.random.key(5))
    dp = jax.tree.map(lambda x: x * 3.0, dp)  # confident, and unlike the target
    return tc, tp, dc, dp


def exact_distribution(tc, tp, sampling):
    """Exact probability of each of the VOCAB**NEW continuations of PROMPT."""
    seqs = np.array(list(itertools.product(range(VOCAB), repeat=NEW)), np.int32)
    full = np.concatenate([np.tile(PROMPT, (len(seqs), 1)), seqs], axis=1)
    logits, _ = T.forward(tp, jnp.asarray(full), config=tc)
    logp = sampling_logprobs(logits[:, len(PROMPT) - 1:-1], sampling.temperature,
                             sampling.top_k, sampling.top_p)  # [N, NEW, V]
    picked = np.take_along_axis(np.asarray(logp), seqs[..., None], axis=-1)[..., 0]
    probs = np.exp(picked.sum(-1))
    return seqs, probs / probs.sum()


def sample_sequences(tc, tp, dc, dp, sampling, n=SAMPLES, seed=0):
    tokens = jnp.tile(jnp.asarray([PROMPT], jnp.int32), (n, 1))
    lengths = jnp.full((n,), len(PROMPT), jnp.int32)
    out, counts, accepted, expected = speculative_generate_tokens(
        tp, dp, tokens, lengths, jax.random.key(seed), target_config=tc, drafter_config=dc,
        sampling=sampling, cache_size=spec_cache_size(len(PROMPT), sampling, dc.block_size))
    out = np.asarray(out)
    assert (np.asarray(counts) == NEW).all() and (out != PAD_ID).all()
    return out, np.asarray(accepted), np.asarray(expected)


def sample_patched(monkeypatch, owner, name, replacement, *args, **kwargs):
    """sample_sequences(*args, **kwargs) with owner.name replaced by `replacement`
    (compiled afresh, and the compile caches cleared again after): the power checks."""
    monkeypatch.setattr(owner, name, replacement)
    jax.clear_caches()
    try:
        return sample_sequences(*args, **kwargs)
    finally:
        monkeypatch.undo()
        jax.clear_caches()


def assert_greedy_equals_plain(tc, tp, dc, dp):
    """At T = 0 speculative decoding with (dc, dp) emits plain greedy decoding's tokens."""
    tokens, lengths = pad_prompts([[1, 4], [2, 5, 3], [0]])
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=NEW)
    plain, _ = generate_tokens(tp, tokens, lengths, jax.random.key(0), config=tc,
                               sampling=greedy, cache_size=16)
    spec = speculative_generate_tokens(
        tp, dp, tokens, lengths, jax.random.key(0), target_config=tc, drafter_config=dc,
        sampling=greedy, cache_size=spec_cache_size(tokens.shape[1], greedy, dc.block_size))
    np.testing.assert_array_equal(np.asarray(spec[0]), np.asarray(plain))


MODES = ("greedy-branch", "sampled-branch", "mixture", "sampled-mixture")
CASES = [(mode, temp, 0, 1.0) for mode in MODES for temp in (0.7, 1.0, 1.5)]
CASES += [(mode, 1.0, 3, 0.9) for mode in MODES]
CASES += [("greedy-branch", 1.5, 0, 0.7), ("sampled-branch", 0.7, 4, 1.0)]


@pytest.mark.parametrize("mode,temperature,top_k,top_p", CASES)
def test_lossless_against_exact_target_distribution(tiny, mode, temperature, top_k, top_p):
    tc, tp, dc, dp = tiny
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p,
                              max_new_tokens=NEW, verify_mode=mode, category_temperature=1.3,
                              draft_temperature=0.8)
    seqs, probs = exact_distribution(tc, tp, sampling)
    samples, accepted, expected = sample_sequences(tc, tp, dc, dp, sampling)
    assert chi_square_pvalue(samples, seqs, probs) > P_VALUE
    # the drafts are not trivially rejected: the test exercises acceptance paths
    assert (accepted > 0).mean() > 0.02


_CORRECT_VERIFY_BLOCK = verify.verify_block


def _broken_verify_block(rng_accept, rng_residual, target_probs, drafts, proposal):
    """A classic bug: at a rejection, sample from p instead of the residual max(0, p - Q)."""
    verdict = _CORRECT_VERIFY_BLOCK(rng_accept, rng_residual, target_probs, drafts, proposal)
    dist = jnp.take_along_axis(target_probs, verdict.num_accepted[:, None, None], axis=1)[:, 0]
    token = jax.random.categorical(rng_residual, jnp.log(jnp.maximum(dist, 1e-38)), axis=-1)
    return verdict._replace(next_token=token.astype(jnp.int32))


def test_the_test_has_power_on_a_broken_verifier(tiny, monkeypatch):
    tc, tp, dc, dp = tiny
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=NEW, verify_mode="greedy-branch")
    seqs, probs = exact_distribution(tc, tp, sampling)
    samples, _, _ = sample_patched(monkeypatch, verify, "verify_block", _broken_verify_block,
                                   tc, tp, dc, dp, sampling, seed=1)
    assert chi_square_pvalue(samples, seqs, probs) < P_VALUE


def test_expected_accepted_matches_empirical_mean(tiny):
    tc, tp, dc, dp = tiny
    for mode in ("greedy-branch", "sampled-branch"):
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=NEW, verify_mode=mode)
        _, accepted, expected = sample_sequences(tc, tp, dc, dp, sampling, n=20000, seed=3)
        valid = accepted >= 0
        diff = accepted[valid] - expected[valid]
        assert abs(diff.mean()) < 4 * diff.std() / np.sqrt(diff.size) + 1e-6
        # the exact expectation has lower variance than the count it predicts
        assert expected[valid].var() < accepted[valid].var()


def test_mixture_accepts_at_least_as_much_as_greedy_branch_on_the_same_drafts():
    rng = np.random.default_rng(0)
    bsz, k, n, vocab = 64, 4, 5, 7
    branch_tokens = jnp.asarray(rng.integers(0, 3, (bsz, k, n)), jnp.int32)  # overlapping
    draw = jax.nn.softmax(jnp.asarray(rng.normal(size=(bsz, k)), jnp.float32))
    z = jnp.asarray(rng.integers(0, k, bsz))
    drafts = branch_tokens[jnp.arange(bsz), z]
    probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(bsz, n + 1, vocab)) * 2, jnp.float32))
    keys = jax.random.split(jax.random.key(0), 2)
    greedy = verify.verify_block(keys[0], keys[1], probs, drafts,
                                 verify.one_hot_proposal(drafts, vocab))
    mix_q = verify.mixture_proposal(branch_tokens, None, drafts, draw, vocab)
    np.testing.assert_allclose(mix_q.sum(-1), 1.0, rtol=1e-5)
    mixture = verify.verify_block(keys[0], keys[1], probs, drafts, mix_q)
    assert (np.asarray(mixture.alphas) >= np.asarray(greedy.alphas) - 1e-7).all()
    assert (np.asarray(mixture.expected_accepted) >= np.asarray(greedy.expected_accepted)
            - 1e-6).all()
    assert (np.asarray(mixture.num_accepted) >= np.asarray(greedy.num_accepted)).all()
    assert np.asarray(mixture.expected_accepted).mean() > np.asarray(
        greedy.expected_accepted).mean()


@pytest.mark.parametrize("num_categories", [1, 4])
def test_temperature_zero_equals_plain_greedy_whatever_the_drafter(num_categories):
    tc = TargetConfig.tiny_qwen3()
    tp = T.init_params(tc, 2)
    dc = DrafterConfig.for_target(tc, num_layers=2, block_size=4, num_categories=num_categories)
    dp = D.init_drafter_params(dc, tc, jax.random.key(1))
    tokens, lengths = pad_prompts([[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]])
    for mode in MODES:
        sampling = SamplingConfig(temperature=0.0, max_new_tokens=11, verify_mode=mode)
        cache = spec_cache_size(tokens.shape[1], sampling, dc.block_size)
        spec = speculative_generate_tokens(tp, dp, tokens, lengths, jax.random.key(0),
                                           target_config=tc, drafter_config=dc,
                                           sampling=sampling, cache_size=cache)
        plain = generate_tokens(tp, tokens, lengths, jax.random.key(0), config=tc,
                                sampling=sampling, cache_size=cache)
        np.testing.assert_array_equal(spec[0], plain[0])
        np.testing.assert_array_equal(spec[1], plain[1])


# ---- an independent reference: no caches, explicit per-row / per-position loops -------------

def reference_speculative(tp, dp, prompts, rng, tc, dc, sampling):
    """Straightforward re-implementation with the same random draws as the sampler.

    Each step recomputes the target over the whole sequence (no KV cache), runs the drafter
    through its *training* pass on the full context (no draft cache), and verifies in numpy
    with a Python loop over positions. Random numbers come from the same keys and shapes as
    the on-device loop (`jax.random.categorical` is argmax(logits + gumbel)). Sequences are
    padded to one width so each pass compiles once (causal: the padding after a position
    does not change it).
    """
    bsz, b = len(prompts), dc.block_size
    width = max(len(p) for p in prompts)
    full = width + sampling.max_new_tokens + 2 * b  # a sequence plus one drafted block, at most
    taps_of = jax.jit(lambda t: T.forward(tp, t, config=tc, tap_layers=dc.target_layer_ids)[1])
    logits_of = jax.jit(lambda t: T.forward(tp, t, config=tc)[0])
    drafter_of = jax.jit(lambda taps, t, anchor: D.train_hidden(
        dp, tp, taps, t, anchor, drafter_config=dc, target_config=tc))

    def pad(seq):
        out = np.zeros((1, full), np.int32)
        out[0, :len(seq)] = seq
        return jnp.asarray(out)
    padded = np.zeros((bsz, width), np.int32)
    for i, p in enumerate(prompts):
        padded[i, :len(p)] = p
    logits0, _, _ = T.prefill(tp, jnp.asarray(padded), jnp.asarray([len(p) for p in prompts]),
                              config=tc, cache_size=width, last_logits_only=True)
    first = np.asarray(jax.random.categorical(
        jax.random.fold_in(rng, 0x7FFFFFFF),
        sampling_logprobs(logits0[:, 0], sampling.temperature, sampling.top_k, sampling.top_p)))
    seqs = [list(p) + [int(first[i])] for i, p in enumerate(prompts)]
    outs = [[int(first[i])] for i in range(bsz)]
    done = [False] * bsz
    accepted_log = [[] for _ in range(bsz)]
    step = 0
    while step < sampling.max_new_tokens - 1 and not all(done):
        k_cat, k_draft, k_acc, k_res = step_keys(rng, jnp.int32(step))
        priors, branch_logits = [], []
        for seq in seqs:
            ctx = pad(seq)
            hidden, prior = drafter_of(taps_of(ctx), ctx, jnp.asarray([[len(seq) - 1]]))
            priors.append(np.asarray(prior[0, 0]))
            branch_logits.append(np.asarray(D.branch_logits(tp, hidden[0, 0], tc)))  # [K,b-1,V]
        draw_logp = np.asarray(jax.nn.log_softmax(
            jnp.asarray(np.stack(priors)) / sampling.category_temperature, axis=-1))
        z = np.argmax(draw_logp + np.asarray(jax.random.gumbel(k_cat, draw_logp.shape)), -1)
        chosen = np.stack([branch_logits[i][z[i]] for i in range(bsz)])  # [B, b-1, V]
        log_q = np.asarray(jax.nn.log_softmax(jnp.asarray(chosen) / sampling.draft_temperature,
                                              axis=-1))
        drafts = np.argmax(log_q + np.asarray(jax.random.gumbel(k_draft, log_q.shape)), -1)
        uniforms = np.asarray(jax.random.uniform(k_acc, (bsz, b - 1)))
        gumbel_res = np.asarray(jax.random.gumbel(k_res, (bsz, tc.vocab_size)))
        for i in range(bsz):
            if done[i]:
                continue
            block = seqs[i] + list(drafts[i])
            logits = logits_of(pad(block))
            p = np.exp(np.asarray(sampling_logprobs(logits[0, len(seqs[i]) - 1:len(block)],
                                                    sampling.temperature, sampling.top_k,
                                                    sampling.top_p), np.float64))
            q = np.exp(log_q[i].astype(np.float64))
            n_acc, emitted = 0, None
            for j in range(b - 1):
                d = drafts[i, j]
                if uniforms[i, j] < min(1.0, p[j, d] / q[j, d]):
                    n_acc += 1
                    continue
                resid = np.maximum(p[j] - q[j], 0.0)
                with np.errstate(divide="ignore"):
                    emitted = int(np.argmax(np.log(resid / resid.sum()) + gumbel_res[i]))
                break
            if emitted is None:
                emitted = int(np.argmax(np.log(p[b - 1]) + gumbel_res[i]))
            accepted_log[i].append(n_acc)
            new = list(drafts[i, :n_acc]) + [emitted]
            for t in new:
                if len(outs[i]) < sampling.max_new_tokens:
                    outs[i].append(int(t))
            if len(outs[i]) >= sampling.max_new_tokens:
                done[i] = True
            seqs[i] = seqs[i] + new
        step += 1
    return outs, accepted_log


def test_while_loop_equals_reference_implementation():
    tc = TargetConfig.tiny_llama(vocab_size=6)
    tp = T.init_params(tc, 8)
    tp["embed"]["embedding"] = tp["embed"]["embedding"] * 4.0
    dc = DrafterConfig.for_target(tc, num_layers=1, block_size=4, num_categories=2)
    dp = jax.tree.map(lambda x: x * 3.0, D.init_drafter_params(dc, tc, jax.random.key(2)))
    prompts = [[1, 2, 3, 4], [5, 0]]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8, verify_mode="sampled-branch",
                              draft_temperature=0.5)
    tokens, lengths = pad_prompts(prompts)
    rng = jax.random.key(4)
    out, counts, accepted, _ = speculative_generate_tokens(
        tp, dp, tokens, lengths, rng, target_config=tc, drafter_config=dc, sampling=sampling,
        cache_size=spec_cache_size(tokens.shape[1], sampling, dc.block_size))
    ref_out, ref_acc = reference_speculative(tp, dp, prompts, rng, tc, dc, sampling)
    for i in range(len(prompts)):
        assert list(np.asarray(out[i, :counts[i]])) == ref_out[i]
        got_acc = [a for a in np.asarray(accepted[i]) if a >= 0]
        assert got_acc == ref_acc[i]
    assert sum(len(a) for a in ref_acc) > 0 and max(max(a) for a in ref_acc) > 0


def test_python_driven_loop_and_no_recompilation(monkeypatch):
    """One compile per (shapes, configs): other prompts of the same padded width, other
    lengths and other seeds reuse the while_loop's executable (the sampling settings are
    static: another SamplingConfig is another compile, by design). The Python-driven loop
    compiles its step once for all its iterations."""
    tc = TargetConfig.tiny_llama()
    tp = T.init_params(tc, 0)
    dc = DrafterConfig.for_target(tc, num_layers=1, block_size=4, num_categories=2)
    dp = D.init_drafter_params(dc, tc, jax.random.key(0))
    tokens, lengths = pad_prompts([[1, 2, 3], [4, 5]])
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8)
    kwargs = dict(target_config=tc, drafter_config=dc, sampling=sampling,
                  cache_size=spec_cache_size(tokens.shape[1], sampling, dc.block_size))
    loop_traces = limit_traces(monkeypatch, sampler_lib, "_spec_init", n=1)
    a = speculative_generate_tokens(tp, dp, tokens, lengths, jax.random.key(1), **kwargs)
    size = speculative_generate_tokens._cache_size()
    speculative_generate_tokens(tp, dp, tokens + 1, lengths, jax.random.key(2), **kwargs)
    speculative_generate_tokens(tp, dp, tokens, jnp.asarray([1, 2], jnp.int32),
                                jax.random.key(3), **kwargs)
    assert speculative_generate_tokens._cache_size() == size
    assert len(loop_traces) <= 1  # 0 if an earlier test compiled these shapes already
    monkeypatch.undo()  # python_driven_speculative jits _spec_init afresh
    step_traces = limit_traces(monkeypatch, sampler_lib, "_spec_body", n=1)
    b = python_driven_speculative(tp, dp, tokens, lengths, jax.random.key(1), **kwargs)
    assert len(step_traces) == 1 and int(np.max(np.sum(np.asarray(a[2]) >= 0, axis=1))) > 1
    chex.assert_trees_all_equal(tuple(a), tuple(b))


def test_stop_tokens_truncate_inside_an_accepted_block():
    tc = TargetConfig.tiny_llama()
    tp = T.init_params(tc, 3)
    dc = DrafterConfig.for_target(tc, num_layers=1, block_size=4)
    dp = D.init_drafter_params(dc, tc, jax.random.key(0))
    tokens, lengths = pad_prompts([[5, 6, 7]])
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=10)
    cache = spec_cache_size(tokens.shape[1], greedy, dc.block_size)
    free = np.asarray(generate_tokens(tp, tokens, lengths, jax.random.key(0), config=tc,
                                      sampling=greedy, cache_size=cache)[0])[0]
    stop = int(free[3])
    out, counts, _, _ = speculative_generate_tokens(
        tp, dp, tokens, lengths, jax.random.key(0), target_config=tc, drafter_config=dc,
        sampling=greedy.replace(stop_tokens=(stop,)), cache_size=cache)
    first = list(free).index(stop)
    assert int(counts[0]) == first + 1
    assert list(np.asarray(out[0, :first + 1])) == list(free[:first + 1])
    assert (np.asarray(out[0, first + 1:]) == PAD_ID).all()


@pytest.mark.parametrize("mode", ["sampled-branch", "sampled-mixture"])
def test_al_estimate_predicts_the_samplers_accepted_count(tiny, mode):
    """E_{x* ~ p}[AL_hat] equals the mean accepted drafts of the sampler's first step
    (same drafter q, Z_T = draft T = 1): losses.al_estimate for `sampled-branch`, and the
    same estimate on the mixture's conditionals (the trainer's / validation's
    `al_estimate_mixture`) for `sampled-mixture`."""
    from dblast_jax import losses
    from dblast_jax.train.trainer import mixture_conditional_logq
    tc, tp, dc, dp = tiny
    temp = 1.0
    sampling = SamplingConfig(temperature=temp, max_new_tokens=NEW, verify_mode=mode)
    _, accepted, _ = sample_sequences(tc, tp, dc, dp, sampling, n=20000, seed=9)
    first_step = accepted[:, 0].astype(np.float64)

    # x* = (anchor, x_1..x_{b-1}) drawn from the target, as the sampler's first step sees it
    plain = SamplingConfig(temperature=temp, max_new_tokens=BLOCK, stop_tokens=())
    n = 8000
    prompts = jnp.tile(jnp.asarray([PROMPT], jnp.int32), (n, 1))
    xs, _ = generate_tokens(tp, prompts, jnp.full((n,), len(PROMPT), jnp.int32),
                            jax.random.key(21), config=tc, sampling=plain, cache_size=16)
    seqs = jnp.concatenate([prompts, xs], axis=1)  # [n, len(PROMPT) + b]
    logits, taps = T.forward(tp, seqs, config=tc, tap_layers=dc.target_layer_ids)
    anchor = len(PROMPT)
    data = seqs[:, anchor + 1:]  # [n, b-1]
    logp_all = sampling_logprobs(logits[:, anchor:-1], temp)  # p_i for x_i, i = 1..b-1
    logp = jnp.take_along_axis(logp_all, data[..., None], axis=-1)[..., 0]
    hidden, prior = D.train_hidden(dp, tp, taps, seqs, jnp.full((n, 1), anchor),
                                   drafter_config=dc, target_config=tc)
    logq_all = jax.nn.log_softmax(D.branch_logits(tp, hidden[:, 0], tc), axis=-1)
    logq = jnp.take_along_axis(logq_all, data[:, None, :, None], axis=-1)[..., 0]  # [n,K,b-1]
    if mode == "sampled-branch":
        al = np.asarray(losses.al_estimate(logq[:, None], prior, logp[:, None]))[:, 0]
    else:
        log_q_mix = mixture_conditional_logq(logq[:, None], prior,
                                             jnp.ones(logp[:, None].shape, bool))
        al = np.asarray(losses.al_estimate(log_q_mix[:, :, None, :], None,
                                           logp[:, None]))[:, 0]
    se = np.sqrt(al.var() / al.size + first_step.var() / first_step.size)
    assert abs(al.mean() - first_step.mean()) < 4 * se, (al.mean(), first_step.mean(), se)


def test_verifier_and_sampler_shape_errors_name_the_argument():
    """chex checks at the entry of the verifier and the samplers (trace time, free under
    jit): the function, the argument and the expected shape are named."""
    k = jax.random.key(0)
    probs = jnp.full((2, 4, 6), 1 / 6)
    drafts = jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(AssertionError, match=r"verify_greedy: drafts must be \[batch, block - 1\]"
                                             r" = \(2, 3\)"):
        verify.verify_greedy(probs, drafts[:, :2])
    with pytest.raises(AssertionError, match="verify_block: drafts must be integer token ids"):
        verify.verify_block(k, k, probs, drafts.astype(jnp.float32), probs[:, :3])
    with pytest.raises(AssertionError, match=r"verify_block: proposal must be .* \(2, 3, 6\)"):
        verify.verify_block(k, k, probs, drafts, probs)
    with pytest.raises(AssertionError, match=r"branch_tokens must be \[batch, K, n\]"):
        verify.mixture_proposal(jnp.zeros((2, 5, 3), jnp.int32), None, drafts,
                                jnp.full((2, 4), 0.25), 6)
    with pytest.raises(AssertionError, match="pass branch_tokens"):
        verify.mixture_proposal(None, None, drafts, jnp.full((2, 4), 0.25), 6)
    tc = TargetConfig.tiny_llama()
    dc = DrafterConfig.for_target(tc, num_layers=1, block_size=4)
    sampling = SamplingConfig(max_new_tokens=2)
    with pytest.raises(AssertionError, match=r"speculative_generate_tokens: prompt_lengths "
                                             r"must be \[batch\] = \[1\]"):
        speculative_generate_tokens({}, {}, jnp.zeros((1, 4), jnp.int32),
                                    jnp.zeros((2,), jnp.int32), k, target_config=tc,
                                    drafter_config=dc, sampling=sampling, cache_size=16)
    with pytest.raises(ValueError, match="does not match the target's hidden_size"):
        speculative_generate_tokens({}, {}, jnp.zeros((1, 4), jnp.int32),
                                    jnp.ones((1,), jnp.int32), k, target_config=tc,
                                    drafter_config=dc.replace(hidden_size=8),
                                    sampling=sampling, cache_size=16)
    with pytest.raises(AssertionError, match=r"generate_tokens: prompt_tokens must be "
                                             r"\[batch, width\]"):
        generate_tokens({}, jnp.zeros((4,), jnp.int32), jnp.ones((1,), jnp.int32), k,
                        config=tc, sampling=sampling, cache_size=16)
