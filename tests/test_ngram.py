"""n-gram (prompt lookup) drafting and the combined drafter inside the on-device loop.

The proposal is checked against a plain-Python reference on random buffers; the loops are
checked for exactness the way test_speculative.py checks the trained drafters: a chi-square
test against the target's exact distribution of all 6**4 continuations (with the same
broken-verifier power check), and T = 0 output equal to plain greedy decoding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import chi_square_pvalue  # tests/ is on sys.path (pytest "prepend" mode)
from test_speculative import (NEW, P_VALUE, _broken_verify_block, exact_distribution,
                              sample_patched,
                              sample_sequences, tiny)  # noqa: F401 (tiny is a fixture)

from dblast_jax import generation as G
from dblast_jax import ngram, verify
from dblast_jax.config import CombinedDrafterConfig, NgramConfig, SamplingConfig, TargetConfig
from dblast_jax.models import drafter as D
from dblast_jax.models import target as T
from dblast_jax.sampler import (generate_tokens, pad_prompts, spec_cache_size,
                                speculative_generate_tokens)


def reference_propose(text, num_drafts, min_n, max_n):
    """Plain Python: the longest suffix of max_n..min_n tokens seen before, the tokens
    after its latest earlier occurrence, continued with the match's period."""
    last = len(text) - 1
    for n in range(max_n, min_n - 1, -1):
        if n > len(text) - 1:
            continue
        suffix = text[len(text) - n:]
        ends = [j for j in range(n - 1, last) if text[j - n + 1:j + 1] == suffix]
        if ends:
            end = max(ends)
            out = list(text)
            for _ in range(num_drafts):
                out.append(out[len(out) - (last - end)])
            return out[len(text):], n
    return [text[-1]] * num_drafts, 0


@pytest.mark.parametrize("min_n,max_n", [(1, 4), (2, 3), (3, 3)])
def test_propose_matches_a_python_reference(min_n, max_n):
    rng = np.random.default_rng(min_n * 10 + max_n)
    width, rows = 40, 64
    history = rng.integers(0, 4, (rows, width))  # 4 tokens: many matches, of every length
    history[:8] = np.tile([1, 2, 3], width)[:width]  # periodic rows: the period continues
    lengths = rng.integers(1, width + 1, rows)
    drafts, match = ngram.propose(jnp.asarray(history), jnp.asarray(lengths), num_drafts=6,
                                  min_n=min_n, max_n=max_n)
    for b in range(rows):
        want, want_n = reference_propose(list(history[b, :lengths[b]]), 6, min_n, max_n)
        assert list(np.asarray(drafts[b])) == want, (b, lengths[b])
        assert int(match[b]) == want_n
    assert (np.asarray(match) == max_n).any() and (np.asarray(match) == 0).any()


def _ngram_cases():
    cases = [("ngram", temp, 0, 1.0) for temp in (0.7, 1.0, 1.5)]
    cases += [("ngram", 1.0, 3, 0.9), ("ngram_min2", 1.0, 0, 1.0), ("combined", 1.0, 0, 1.0),
              ("combined", 1.5, 3, 0.9)]
    return cases


def _drafter_for(kind, dc, block):
    if kind == "ngram":
        return NgramConfig(block_size=block, max_n=2, min_n=1)
    if kind == "ngram_min2":  # most steps find no 2-token match: plain steps between copies
        return NgramConfig(block_size=block, max_n=3, min_n=2)
    return CombinedDrafterConfig(dc, NgramConfig(block_size=block, max_n=2), min_match=2)


@pytest.mark.parametrize("kind,temperature,top_k,top_p", _ngram_cases())
def test_ngram_drafting_is_lossless(tiny, kind, temperature, top_k, top_p):
    tc, tp, dc, dp = tiny
    config = _drafter_for(kind, dc, dc.block_size)
    params = dp if kind == "combined" else {}
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p,
                              max_new_tokens=NEW, verify_mode="sampled-branch")
    seqs, probs = exact_distribution(tc, tp, sampling)
    samples, accepted, _ = sample_sequences(tc, tp, config, params, sampling)
    assert chi_square_pvalue(samples, seqs, probs) > P_VALUE
    assert (accepted > 0).mean() > 0.02  # copied drafts do get accepted


def test_the_ngram_test_has_power_on_a_broken_verifier(tiny, monkeypatch):
    tc, tp, dc, _ = tiny
    config = _drafter_for("ngram", dc, dc.block_size)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=NEW)
    seqs, probs = exact_distribution(tc, tp, sampling)
    samples, _, _ = sample_patched(monkeypatch, verify, "verify_block", _broken_verify_block,
                                   tc, tp, config, {}, sampling, seed=1)
    assert chi_square_pvalue(samples, seqs, probs) < P_VALUE


@pytest.fixture(scope="module")
def tiny_qwen3():
    tc = TargetConfig.tiny_qwen3()
    tp = T.init_params(tc, 2)
    dc = G.DrafterConfig.for_target(tc, num_layers=1, block_size=5, num_categories=2)
    dp = D.init_drafter_params(dc, tc, jax.random.key(1))
    return tc, tp, dc, dp


@pytest.mark.parametrize("kind", ["ngram", "combined"])
def test_temperature_zero_equals_plain_greedy(tiny_qwen3, kind):
    tc, tp, dc, dp = tiny_qwen3
    config = _drafter_for(kind, dc, 5)
    tokens, lengths = pad_prompts([[3, 4, 5, 3, 4, 5, 3], [8, 9], [10, 11, 12, 10, 11]])
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=23)
    cache = spec_cache_size(tokens.shape[1], sampling, 5)
    spec = speculative_generate_tokens(tp, {} if kind == "ngram" else dp, tokens, lengths,
                                       jax.random.key(0), target_config=tc,
                                       drafter_config=config, sampling=sampling,
                                       cache_size=cache)
    plain = generate_tokens(tp, tokens, lengths, jax.random.key(0), config=tc,
                            sampling=sampling, cache_size=cache)
    np.testing.assert_array_equal(spec[0], plain[0])
    np.testing.assert_array_equal(spec[1], plain[1])
    assert (np.asarray(spec[2]) > 0).any()  # some copied drafts were accepted


def _has_repeat(text, n):
    grams = [tuple(text[i:i + n]) for i in range(len(text) - n + 1)]
    return len(set(grams)) < len(grams)


def test_combined_without_a_long_enough_match_is_the_trained_drafter(tiny_qwen3):
    """Rows whose suffix never matched min_match tokens use the trained drafter's drafts
    and keys: the combined loop then reproduces the trained drafter's run exactly."""
    tc, tp, dc, dp = tiny_qwen3
    combined = CombinedDrafterConfig(dc, NgramConfig(block_size=5, max_n=4), min_match=4)
    tokens, lengths = pad_prompts([[3, 4, 5, 6, 7], [20, 21, 22]])
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12)
    cache = spec_cache_size(tokens.shape[1], sampling, 5)
    runs = [np.asarray(speculative_generate_tokens(
        tp, dp, tokens, lengths, jax.random.key(7), target_config=tc, drafter_config=cfg,
        sampling=sampling, cache_size=cache)[0]) for cfg in (dc, combined)]
    for row, n in zip(runs[0], np.asarray(lengths)):
        text = list(np.asarray(tokens)[0 if n == 5 else 1, :n]) + list(row)
        assert not _has_repeat(text, 4)  # the premise: no 4-token suffix ever matched
    np.testing.assert_array_equal(runs[0], runs[1])


def test_ngram_and_combined_through_the_generation_api():
    target = G.load_target("tiny-llama")
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7, 5, 6, 7, 5]]
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=30, stop_tokens=(10**6,))
    plain = G.generate(target, prompts, sampling, chat=False)
    drafters = G.named_drafters(["ng=ngram@n=3,k=4", "both=random-k2+ngram@match=3,min_n=2"],
                                target)
    assert drafters["ng"].config == NgramConfig(block_size=5, max_n=3, min_n=2)
    assert drafters["ng"].block_override == 5 and drafters["ng"].ngram_settings == {"max_n": 3}
    both = drafters["both"].config
    assert isinstance(both, CombinedDrafterConfig) and both.min_match == 3
    assert both.ngram == NgramConfig(block_size=8, max_n=4, min_n=2)
    for drafter in drafters.values():
        res = G.speculative_generate(target, drafter, prompts, sampling, chat=False)
        assert res.tokens == plain.tokens
        assert res.stats["tau"] > 1.5  # repeating prompts: the copies are accepted


@pytest.mark.parametrize("spec,message", [
    ("a=ngram@n=0", "n must be an integer >= 1"),
    ("a=ngram@n=2,min_n=3", "min_n (3) must be <= max_n (2)"),
    ("a=ngram@n=1", "min_n (2) must be <= max_n (1)"),
    ("a=ngram@k=4,block=8", "k=4 and block=8 disagree"),
    ("a=ngram@match=2", "match= applies to a combined drafter"),
    ("a=random-k2+ngram@match=5", "min_match (5) exceeds the n-gram's max_n (4)"),
    ("a=random-k2@n=3", "n-gram keys"),
    ("a=ngram@block=1", "block must be an integer >= 2"),
])
def test_bad_ngram_specs_say_what_is_wrong(spec, message):
    target = G.load_target("tiny-llama")
    with pytest.raises(ValueError) as err:
        G.named_drafters([spec], target)
    assert message in str(err.value)


def test_speed_ceiling_replay_reproduces_the_loop_at_temperature_zero(tiny_qwen3):
    """experiments/smollm2/ngram_speed_ceiling.py predicts prompt lookup's speed by
    replaying the drafter on greedy text instead of running the target: at T = 0 (batch 1)
    its steps must be the loop's own, step for step."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "experiments", "smollm2",
                        "ngram_speed_ceiling.py")
    spec = importlib.util.spec_from_file_location("ngram_speed_ceiling", path)
    ceiling = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ceiling)
    tc, tp, _, _ = tiny_qwen3
    prompt = [3, 4, 5, 3, 4, 5, 3, 9, 3, 4]
    tokens, lengths = pad_prompts([prompt])
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=30)
    config = NgramConfig(block_size=ceiling.MAX_K + 1, max_n=4, min_n=2)
    cache = spec_cache_size(tokens.shape[1], sampling, config.block_size)
    out, n, accepted, _ = speculative_generate_tokens(
        tp, {}, tokens, lengths, jax.random.key(0), target_config=tc, drafter_config=config,
        sampling=sampling, cache_size=cache)
    text = np.asarray(prompt + list(np.asarray(out[0, :int(n[0])])), np.int32)
    steps = ceiling.replay([(text, len(prompt))], 2, 4, lambda m: ceiling.MAX_K, 30)
    loop = [int(a) for a in np.asarray(accepted[0]) if a >= 0]
    # the loop's first step verifies the prefill's token as its anchor, as the replay does;
    # the loop's last step may be cut by max_new_tokens, the replay's by the text's end
    assert [a for _, _, a in steps][:-1] == loop[:len(steps) - 1]
    assert len(steps) == len(loop)
    assert any(k == 0 for _, k, _ in steps) and any(a > 0 for _, _, a in steps)
