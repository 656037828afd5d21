"""Cached target features: training on cached taps equals training with the live target
pass; caches are keyed by what they were computed from, resume after a kill, and refuse
what they cannot serve."""

import json
import os

import jax
import numpy as np
import pytest

from dblast_jax.data import corpus as corpus_io
from dblast_jax.train import feature_cache as FC
from dblast_jax.train import trainer as TR
# tests/ is on sys.path (pytest "prepend" mode); `corpus` is a conftest fixture
from conftest import CORPUS_SEQ as SEQ, corpus_cfg as _cfg, tiny_cfg, tiny_target
from conftest import train_quietly as _train


def _source(corpus):
    return corpus_io.Corpus(corpus, verify_temperature=1.0)


def _build(corpus, folder, **kw):
    tcfg, tparams, name = tiny_target()
    return FC.build_feature_cache(_source(corpus), tcfg, tparams, (1,), SEQ, folder,
                                  target_name=name, progress=False, log=lambda s: None, **kw)


def test_training_on_cached_features_equals_live_target(corpus, tmp_path):
    live = _train(_cfg(corpus), tmp_path / "live")
    cached = _train(_cfg(corpus, f"feature_cache={tmp_path / 'fc'}"), tmp_path / "cached")
    for a, b in zip(live.history, cached.history):
        for key in ("loss", "al_estimate", "top1_mean"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, err_msg=key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(b), np.asarray(a),
                                                         rtol=1e-5, atol=1e-7),
                 jax.device_get(live.params), jax.device_get(cached.params))
    # one cache folder, finished, reused as is by the next run
    (sub,) = list((tmp_path / "fc").iterdir())
    assert json.loads((sub / "progress.json").read_text()) == {"done": 37, "complete": True}
    stamp = os.stat(sub / "taps.npy").st_mtime_ns
    _train(_cfg(corpus, f"feature_cache={tmp_path / 'fc'}", "num_steps=1"), tmp_path / "again")
    assert os.stat(sub / "taps.npy").st_mtime_ns == stamp


def test_cache_holds_the_target_taps(corpus, tmp_path):
    import dataclasses
    cache = _build(corpus, tmp_path)
    tcfg, tparams, _ = tiny_target()
    dcfg = dataclasses.replace(tiny_cfg("tiny_dflash").drafter_config(tcfg),
                               target_layer_ids=(1,))
    rec = _source(corpus)[5]["tokens"][:SEQ]
    tokens = np.pad(rec, (0, SEQ - len(rec)))[None]
    taps, _ = TR.target_features(tparams, tokens, drafter_config=dcfg, target_config=tcfg)
    # the cache ran batches of 8, this a batch of 1: other kernels, float32 rounding apart
    np.testing.assert_allclose(cache.taps(5), np.asarray(taps[0]), rtol=1e-5, atol=1e-5)
    assert len(cache) == 37 and cache.taps(0).shape == (SEQ, 1, tcfg.hidden_size)


def test_interrupted_build_resumes_to_the_same_cache(corpus, tmp_path, monkeypatch):
    want = _build(corpus, tmp_path / "fresh", window=8)
    real = corpus_io.Corpus.__getitem__
    calls = {"n": 0}

    def flaky(self, i):
        calls["n"] += 1
        if calls["n"] > 60:  # the digest reads 37; the build dies reading its third window
            raise KeyboardInterrupt
        return real(self, i)

    monkeypatch.setattr(corpus_io.Corpus, "__getitem__", flaky)
    with pytest.raises(KeyboardInterrupt):
        _build(corpus, tmp_path / "killed", window=8)
    monkeypatch.setattr(corpus_io.Corpus, "__getitem__", real)
    (sub,) = list((tmp_path / "killed").iterdir())
    state = json.loads((sub / "progress.json").read_text())
    assert state == {"done": 16, "complete": False}  # two whole windows kept
    with pytest.raises(ValueError, match="unfinished"):
        FC.FeatureCache(sub)
    got = _build(corpus, tmp_path / "killed", window=8)
    for i in range(37):
        np.testing.assert_array_equal(got.taps(i), want.taps(i))


def test_caches_are_keyed_by_what_they_hold(corpus, tmp_path):
    a = _build(corpus, tmp_path)
    tcfg, tparams, name = tiny_target()
    b = FC.build_feature_cache(_source(corpus), tcfg, tparams, (1,), SEQ + 8, tmp_path,
                               target_name=name, progress=False, log=lambda s: None)
    other = jax.tree.map(lambda x: x * 1.01, tparams)
    c = FC.build_feature_cache(_source(corpus), tcfg, other, (1,), SEQ, tmp_path,
                               target_name=name, progress=False, log=lambda s: None)
    assert len({a.folder, b.folder, c.folder}) == 3
    assert _build(corpus, tmp_path).folder == a.folder


def test_bfloat16_cache_is_the_rounded_float32_cache(corpus, tmp_path):
    f32 = _build(corpus, tmp_path)
    bf16 = _build(corpus, tmp_path, dtype="bfloat16")
    x, y = f32.taps(3), bf16.taps(3)
    assert y.dtype == np.float32 and os.path.getsize(bf16.folder / "taps.npy") < \
        0.6 * os.path.getsize(f32.folder / "taps.npy")
    np.testing.assert_allclose(y, x, rtol=2**-8, atol=1e-30)
    np.testing.assert_array_equal(y, np.asarray(jax.numpy.asarray(x, jax.numpy.bfloat16),
                                                np.float32))


def test_corrupt_cache_and_unusable_settings_are_refused(corpus, tmp_path):
    cache = _build(corpus, tmp_path)
    path = cache.folder / "taps.npy"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ValueError, match="corrupt"):
        FC.FeatureCache(cache.folder)
    with pytest.raises(ValueError, match="finite"):  # synthetic data are generated on the fly
        TR.Trainer(tiny_cfg("tiny_dflash", f"feature_cache={tmp_path / 's'}"),
                   str(tmp_path / "w1"), target=tiny_target(), progress=False)
    with pytest.raises(ValueError, match="log-probs"):
        TR.Trainer(_cfg(corpus, f"feature_cache={tmp_path / 'x'}", "logp_source=target"),
                   str(tmp_path / "w2"), target=tiny_target(), progress=False)
    with pytest.raises(ValueError, match="feature_cache_dtype"):
        _cfg(corpus, "feature_cache_dtype=float16")
    with pytest.raises(FileNotFoundError, match="single-process"):
        _build(corpus, tmp_path / "none", build=False)


@pytest.mark.parametrize("teacher_topk", [0, 4])
def test_a_grown_or_merged_source_reuses_every_cached_record(corpus, tmp_path, teacher_topk):
    """A grown corpus (the old records first, then new ones), or a merge that holds cached
    records anywhere, gets its own cache whose rows of cached records are copied: only the
    new records go through the target."""
    tcfg, tparams, name = tiny_target()
    records = [_source(corpus)[i] for i in range(37)]
    head = (tparams["embed"]["embedding"], "vh") if teacher_topk else None
    logs = []

    def build(recs, folder):
        return FC.build_feature_cache(recs, tcfg, tparams, (1,), SEQ, folder,
                                      target_name=name, progress=False, log=logs.append,
                                      teacher_topk=teacher_topk, head=head)

    want = build(records, tmp_path / "fresh")
    small = build(records[:20], tmp_path / "grown")
    read = {"n": 0}

    class Counted(list):
        def __getitem__(self, i):
            read["n"] += 1
            return list.__getitem__(self, i)

    logs.clear()
    grown = build(Counted(records), tmp_path / "grown")
    assert grown.folder != small.folder
    assert any("20 of its 37 records to go are in sibling caches" in s for s in logs), logs
    assert read["n"] == 37 + 17  # the digests read every record, the target pass 17
    for i in range(37):
        np.testing.assert_array_equal(grown.taps(i), want.taps(i))
        if teacher_topk:
            for a, b in zip(grown.teacher(i), want.teacher(i)):
                np.testing.assert_array_equal(a, b)
    # another order, and a merge of both halves with records never cached: every cached
    # record is copied wherever it sits, only the new ones go through the target
    logs.clear()
    read["n"] = 0
    shuffled = build(Counted(records[::-1]), tmp_path / "grown")
    assert any("37 of its 37 records to go are in sibling caches" in s for s in logs), logs
    assert read["n"] == 37  # the digests only
    for i in range(37):
        np.testing.assert_array_equal(shuffled.taps(i), want.taps(36 - i))
    # five records no cache holds: the first five with their tokens in another order
    more = [dict(r, tokens=np.asarray(r["tokens"])[::-1].copy()) for r in records[:5]]
    fresh_more = build(more, tmp_path / "fresh_more")
    logs.clear()
    read["n"] = 0
    mixed = build(Counted(more[:2] + records[30:] + more[2:]), tmp_path / "grown")
    assert any("7 of its 12 records to go are in sibling caches" in s for s in logs), logs
    assert read["n"] == 12 + 5
    for i, (cache, j) in enumerate([(fresh_more, 0), (fresh_more, 1)]
                                   + [(want, k) for k in range(30, 37)]
                                   + [(fresh_more, 2), (fresh_more, 3), (fresh_more, 4)]):
        np.testing.assert_allclose(mixed.taps(i), cache.taps(j), rtol=1e-5, atol=1e-5)
        if teacher_topk:
            for a, b in zip(mixed.teacher(i), cache.teacher(j)):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _unscored(tmp_path):
    from conftest import make_corpus
    return make_corpus(tmp_path / "unscored", temps=())


def test_cache_scores_the_tokens_of_an_unscored_corpus(tmp_path):
    """logp.npy holds log softmax(logits / T_v) at each record's own next token, from the
    same pass as the taps; 0 on prompt tokens (the corpus convention)."""
    import jax.numpy as jnp
    from dblast_jax.models import target as target_lm
    from dblast_jax.train.objective import target_head
    tcfg, tparams, name = tiny_target()
    src = corpus_io.Corpus(_unscored(tmp_path), verify_temperature=1.5)
    assert "logp" not in src[0]
    cache = FC.build_feature_cache(src, tcfg, tparams, (1,), SEQ, tmp_path / "fc",
                                   target_name=name, progress=False, log=lambda s: None,
                                   head=target_head(tparams, tcfg), data_logp_temperature=1.5)
    assert cache.logp_temperature == 1.5
    fwd = jax.jit(lambda p, t: target_lm.forward(p, t, config=tcfg)[0])
    for i in (0, 5, 36):
        rec = src[i]
        toks = np.asarray(rec["tokens"][:SEQ])
        n = len(toks)
        logits = np.asarray(fwd(tparams, jnp.asarray(np.pad(toks, (0, SEQ - n))[None])))[0]
        logp = np.asarray(jax.nn.log_softmax(logits[:n - 1] / 1.5, axis=-1))
        want = np.concatenate([[0.0], logp[np.arange(n - 1), toks[1:]]])
        want = np.where(rec["loss_mask"][:n], want, 0.0)
        np.testing.assert_allclose(cache.data_logp(i)[:n], want, rtol=1e-5, atol=1e-5)
        assert not cache.data_logp(i)[n:].any()
        cached = FC.CachedFeatureSource(src, cache)[i]
        assert cached["logp"].shape == rec["tokens"].shape
    # a cache without log-probs is another cache (another key), and serves none
    plain = FC.build_feature_cache(src, tcfg, tparams, (1,), SEQ, tmp_path / "fc",
                                   target_name=name, progress=False, log=lambda s: None)
    assert plain.folder != cache.folder and plain.data_logp(0) is None
    with pytest.raises(ValueError, match="window must be >= 1 record"):
        FC.build_feature_cache(src, tcfg, tparams, (1,), SEQ, tmp_path / "x",
                               target_name=name, progress=False, window=0)
    with pytest.raises(ValueError, match="needs the target's head"):
        FC.build_feature_cache(src, tcfg, tparams, (1,), SEQ, tmp_path / "x",
                               target_name=name, progress=False, data_logp_temperature=1.0)
    (cache.folder / "logp.npy").write_bytes(b"not an array")
    with pytest.raises(ValueError, match="logp.npy is unreadable"):
        FC.FeatureCache(cache.folder)


def test_training_on_an_unscored_corpus_equals_training_on_its_scored_copy(tmp_path):
    """With a feature cache, an unscored corpus trains like the same records stored with
    the log-probs the cache computed: the AL terms read the same numbers."""
    unscored = _unscored(tmp_path)
    got = _train(_cfg(unscored, f"feature_cache={tmp_path / 'fc'}"), tmp_path / "u")
    assert all(np.isfinite(h["al_estimate"]) for h in got.history)
    (sub,) = list((tmp_path / "fc").iterdir())
    cache = FC.FeatureCache(sub)
    assert cache.logp_temperature == 1.0
    scored = tmp_path / "scored"
    scored.mkdir()
    manifest = corpus_io.read_manifest(unscored)
    i = 0
    for entry in manifest["shards"]:
        a = corpus_io.read_shard(unscored / entry["file"])
        rows = []
        for s in range(len(a["prompt_lengths"])):
            length = int(a["offsets"][s + 1] - a["offsets"][s])
            row = np.zeros(length, np.float32)
            m = min(length, SEQ)
            row[:m] = cache.data_logp(i)[:m]
            rows.append(row)
            i += 1
        a["logp_1"] = np.concatenate(rows)
        a["entropy_1"] = np.zeros_like(a["logp_1"])
        entry["sha256"] = corpus_io.write_shard(scored / entry["file"], a)
    manifest["settings"]["verify_temperatures"] = [1.0]
    corpus_io.write_manifest(scored, manifest)
    want = _train(_cfg(scored, f"feature_cache={tmp_path / 'fc2'}"), tmp_path / "s")
    assert len(want.history) == len(got.history) > 0
    for a, b in zip(want.history, got.history):
        for key in ("loss", "al_estimate", "top1_mean"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, err_msg=key)
    with pytest.raises(ValueError, match="stores no logp \\(an unscored corpus\\)"):
        _train(_cfg(unscored, "logp_source=data", f"feature_cache={tmp_path / 'fc'}"),
               tmp_path / "d")
    with pytest.raises(ValueError, match="logp_source='target' has no target pass"):
        _train(_cfg(unscored, "logp_source=target", f"feature_cache={tmp_path / 'fc'}"),
               tmp_path / "t")


def test_records_run_at_their_own_width_give_the_full_width_rows(corpus, tmp_path,
                                                                    monkeypatch):
    """The build sorts a window by length and runs each batch only as wide as its longest
    record: every record's rows equal one full-width pass, and rows past its end hold the
    fill values (never read)."""
    import dataclasses
    from dblast_jax.train.objective import target_head
    monkeypatch.setattr(FC, "WIDTH_MULTIPLE", 8)  # widths 8, 16, 24 on this corpus
    tcfg, tparams, name = tiny_target()
    head = target_head(tparams, tcfg)
    kw = dict(target_name=name, progress=False, log=lambda s: None, teacher_topk=4,
              head=head, data_logp_temperature=1.0)
    src = _source(corpus)
    got = FC.build_feature_cache(src, tcfg, tparams, (1,), SEQ, tmp_path / "a", window=16,
                                 **kw)
    monkeypatch.setattr(FC, "WIDTH_MULTIPLE", SEQ)  # every batch at the full width
    full = FC.build_feature_cache(src, tcfg, tparams, (1,), SEQ, tmp_path / "b", window=1,
                                  **kw)
    widths = {min(len(src[i]["tokens"]), SEQ) for i in range(len(src))}
    assert min(widths) <= 8 and max(widths) == SEQ  # several widths were run
    for i in range(len(src)):
        n = min(len(src[i]["tokens"]), SEQ)
        np.testing.assert_allclose(got.taps(i)[:n], full.taps(i)[:n], rtol=1e-5, atol=1e-5)
        ids, logp = got.teacher(i)
        want_ids, want_logp = full.teacher(i)
        np.testing.assert_array_equal(ids[:n], want_ids[:n])
        np.testing.assert_allclose(logp[:n], want_logp[:n], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got.data_logp(i), full.data_logp(i), rtol=1e-5, atol=1e-5)
    # batches of short records ran narrower than SEQ: their last rows hold the fill values
    narrow = [i for i in range(len(src)) if not got.taps(i)[-1].any()]
    assert narrow
    for i in narrow:
        assert not got.teacher(i)[0][-1].any() and got.data_logp(i)[-1] == 0
        assert (got.teacher(i)[1][-1] == FC.distill.EMPTY_LOGP).all()
    assert all(full.taps(i)[-1].any() for i in range(len(src)))  # full width: computed
