"""The sampled training head (issue 14, cheaper steps): the frequent tokens exactly plus an
importance-weighted uniform sample of the rest. Exact where the estimate must be exact
(the rest's logits all equal), unbiased for the normaliser elsewhere (Monte Carlo against
numpy), chunked rows equal to all rows; the frequent ids are counted on response tokens;
the trainer trains with it, keeps its ids across a resume, and scores held-out data with
the full head."""

import json

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dblast_jax.chunked_logits import token_logprobs
from dblast_jax.train import sampled_head as SH
from dblast_jax.train import step as step_lib
from dblast_jax.train import trainer as TR
from conftest import corpus_cfg as _cfg  # `corpus`: a conftest fixture
from conftest import tiny_target


def _log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _setup(v=40, h=6, n=10, seed=0, flat_rest=False, frequent=(0, 3, 5, 7, 11, 13)):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(v, h)).astype(np.float32)
    f = np.asarray(frequent, np.int32)
    if flat_rest:  # every token outside F has the same LM-head row
        rest = np.setdiff1d(np.arange(v), f)
        w[rest] = w[rest[0]]
    hid = rng.normal(size=(n, h)).astype(np.float32)
    return w, f, hid


@pytest.mark.parametrize("layout", ["vh", "hv"])
def test_equal_rest_logits_make_the_estimate_exact(layout):
    w, f, hid = _setup(flat_rest=True)
    targets = np.array([0, 3, 20, 21, 39, 5, 30, 7, 11, 25], np.int32)  # in and out of F
    head = jnp.asarray(w if layout == "vh" else w.T)
    exact = np.take_along_axis(_log_softmax(hid @ w.T), targets[:, None], 1)[:, 0]

    def lp(x, key):
        return SH.sampled_token_logprobs(x, head, layout, jnp.asarray(targets),
                                         jnp.asarray(f), key, 5).logprob

    for seed in range(3):  # any sample of the rest
        got = lp(jnp.asarray(hid), jax.random.PRNGKey(seed))
        np.testing.assert_allclose(np.asarray(got), exact, rtol=1e-5, atol=1e-5)
    # ... and so is its gradient wrt the drafter's states
    g_s = jax.grad(lambda x: jnp.sum(lp(x, jax.random.PRNGKey(0))))(jnp.asarray(hid))
    g_e = jax.grad(lambda x: jnp.sum(token_logprobs(x, head, layout, jnp.asarray(targets),
                                                    1.0, 8).logprob))(jnp.asarray(hid))
    np.testing.assert_allclose(np.asarray(g_s), np.asarray(g_e), rtol=1e-4, atol=1e-5)


def test_the_normaliser_estimate_is_unbiased():
    """E[Z_hat] = Z for a target inside and outside F (4,000 draws of the sample)."""
    w, f, hid = _setup(v=24, n=2, seed=3, frequent=(1, 2, 4, 8))
    hid = hid * 0.7
    targets = np.array([2, 17], np.int32)  # in F, in the rest
    z = hid @ w.T
    z_exact = np.exp(z).sum(-1)
    keys = jax.random.split(jax.random.PRNGKey(0), 4000)

    def z_hat(key):
        lp = SH.sampled_token_logprobs(jnp.asarray(hid), jnp.asarray(w), "vh",
                                       jnp.asarray(targets), jnp.asarray(f), key, 3).logprob
        return jnp.exp(jnp.asarray(z[np.arange(2), targets]) - lp)

    draws = np.asarray(jax.vmap(z_hat)(keys))  # [4000, 2]
    mean, se = draws.mean(0), draws.std(0) / np.sqrt(len(draws))
    assert np.all(np.abs(mean - z_exact) < 4 * se + 1e-6), (mean, z_exact, se)
    assert np.all(draws.std(0) > 0)  # the sample does vary: the check above means something
    # every estimate counts F and the target itself exactly, so log q(t) <= 0 always
    assert np.all(draws >= np.exp(z[:, f]).sum(-1)[None] - 1e-5)


def test_rows_in_blocks_equal_all_rows_and_argmax_is_the_candidates_best():
    w, f, hid = _setup(n=13, seed=5)
    targets = np.arange(13, dtype=np.int32) * 3
    key = jax.random.PRNGKey(7)
    args = (jnp.asarray(hid), jnp.asarray(w), "vh", jnp.asarray(targets), jnp.asarray(f), key, 4)
    whole = SH.sampled_token_logprobs(*args)
    blocks = SH.sampled_token_logprobs(*args, row_chunk_size=5)
    np.testing.assert_allclose(np.asarray(blocks.logprob), np.asarray(whole.logprob),
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(blocks.argmax), np.asarray(whole.argmax))
    sampled = np.asarray(SH.sample_rest(jax.random.fold_in(key, 0), jnp.asarray(f), 40, 4))
    assert len(set(sampled.tolist())) == 4 and not set(sampled.tolist()) & set(f.tolist())
    z = hid @ w.T
    arg = np.asarray(whole.argmax)
    for i in range(13):  # the best logit among the tokens the estimate looked at
        assert z[i, arg[i]] >= z[i, f].max() - 1e-5 and z[i, arg[i]] >= z[i, targets[i]] - 1e-5
    with pytest.raises(ValueError, match="below the vocabulary"):
        SH.sampled_token_logprobs(*args[:-1], 40 - len(f))


def test_frequent_token_ids_count_response_tokens():
    recs = [{"tokens": [9, 9, 1, 2, 2, 2], "loss_mask": [1, 1, 0, 1, 1, 1]},
            {"tokens": [3, 3, 3, 3, 2, 5], "loss_mask": [0, 0, 0, 0, 1, 1]}]
    ids, stats = SH.frequent_token_ids(recs, 10, 3)
    # response counts: 2 x4, 9 x2, 5 x1 (3 is prompt only, never counted)
    assert ids.tolist() == [2, 5, 9]
    assert stats["response_tokens"] == 7 and stats["coverage"] == 1.0
    ids, stats = SH.frequent_token_ids(recs, 10, 1)
    assert ids.tolist() == [2] and abs(stats["coverage"] - 4 / 7) < 1e-9
    ids, _ = SH.frequent_token_ids(recs, 10, 5)  # unseen ids fill in, lowest first
    assert ids.tolist() == [0, 1, 2, 5, 9]
    assert SH.coverage(np.array([2, 9]), np.array([[2, 3], [9, 9]])) == 0.75
    with pytest.raises(ValueError, match="outside"):
        SH.frequent_token_ids([{"tokens": [12], "loss_mask": [1]}], 10, 2)
    with pytest.raises(ValueError, match="random-access"):
        SH.frequent_token_ids(iter(recs), 10, 2)
    with pytest.raises(ValueError, match=r"\[1, 10\)"):
        SH.frequent_token_ids(recs, 10, 10)


def test_trainer_uses_the_sampled_head_resumes_it_and_scores_with_the_full_head(
        corpus, tmp_path):  # noqa: F811
    more = ("train_head_tokens=24", "train_head_sampled=16", "num_steps=4",
            "checkpoint_every=2")
    wd = tmp_path / "run"
    trainer = TR.Trainer(_cfg(corpus, *more), str(wd), target=tiny_target(), progress=False,
                         log=lambda s: None)
    saved = json.loads((wd / TR.HEAD_TOKENS_FILE).read_text())
    assert len(saved["ids"]) == 24 and 0 < saved["coverage"] <= 1
    np.testing.assert_array_equal(trainer.head_ids, saved["ids"])
    first = trainer.run(stop_at=2)
    assert all(np.isfinite(h["loss"]) for h in first.history)
    # held-out scoring: the same numbers as a full-head run's evaluation of these params
    got = trainer.evaluate(str(corpus), num_batches=2)
    plain = TR.Trainer(_cfg(corpus, "num_steps=4"), str(tmp_path / "plain"),
                       target=tiny_target(), progress=False, log=lambda s: None)
    plain.state = plain.state.replace(params=trainer.state.params)
    want = plain.evaluate(str(corpus), num_batches=2)
    plain.close()
    for key in ("nll", "al_estimate", "top1_mean"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    trainer.close()
    # the training loss itself is the estimate, not the full softmax
    full = TR.Trainer(_cfg(corpus, "num_steps=4", "checkpoint_every=2"), str(tmp_path / "f"),
                      target=tiny_target(), progress=False, log=lambda s: None)
    full_hist = full.run(stop_at=1).history
    full.close()
    assert abs(first.history[0]["loss"] - full_hist[0]["loss"]) > 1e-6
    # a resume reads the ids the run started with, even if the data's counts change
    (wd / TR.HEAD_TOKENS_FILE).write_text(json.dumps(dict(saved, ids=list(range(24)))))
    again = TR.Trainer(_cfg(corpus, *more), str(wd), target=tiny_target(), progress=False,
                       log=lambda s: None)
    assert again.start_step == 2 and again.head_ids.tolist() == list(range(24))
    rest = again.run()
    again.close()
    assert rest.step == 4 and all(np.isfinite(h["loss"]) for h in rest.history)
    assert step_lib.eval_config(again.config).train_head_tokens == 0


def test_sampled_head_bad_settings_are_refused(corpus, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="train_head_tokens must be >= 0"):
        _cfg(corpus, "train_head_tokens=-1")
    with pytest.raises(ValueError, match="below the vocabulary 97"):
        TR.Trainer(_cfg(corpus, "train_head_tokens=90", "train_head_sampled=7"),
                   str(tmp_path / "x"), target=tiny_target(), progress=False,
                   log=lambda s: None)
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())
    bad = tmp_path / "y"
    bad.mkdir()
    (bad / TR.HEAD_TOKENS_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="unreadable"):
        TR.Trainer(_cfg(corpus, "train_head_tokens=8", "train_head_sampled=8"), str(bad), target=tiny_target(),
                   progress=False, log=lambda s: None)
