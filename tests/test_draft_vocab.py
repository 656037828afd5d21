"""The draft-time vocabulary: drafting over the N most frequent tokens stays exact.

Exactness is tested the way test_speculative.py tests every mode: a chi-square test of
all 6**4 continuations against the target's exact distribution, here with a draft
vocabulary of 3 of the 6 tokens, so the target puts mass on tokens the drafter can never
propose (they must come from the residual). A verifier that checks the drafts against
the full-vocabulary q instead of the q they were drawn from must fail the same test.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import chi_square_pvalue  # tests/ is on sys.path (pytest "prepend" mode)
from test_speculative import (NEW, P_VALUE, assert_greedy_equals_plain, exact_distribution,
                              sample_patched, sample_sequences,
                              tiny)  # noqa: F401 (tiny is a fixture)

from dblast_jax import draft_vocab as DV
from dblast_jax import generation as G
from dblast_jax.config import SamplingConfig
from dblast_jax.io.dflash import read_draft_vocab

DRAFT_IDS = np.array([3, 1, 0])  # most frequent first; tokens 2, 4, 5 are never drafted

CASES = [("greedy-branch", 1.0, 0, 1.0), ("sampled-branch", 0.7, 0, 1.0),
         ("sampled-branch", 1.5, 3, 0.9), ("mixture", 1.0, 0, 1.0),
         ("sampled-mixture", 1.0, 0, 1.0)]


@pytest.mark.parametrize("mode,temperature,top_k,top_p", CASES)
def test_drafting_over_a_draft_vocabulary_is_lossless(tiny, mode, temperature, top_k, top_p):
    tc, tp, dc, dp = tiny
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p,
                              max_new_tokens=NEW, verify_mode=mode, category_temperature=1.3,
                              draft_temperature=0.8)
    seqs, probs = exact_distribution(tc, tp, sampling)
    outside = ~np.isin(seqs, DRAFT_IDS)
    assert probs[outside.any(axis=1)].sum() > 0.3  # much target mass is never drafted
    samples, accepted, _ = sample_sequences(tc, tp, dc, DV.attach(dp, tp, DRAFT_IDS, tc),
                                            sampling)
    assert chi_square_pvalue(samples, seqs, probs) > P_VALUE
    assert (accepted > 0).mean() > 0.02


def test_the_test_has_power_when_verified_against_the_full_head(tiny, monkeypatch):
    """Drafts drawn over the draft vocabulary but verified against a q that also puts
    mass outside it (as the full head's softmax would: a plausible bug, the two disagree
    on every draft token) must fail the test."""
    tc, tp, dc, dp = tiny
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=NEW, verify_mode="sampled-branch",
                              draft_temperature=0.8)
    seqs, probs = exact_distribution(tc, tp, sampling)
    ids = jnp.asarray(DRAFT_IDS)

    def full_head_q(dv, q, vocab_size):
        scattered = jnp.zeros(q.shape[:-1] + (vocab_size,), q.dtype).at[..., ids].set(q)
        return 0.5 * scattered + 0.5 / vocab_size

    samples, _, _ = sample_patched(monkeypatch, DV, "to_target_probs", full_head_q, tc, tp, dc,
                                   DV.attach(dp, tp, DRAFT_IDS, tc), sampling, seed=1)
    assert chi_square_pvalue(samples, seqs, probs) < P_VALUE


def test_temperature_zero_equals_plain_greedy(tiny):
    tc, tp, dc, dp = tiny
    assert_greedy_equals_plain(tc, tp, dc, DV.attach(dp, tp, DRAFT_IDS[:2], tc))


def test_ranking_mapping_and_bad_inputs(tiny):
    tc, tp, dc, dp = tiny
    counts = np.array([5, 9, 0, 9, 1, 2])
    np.testing.assert_array_equal(DV.ids_from_counts(counts, 4), [1, 3, 0, 5])  # ties: low id
    assert DV.coverage(counts, 2) == pytest.approx(18 / 26)
    attached = DV.attach(dp, tp, DRAFT_IDS, tc)
    assert DV.size(attached) == 3 and DV.size(dp) is None
    core, dv = DV.split(attached)
    assert set(core) == set(dp)
    # the head rows are the target's (tied embedding here)
    np.testing.assert_allclose(dv["head"], np.asarray(tp["embed"]["embedding"])[DRAFT_IDS])
    probs = DV.to_target_probs(dv, jnp.asarray([[0.5, 0.3, 0.2]]), 6)
    np.testing.assert_allclose(probs, [[0.2, 0.3, 0, 0.5, 0, 0]])
    np.testing.assert_array_equal(DV.to_target_ids(dv, jnp.asarray([0, 2])), [3, 0])
    for bad, message in [(np.array([1, 1]), "distinct"), (np.array([0, 6]), r"\[0, 6\)"),
                         (np.arange(6), r"\[1, 6\)"), (np.array([[1]]), r"\[N\] integer")]:
        with pytest.raises(ValueError, match=message):
            DV.attach(dp, tp, bad, tc)
    with pytest.raises(ValueError, match=r"draft_vocab must be an integer in \[1, 6\)"):
        DV.ids_from_counts(counts, 0)


@pytest.fixture(scope="module")
def tiny_target():
    return G.load_target("tiny-llama")


def _folder_drafter(tmp_path, target, counts=None):
    drafter = G.drafter_from_spec("random", target)
    drafter.token_counts = counts
    G.export_drafter(drafter, tmp_path / "d")
    return str(tmp_path / "d")


def test_specs_exports_and_vllm_fields(tmp_path, tiny_target):
    vocab = tiny_target.config.vocab_size
    counts = np.arange(vocab)[::-1].copy()  # token 0 most frequent
    folder = _folder_drafter(tmp_path, tiny_target, counts)
    assert (tmp_path / "d" / DV.COUNTS_FILE).is_file()
    drafters = G.named_drafters([f"full={folder}", f"v8={folder}@draft_vocab=8",
                                 f"c8={folder}+ngram@draft_vocab=8,match=3"], tiny_target)
    assert drafters["full"].draft_vocab is None and drafters["v8"].draft_vocab == 8
    np.testing.assert_array_equal(DV.split(drafters["v8"].params)[1]["ids"], np.arange(8))
    assert DV.size(drafters["c8"].params) == 8
    # it generates, and T = 0 output is the target's whatever the vocabulary
    prompts = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7]]
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=12, stop_tokens=(10**6,))
    plain = G.generate(tiny_target, prompts, sampling, chat=False).tokens
    for name in ("v8", "c8"):
        spec = G.speculative_generate(tiny_target, drafters[name], prompts, sampling,
                                      chat=False)
        assert spec.tokens == plain
    # export with the draft vocabulary: vLLM's fields, read back as the same vocabulary
    out = tmp_path / "exported"
    G.export_drafter(drafters["v8"], out)
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 8
    from safetensors.numpy import load_file
    tensors = load_file(str(out / "model.safetensors"))
    np.testing.assert_array_equal(np.arange(8) + tensors["d2t"], np.arange(8))
    assert tensors["t2d"].sum() == 8 and tensors["lm_head.weight"].shape == (
        8, tiny_target.config.hidden_size)
    np.testing.assert_array_equal(read_draft_vocab(str(out), vocab), np.arange(8))
    loaded = G.drafter_from_spec(str(out), tiny_target)
    assert loaded.draft_vocab == 8 and DV.size(loaded.params) == 8
    # a smaller vocabulary from the same ranking: fine; a larger one than the export has
    # needs the counts, which the export kept
    assert G.with_draft_vocab(loaded, tiny_target, 4).draft_vocab == 4
    (out / DV.COUNTS_FILE).unlink()
    loaded = G.drafter_from_spec(str(out), tiny_target)
    with pytest.raises(ValueError, match="exceeds the 8-token draft vocabulary"):
        G.with_draft_vocab(loaded, tiny_target, 16)


@pytest.mark.parametrize("spec,message", [
    ("x={folder}@draft_vocab=0", "draft_vocab must be an integer >= 1"),
    ("x={folder}@draft_vocab=abc", "draft_vocab must be an integer >= 1"),
    ("x={folder}@draft_vocab=100000", r"draft_vocab must be an integer in \[1, "),
    ("x={bare}@draft_vocab=8", "needs the response-token counts"),
    ("x=ngram@draft_vocab=8", "n-gram drafting has none"),
])
def test_bad_draft_vocab_settings_say_what_is_wrong(tmp_path, tiny_target, spec, message):
    vocab = tiny_target.config.vocab_size
    folder = _folder_drafter(tmp_path, tiny_target, np.ones(vocab, np.int64))
    bare = tmp_path / "bare"
    G.export_drafter(G.drafter_from_spec("random", tiny_target), bare)
    with pytest.raises(ValueError, match=message):
        G.named_drafters([spec.format(folder=folder, bare=bare)], tiny_target)


def test_corrupt_token_counts_name_the_file(tmp_path, tiny_target):
    folder = _folder_drafter(tmp_path, tiny_target, np.ones(tiny_target.config.vocab_size,
                                                            np.int64))
    np.save(f"{folder}/{DV.COUNTS_FILE}", np.ones(3, np.int64))
    with pytest.raises(ValueError, match=r"token_counts.npy: expected \d+ non-negative"):
        G.drafter_from_spec(folder, tiny_target)
    with open(f"{folder}/{DV.COUNTS_FILE}", "wb") as f:
        f.write(b"not an npy file")
    with pytest.raises(ValueError, match="token_counts.npy: unreadable token counts"):
        G.drafter_from_spec(folder, tiny_target)


def test_held_out_scoring_over_a_draft_vocabulary_matches_numpy():
    """Validation scores a draft vocabulary as drafted: log q = logit - logsumexp over the
    vocabulary's ids, -inf for a label outside it; argmax a target id."""
    from dblast_jax.train.config import TrainConfig
    from dblast_jax.train.objective import _draft_vocab_logprobs
    rng = np.random.default_rng(0)
    vocab, hid = 11, 5
    head = rng.normal(size=(vocab, hid)).astype(np.float32)
    hidden = rng.normal(size=(2, 3, hid)).astype(np.float32)
    labels = rng.integers(0, vocab, (2, 3))
    ids = np.array([7, 2, 9, 4])
    dv = {"ids": jnp.asarray(ids), "head": jnp.asarray(head[ids])}
    got = _draft_vocab_logprobs(jnp.asarray(hidden), dv, jnp.asarray(labels), vocab,
                                TrainConfig(name="t", target="t", data="synthetic"))
    logits = hidden @ head[ids].T
    lse = np.log(np.exp(logits).sum(-1))
    for idx in np.ndindex(labels.shape):
        lab = labels[idx]
        want = logits[idx][list(ids).index(lab)] - lse[idx] if lab in ids else -np.inf
        np.testing.assert_allclose(got.logprob[idx], want, rtol=1e-5)
        assert int(got.argmax[idx]) == ids[np.argmax(logits[idx])]


def test_validate_scores_a_draft_vocabulary(tiny_target):
    from dblast_jax.train import validation as V
    drafter = G.drafter_from_spec("random", tiny_target)
    drafter.token_counts = np.arange(tiny_target.config.vocab_size)[::-1].copy()
    drafters = {"full": drafter, "v8": G.with_draft_vocab(drafter, tiny_target, 8)}
    got = V.validate_drafters(drafters, tiny_target, "synthetic", num_batches=1,
                              batch_size=2, seq_len=32, anchors_per_sequence=4,
                              progress=False)
    for name in drafters:
        assert np.isfinite(got[name]["al_estimate"]) and got[name]["al_estimate"] >= 0
    assert got["v8"]["al_estimate"] != got["full"]["al_estimate"]


def test_cli_export_with_token_counts_and_a_draft_vocabulary(tmp_path, tiny_target, capsys):
    from conftest import make_corpus

    from dblast_jax import cli
    corpus = make_corpus(tmp_path / "corpus")
    src = tmp_path / "src"
    G.export_drafter(G.drafter_from_spec("random", tiny_target), src)
    out = tmp_path / "out"
    assert cli.main(["export", str(src), "--out", str(out), "--target", "tiny-llama",
                     "--token-counts-from", f"{corpus}:0:2", "--draft-vocab", "16"]) == 0
    counts = np.load(out / DV.COUNTS_FILE)
    assert counts.sum() == DV.count_corpus_tokens(f"{corpus}:0:2", counts.shape[0]).sum() > 0
    assert counts.sum() < DV.count_corpus_tokens(str(corpus), counts.shape[0]).sum()
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 16
    np.testing.assert_array_equal(read_draft_vocab(str(out), counts.shape[0]),
                                  DV.ids_from_counts(counts, 16))
    # a corpus that is not there: one line, nothing written
    assert cli.main(["export", str(src), "--out", str(tmp_path / "none"), "--target",
                     "tiny-llama", "--token-counts-from", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err and not (tmp_path / "none").exists()
