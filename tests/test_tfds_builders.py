"""TFDS (array_record, no TensorFlow) copies of corpora and prompt sets: exact round
trips, grain pipelines, idempotent builds, corpus identity, clear errors."""

import importlib.util
import pickle
import shutil
import sys

import grain
import numpy as np
import pytest
import tensorflow_datasets as tfds

from dblast_jax.data import corpus as corpus_io
from dblast_jax.data import pipeline, sources
from dblast_jax.data import tfds_builders as tb
from conftest import make_corpus as _make_corpus  # tests/ is on sys.path (pytest "prepend" mode)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(corpus folder, data_dir, prepared dataset dir) shared by the read-only tests."""
    folder = _make_corpus(tmp_path_factory.mktemp("corpus"))
    data_dir = tmp_path_factory.mktemp("tfds")
    return folder, data_dir, tb.build_corpus_dataset(folder, data_dir)


def _assert_same_record(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key in ("tokens", "loss_mask"):
        assert got[key].dtype == want[key].dtype
        np.testing.assert_array_equal(got[key], want[key])
    for key in ("logp", "entropy"):
        if isinstance(want[key], dict):
            assert set(got[key]) == set(want[key])
            for t in want[key]:
                assert got[key][t].dtype == np.float32
                np.testing.assert_array_equal(got[key][t], want[key][t])
        else:
            np.testing.assert_array_equal(got[key], want[key])
    for key in ("id", "prompt_length", "gen_temperature", "stopped"):
        assert got[key] == want[key] and type(got[key]) is type(want[key])


def test_no_tensorflow_needed(built):
    assert importlib.util.find_spec("tensorflow") is None
    assert "tensorflow" not in sys.modules


def test_corpus_records_round_trip_exactly(built):
    folder, data_dir, ds_dir = built
    assert ds_dir == tb.corpus_dataset_dir(folder, data_dir)
    assert ds_dir.parent.name == "corpus-" + tb.corpus_fingerprint(folder)[:16]
    want = corpus_io.Corpus(folder)
    src = tb.corpus_data_source(folder, data_dir)
    assert len(src) == len(want) == 37 and src.temperatures == ["0.7", "1"]
    for i in range(len(want)):
        _assert_same_record(src[i], want[i])
    with pytest.raises(IndexError):
        src[37]
    # one temperature selected, as Corpus(verify_temperature=...) does
    one = tb.corpus_data_source(folder, data_dir, verify_temperature=0.7)
    _assert_same_record(one[12], corpus_io.Corpus(folder, verify_temperature=0.7)[12])
    with pytest.raises(ValueError, match="not at 1.5"):
        tb.corpus_data_source(folder, data_dir, verify_temperature=1.5)


def test_plain_tfds_data_source_and_grain(built):
    folder, data_dir, ds_dir = built
    raw = tfds.data_source(f"{tb.CORPUS_DATASET}/{ds_dir.parent.name}", split="train",
                           data_dir=str(data_dir))
    assert len(raw) == 37 and raw[13]["id"] == b"syn/13"
    np.testing.assert_array_equal(raw[13]["logp_1"], corpus_io.Corpus(folder)[13]["logp"]["1"])
    src = pickle.loads(pickle.dumps(tb.corpus_data_source(folder, data_dir)))  # worker copy
    firsts = list(grain.MapDataset.source(src).map(lambda r: int(r["tokens"][0])))
    assert firsts == list(range(37))  # corpus order kept (record r starts with token r)


def test_tfds_pipeline_matches_corpus_pipeline(built):
    folder, data_dir, _ = built
    kw = dict(seq_len=16, batch_size=4, seed=3, block_size=2, num_epochs=2)
    src = tb.corpus_data_source(folder, data_dir, verify_temperature=1.0)
    got = pipeline.make_dataset(src, **kw)
    want = pipeline.make_dataset(folder, verify_temperature=1.0, **kw)
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        assert set(a) == set(b) == {"tokens", "loss_mask", "lengths", "logp"}
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_build_is_idempotent(built, monkeypatch):
    folder, data_dir, ds_dir = built
    files = {p: p.stat().st_mtime_ns for p in ds_dir.iterdir()}

    def boom(self):
        raise AssertionError("rebuilt an existing dataset")

    monkeypatch.setattr(tb.CorpusBuilder, "_generate_examples", boom)
    assert tb.build_corpus_dataset(folder, data_dir) == ds_dir
    assert tb.corpus_data_source(folder, data_dir, build=True).dataset_dir == ds_dir
    assert {p: p.stat().st_mtime_ns for p in ds_dir.iterdir()} == files


def _rewrite_shard0(folder, update_manifest: bool = True) -> None:
    arrays = corpus_io.read_shard(folder / corpus_io.shard_name(0))
    arrays["logp_1"] = arrays["logp_1"] - 1.0
    digest = corpus_io.write_shard(folder / corpus_io.shard_name(0), arrays)
    if update_manifest:
        manifest = corpus_io.read_manifest(folder)
        manifest["shards"][0]["sha256"] = digest
        corpus_io.write_manifest(folder, manifest)


def test_changed_corpus_gets_new_config_and_old_build_is_refused(built, tmp_path):
    base, _, _ = built
    folder = tmp_path / "corpus"
    shutil.copytree(base, folder)
    data_dir = tmp_path / "tfds"
    old_dir = tb.build_corpus_dataset(folder, data_dir)
    old_logp = tb.TfdsCorpusSource(old_dir)[0]["logp"]["1"]

    _rewrite_shard0(folder)
    with pytest.raises(FileNotFoundError, match="as it is now.*corpus-"):
        tb.corpus_data_source(folder, data_dir)  # the stale build is not served
    new_dir = tb.build_corpus_dataset(folder, data_dir)
    assert new_dir != old_dir and new_dir.parent.parent == old_dir.parent.parent
    new = tb.corpus_data_source(folder, data_dir)
    np.testing.assert_array_equal(new[0]["logp"]["1"], old_logp - 1.0)
    _assert_same_record(new[0], corpus_io.Corpus(folder)[0])

    _rewrite_shard0(folder, update_manifest=False)  # file no longer matches its manifest
    shutil.rmtree(data_dir)
    with pytest.raises(ValueError, match="does not match the manifest"):
        tb.build_corpus_dataset(folder, data_dir)


def test_missing_corpus_or_dataset_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no corpus at .*missing manifest.json"):
        tb.build_corpus_dataset(tmp_path / "nope", tmp_path / "tfds")
    with pytest.raises(FileNotFoundError, match="no corpus at"):
        tb.corpus_data_source(tmp_path / "nope", tmp_path / "tfds")
    with pytest.raises(FileNotFoundError, match="no prepared TFDS dataset"):
        tb.TfdsCorpusSource(tmp_path / "tfds" / "x")


_FAKE = [sources.Prompt("q1", "fake-set", ("Write a haiku.",), (("category", "writing"),)),
         sources.Prompt("q2", "fake-set", ("Déjà vu? ✓", "And a second turn.")),
         sources.Prompt("q3", "fake-set", ("3 + 4 = ?",), (("answer", "7"), ("k", "")))]


def test_prompt_dataset_round_trip(tmp_path, monkeypatch):
    prompts = list(_FAKE)
    monkeypatch.setattr(sources, "load_prompts", lambda name: list(prompts))
    ds_dir = tb.build_prompt_dataset("fake-set", tmp_path)
    assert ds_dir.parent.name.startswith("fake-set-")
    assert tb.read_prompt_dataset(ds_dir) == _FAKE
    raw = tfds.data_source(f"{tb.PROMPTS_DATASET}/{ds_dir.parent.name}", split="train",
                           data_dir=str(tmp_path))
    assert [list(r["turns"]) for r in raw] == [[t.encode() for t in p.turns] for p in _FAKE]

    stamp = (ds_dir / "dataset_info.json").stat().st_mtime_ns
    assert tb.build_prompt_dataset("fake-set", tmp_path) == ds_dir  # reused, not rebuilt
    assert (ds_dir / "dataset_info.json").stat().st_mtime_ns == stamp

    prompts[0] = sources.Prompt("q1", "fake-set", ("Write two haiku.",))
    changed = tb.build_prompt_dataset("fake-set", tmp_path)
    assert changed != ds_dir and tb.read_prompt_dataset(changed)[0] == prompts[0]


def test_trainer_reads_the_tfds_dataset_like_the_corpus_folder(built, capsys):
    """`dblast data tfds` output is a `--data` the trainer accepts: same batches."""
    from dblast_jax import cli
    from dblast_jax.train.batches import Batcher, make_source
    folder, data_dir, ds_dir = built
    assert cli.main(["data", "tfds", "--corpus", str(folder), "--data-dir", str(data_dir)]) == 0
    assert str(ds_dir) in capsys.readouterr().out
    kw = dict(vocab_size=100, block_size=4, seq_len=16, verify_temperature=1.0)
    tf_src, folder_src = make_source(str(ds_dir), **kw), make_source(str(folder), **kw)
    assert isinstance(tf_src, tb.TfdsCorpusSource)
    a = next(iter(Batcher(tf_src, batch_size=4, seq_len=16, block_size=4, seed=1)))
    b = next(iter(Batcher(folder_src, batch_size=4, seq_len=16, block_size=4, seed=1)))
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    with pytest.raises(ValueError, match="data_shards"):
        make_source(str(ds_dir), corpus_shards=2, **kw)
    assert cli.main(["data", "tfds", "--data-dir", str(data_dir)]) == 2
