"""Corpus regeneration on the tiny random Llama (token prompts: it has no tokenizer)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dblast_jax.data import corpus as corpus_io
from dblast_jax.data import regenerate as regen
from dblast_jax.data.corpus import Corpus
from dblast_jax.generation import load_target
from dblast_jax.config import SamplingConfig
from dblast_jax.models import target as target_lm
from dblast_jax.sampler import generate_scored_tokens, generate_tokens

STOP = 5


@pytest.fixture(scope="module")
def target():
    return load_target("tiny-llama")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(6, 97, int(rng.integers(3, 20)))] for _ in range(11)]


CFG = regen.RegenConfig(gen_temperatures=(1.0,), verify_temperatures=(0.7, 1.5),
                        max_new_tokens=10, batch_size=4, shard_size=5, pad_multiple=32, seed=3,
                        logprob_rows=16)  # 40 scored rows per batch: 3 head blocks, padded


@pytest.fixture(scope="module")
def full(tmp_path_factory, target, prompts):
    out = tmp_path_factory.mktemp("full")
    manifest = regen.regenerate(target, prompts, out, CFG, progress=False, stop_tokens=(STOP,))
    return out, manifest


def _fresh_logits(target, records, width=32):
    """One jitted full-logits forward over all records, right-padded to `width`."""
    toks = np.zeros((len(records), width), np.int32)
    for i, r in enumerate(records):
        toks[i, :len(r["tokens"])] = r["tokens"]
    fwd = jax.jit(lambda p, t: target_lm.forward(p, t, config=target.config)[0])
    return fwd(target.params, jnp.asarray(toks))


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.glob("shard-*.npz"))}


def test_manifest_and_counts(full, prompts, target):
    out, m = full
    assert m["complete"] and m["num_shards"] == 3 and len(m["shards"]) == 3
    assert m["totals"]["sequences"] == len(prompts)
    assert m["target"]["name"] == "tiny-llama"
    assert m["target"]["params_sha256"] == regen.params_digest(target.params)
    assert m["settings"]["verify_temperatures"] == [0.7, 1.5]
    assert m["settings"]["stop_tokens"] == [STOP]
    for s in m["shards"]:
        assert corpus_io.sha256_file(out / s["file"]) == s["sha256"]
    assert json.loads((out / "manifest.json").read_text()) == m
    c = Corpus(out)
    assert len(c) == len(prompts)
    ids = sorted(int(c[i]["id"].split("/")[1]) for i in range(len(c)))
    assert ids == list(range(len(prompts)))
    for i in range(len(c)):
        r = c[i]
        p = prompts[int(r["id"].split("/")[1])]
        n_resp = int(r["loss_mask"].sum())
        assert list(r["tokens"][:len(p)]) == p and r["prompt_length"] == len(p)
        assert not r["loss_mask"][:len(p)].any() and r["loss_mask"][len(p):].all()
        assert 1 <= n_resp <= CFG.max_new_tokens
        resp = list(r["tokens"][len(p):])
        # stops exactly at the first stop token, else runs to max_new_tokens
        assert r["stopped"] == (STOP in resp)
        if STOP in resp:
            assert resp.index(STOP) == len(resp) - 1
        else:
            assert n_resp == CFG.max_new_tokens


def test_stored_logprobs_equal_a_fresh_teacher_forced_pass(full, target):
    out, _ = full
    c = Corpus(out)
    records = [c[i] for i in range(len(c))]
    all_logits = np.asarray(_fresh_logits(target, records))
    for r, logits in zip(records, all_logits):
        n, p = len(r["tokens"]), r["prompt_length"]
        for t in (0.7, 1.5):
            logp_all = jax.nn.log_softmax(logits[:n - 1] / t, axis=-1)
            want = np.take_along_axis(np.asarray(logp_all), r["tokens"][1:, None], axis=-1)[:, 0]
            ent = np.asarray(-(jnp.exp(logp_all) * logp_all).sum(-1))
            key = corpus_io.temperature_key(t)
            assert r["logp"][key].dtype == np.float32
            # response tokens: the fresh pass; prompt tokens are not scored (0)
            np.testing.assert_allclose(r["logp"][key][p:], want[p - 1:], atol=2e-5, rtol=1e-5)
            np.testing.assert_allclose(r["entropy"][key][p:], ent[p - 1:], atol=2e-5,
                                       rtol=1e-5)
            assert not r["logp"][key][:p].any() and not r["entropy"][key][:p].any()
            assert (r["logp"][key][p:] < 0).all()


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.0, 0), (0.8, 5)])
def test_scores_kept_while_sampling_equal_the_teacher_forced_pass(target, prompts, temperature,
                                                                   top_k):
    """The one-pass regeneration (scores from the logits each token was sampled from)
    against the teacher-forced pass it replaced, and its tokens against the plain loop's:
    same key, same tokens; scores untruncated whatever top-k the sampling used."""
    config = target.config
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, max_new_tokens=9,
                              stop_tokens=(STOP,))
    toks, lens = regen._pad_batch(prompts[:4], 32)
    key, temps = jax.random.key(7), (0.7, 1.0, 1.5)
    out, counts, lp, en = generate_scored_tokens(
        target.params, jnp.asarray(toks), jnp.asarray(lens), key, config=config,
        sampling=sampling, cache_size=64, score_temperatures=temps)
    plain, plain_counts = generate_tokens(target.params, jnp.asarray(toks), jnp.asarray(lens),
                                          key, config=config, sampling=sampling, cache_size=64)
    np.testing.assert_array_equal(out, plain)
    np.testing.assert_array_equal(counts, plain_counts)
    out, counts = np.asarray(out), np.asarray(counts)
    assert lp.shape == en.shape == (3, 4, 9)
    rows = [list(prompts[r]) + [int(t) for t in out[r, :counts[r]]] for r in range(4)]
    stoks, _ = regen._pad_batch(rows, 64)
    want_lp, want_en = regen.teacher_forced(target.params, jnp.asarray(stoks), jnp.asarray(lens),
                                            config=config, temperatures=temps, num_new=9,
                                            row_block=16)
    for r in range(4):
        n = counts[r]
        np.testing.assert_allclose(np.asarray(lp)[:, r, :n], np.asarray(want_lp)[:, r, :n],
                                   atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(en)[:, r, :n], np.asarray(want_en)[:, r, :n],
                                   atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="score_temperatures must be positive"):
        generate_scored_tokens(target.params, jnp.asarray(toks), jnp.asarray(lens), key,
                               config=config, sampling=sampling, cache_size=64,
                               score_temperatures=(0.0,))


def test_several_generation_temperatures_and_greedy_answers(tmp_path, target, prompts):
    cfg = regen.RegenConfig(gen_temperatures=(0.0, 1.0), verify_temperatures=(1.0,),
                            max_new_tokens=10, batch_size=4, shard_size=8, pad_multiple=32)
    m = regen.regenerate(target, prompts[:4], tmp_path, cfg, progress=False,
                         stop_tokens=(STOP,))
    assert [s["gen_temperature"] for s in m["shards"]] == [0.0, 1.0]
    c = Corpus(tmp_path, verify_temperature=1.0)
    records = [c[i] for i in range(len(c))]
    assert [r["gen_temperature"] for r in records] == [0.0] * 4 + [1.0] * 4
    assert [r["id"] for r in records[:4]] == [r["id"] for r in records[4:]]
    preds = np.asarray(jnp.argmax(_fresh_logits(target, records), -1))
    for r, pred in zip(records[:4], preds[:4]):  # temperature 0: the target's argmax
        p, n = r["prompt_length"], len(r["tokens"])
        np.testing.assert_array_equal(r["tokens"][p:], pred[p - 1:n - 1])
        assert isinstance(r["logp"], np.ndarray)  # one temperature selected
    assert any(not np.array_equal(a["tokens"], b["tokens"])
               for a, b in zip(records[:4], records[4:]))


def test_kill_and_resume_gives_the_same_corpus(full, tmp_path, target, prompts, monkeypatch):
    out, m_full = full
    m1 = regen.regenerate(target, prompts, tmp_path, CFG, progress=False,
                          stop_tokens=(STOP,), max_shards=1)
    assert not m1["complete"] and [s["index"] for s in m1["shards"]] == [0]
    first = (tmp_path / "shard-00000.npz").stat().st_mtime_ns
    # a crash mid-shard: a stray temp file and a truncated shard that is not in the manifest
    (tmp_path / ".shard-00001.npz.123.tmp").write_bytes(b"partial")
    (tmp_path / "shard-00001.npz").write_bytes(b"truncated")
    calls = []
    real = regen._run_shard
    monkeypatch.setattr(regen, "_run_shard", lambda *a, **k: calls.append(a[2].index)
                        or real(*a, **k))
    m2 = regen.regenerate(target, prompts, tmp_path, CFG, progress=False, stop_tokens=(STOP,))
    assert calls == [1, 2]  # the finished shard was skipped
    assert not list(tmp_path.glob(".*.tmp"))
    assert (tmp_path / "shard-00000.npz").stat().st_mtime_ns == first
    assert m2["complete"]
    assert _files(tmp_path) == _files(out)  # byte-identical shards
    strip = lambda m: [{k: v for k, v in s.items() if not k.endswith("seconds")}
                       for s in m["shards"]]
    assert strip(m2) == strip(m_full)


def test_resume_refuses_changed_settings(full, target, prompts):
    out, _ = full
    with pytest.raises(ValueError, match=r"different settings \(differs in \['seed'\]\)"):
        regen.regenerate(target, prompts, out, CFG.__class__(**{**CFG.__dict__, "seed": 4}),
                         progress=False, stop_tokens=(STOP,))
    with pytest.raises(ValueError, match="different prompts"):
        regen.regenerate(target, prompts[:-1], out, CFG, progress=False, stop_tokens=(STOP,))


def test_corrupt_shard_is_refused_by_the_reader(full, tmp_path):
    out, _ = full
    for p in out.iterdir():
        (tmp_path / p.name).write_bytes(p.read_bytes())
    data = bytearray((tmp_path / "shard-00001.npz").read_bytes())
    data[-30] ^= 1
    (tmp_path / "shard-00001.npz").write_bytes(bytes(data))
    c = Corpus(tmp_path)
    c[0]  # shard 0 is fine
    with pytest.raises(ValueError, match="shard-00001.npz: sha256 .* does not match"):
        c[7]


def test_seeds_and_shard_keys_change_the_answers(full, tmp_path, target, prompts):
    out, _ = full
    cfg = regen.RegenConfig(**{**CFG.__dict__, "seed": 4})
    regen.regenerate(target, prompts, tmp_path, cfg, progress=False, stop_tokens=(STOP,),
                     max_shards=1)
    a = corpus_io.read_shard(out / "shard-00000.npz")
    b = corpus_io.read_shard(tmp_path / "shard-00000.npz")
    assert not np.array_equal(a["tokens"], b["tokens"])


def test_config_validation():
    with pytest.raises(ValueError, match="verification temperatures must be > 0"):
        regen.RegenConfig(verify_temperatures=(0.0,))
    with pytest.raises(ValueError, match="duplicate"):
        regen.RegenConfig(verify_temperatures=(1.0, 1))
    with pytest.raises(ValueError, match="text but the target has no tokenizer"):
        from dblast_jax.data.sources import Prompt
        regen.encode_work([Prompt("1", "s", ("hi",))])


def test_stats_report(full):
    from dblast_jax.data.stats import corpus_stats, format_stats
    out, m = full
    s = corpus_stats(out, bins=[0, 5, 11])
    c = Corpus(out)
    records = [c[i] for i in range(len(c))]
    resp = np.array([int(r["loss_mask"].sum()) for r in records])
    assert s["sequences"] == 11 and s["tokens"] == m["totals"]["tokens"]
    assert s["response_tokens"] == resp.sum() == m["totals"]["response_tokens"]
    assert s["response_length_histogram"]["counts"] == [int((resp < 5).sum()),
                                                       int((resp >= 5).sum())]
    for t in ("0.7", "1.5"):
        want = np.concatenate([r["entropy"][t][r["loss_mask"]] for r in records]).mean()
        assert s["mean_entropy"][t] == pytest.approx(want, rel=1e-5)
    # a flatter distribution (higher T) has more entropy
    assert s["mean_entropy"]["1.5"] > s["mean_entropy"]["0.7"]
    text = format_stats(s)
    assert "mean entropy" in text and "1.5" in text and "sequences" in text


def test_cli_stats_command(full, capsys):
    import argparse
    from dblast_jax.data.cli_commands import add_data_subcommands
    out, _ = full
    parser = argparse.ArgumentParser()
    add_data_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["data", "stats", str(out), "--json"])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sequences"] == 11 and set(report["mean_entropy"]) == {"0.7", "1.5"}


def test_prompts_of_a_shard_range_answered_again(full, prompts, tmp_path):
    """`--prompts-from CORPUS:A:B`: the same prompts (templated tokens) as shards A..B-1,
    answered again, e.g. a held-out range sampled at the verification temperature."""
    import argparse
    from dblast_jax.data.cli_commands import add_data_subcommands
    out, _ = full
    def as_set(token_lists):
        return sorted(tuple(p) for p in token_lists)
    # shards of 5, 5, 1 prompts (a shard stores its prompts in batching order)
    assert as_set(regen.corpus_prompts(out, "1:3")) == as_set(prompts[5:11])
    parser = argparse.ArgumentParser()
    add_data_subcommands(parser.add_subparsers(dest="command", required=True))
    again = tmp_path / "again"
    args = parser.parse_args([
        "data", "regenerate", "--model", "tiny-llama", "--out", str(again),
        "--prompts-from", f"{out}:1:3", "--gen-temperatures", "1.5",
        "--verify-temperatures", "1.5", "--max-new-tokens", "6", "--batch-size", "4",
        "--shard-size", "4", "--no-progress"])
    assert args.func(args) == 0
    redone = Corpus(again, verify_temperature=1.5)
    assert len(redone) == 6
    assert as_set(regen.corpus_prompts(again, "0:2")) == as_set(prompts[5:11])
    assert all(redone[i]["gen_temperature"] == pytest.approx(1.5) for i in range(6))
    with pytest.raises(ValueError, match="shard range"):
        regen.corpus_prompts(out, "2:1")
    args = parser.parse_args(["data", "regenerate", "--model", "tiny-llama", "--out",
                              str(tmp_path / "x"), "--prompts-from", f"{out}:0:1",
                              "--pools", "sharegpt"])
    with pytest.raises(ValueError, match="replaces the training pools"):
        args.func(args)
