"""grain pipeline over corpus shards: determinism, resumable state, disjoint sharding."""

import numpy as np
import pytest

from dblast_jax.data import corpus as corpus_io
from dblast_jax.data import pipeline
from conftest import make_corpus as _make_corpus  # tests/ is on sys.path (pytest "prepend")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return _make_corpus(tmp_path_factory.mktemp("corpus"))


def _first_tokens(batches):
    return [int(x) for b in batches for x in b["tokens"][:, 0]]


def test_source_reads_records_across_shards(folder):
    src = pipeline.CorpusDataSource(folder, verify_temperature=0.7)
    assert len(src) == 37
    for i in (0, 12, 13, 26, 36):
        rec = src[i]
        assert rec["tokens"][0] == i
        np.testing.assert_allclose(rec["logp"], -rec["tokens"] / 0.7, rtol=1e-6)
    with pytest.raises(IndexError):
        src[37]
    with pytest.raises(ValueError, match=r"temperatures \['0.7', '1'\], not at 1.5"):
        pipeline.CorpusDataSource(folder, verify_temperature=1.5)


def test_batches_are_padded_with_masks(folder):
    ds = pipeline.make_dataset(folder, seq_len=16, batch_size=4, seed=0, verify_temperature=1.0)
    src = pipeline.CorpusDataSource(folder, verify_temperature=1.0)
    b = ds[0]
    assert b["tokens"].shape == (4, 16) and b["tokens"].dtype == np.int32
    assert b["loss_mask"].dtype == bool and b["logp"].shape == (4, 16)
    for row in range(4):
        rec = src[int(b["tokens"][row, 0])]
        n = min(len(rec["tokens"]), 16)
        assert b["lengths"][row] == n
        np.testing.assert_array_equal(b["tokens"][row, :n], rec["tokens"][:n])
        np.testing.assert_array_equal(b["loss_mask"][row, :n], rec["loss_mask"][:n])
        assert not b["loss_mask"][row, n:].any() and (b["tokens"][row, n:] == 0).all()
        assert (b["logp"][row, n:] == 0).all()
    assert len(ds) == 37 // 4  # drop_remainder


def test_deterministic_for_a_seed_and_reshuffled_per_epoch(folder):
    make = lambda seed: pipeline.make_dataset(folder, seq_len=8, batch_size=1, seed=seed,
                                              num_epochs=2)
    a, b, c = _first_tokens(make(1)), _first_tokens(make(1)), _first_tokens(make(2))
    assert a == b and a != c
    assert sorted(a[:37]) == list(range(37)) and sorted(a[37:]) == list(range(37))
    assert a[:37] != a[37:]  # a new order in the second epoch


def test_iterator_resumes_at_the_same_element(folder):
    ds = pipeline.make_dataset(folder, seq_len=8, batch_size=3, seed=5, num_epochs=None)
    it = pipeline.make_iterator(ds)
    for _ in range(7):
        next(it)
    state = it.get_state()
    expected = [next(it)["tokens"] for _ in range(5)]
    resumed = pipeline.make_iterator(
        pipeline.make_dataset(folder, seq_len=8, batch_size=3, seed=5, num_epochs=None), state)
    for want in expected:
        np.testing.assert_array_equal(next(resumed)["tokens"], want)


def test_process_shards_are_disjoint_and_cover_the_epoch(folder):
    parts = [_first_tokens(pipeline.make_dataset(folder, seq_len=8, batch_size=1, seed=3,
                                                 shard_index=i, shard_count=3))
             for i in range(3)]
    flat = [x for p in parts for x in p]
    assert len(flat) == len(set(flat)) == 37
    assert [len(p) for p in parts] == [13, 12, 12]
    with pytest.raises(ValueError, match="shard_index must lie in"):
        pipeline.make_dataset(folder, seq_len=8, batch_size=1, shard_index=3, shard_count=3)


def test_block_size_filters_unusable_records(folder):
    src = pipeline.CorpusDataSource(folder)
    ds = pipeline.make_dataset(folder, seq_len=10, batch_size=1, block_size=4, shuffle=False)
    kept = set(_first_tokens(ds))
    for i in range(len(src)):
        rec = src[i]
        n = min(len(rec["tokens"]), 10)
        usable = bool(rec["loss_mask"][:max(n - 4 + 1, 0)].any())
        assert (i in kept) == usable, i
    assert 0 < len(kept) < 37


def test_corpus_is_a_source_for_the_trainers_batcher(folder):
    from dblast_jax.train.batches import Batcher
    src = corpus_io.Corpus(folder, verify_temperature=0.7)
    batcher = Batcher(src, batch_size=4, seq_len=16, block_size=4, seed=0)
    b = next(iter(batcher))
    assert b["tokens"].shape == (4, 16) and b["logp"].shape == (4, 16)
    rec = src[int(b["tokens"][0, 0])]
    np.testing.assert_allclose(b["logp"][0, :b["lengths"][0]],
                               rec["logp"][:b["lengths"][0]], rtol=1e-6)


def test_corpus_snapshot_of_the_first_shards(folder):
    """data_shards pins an experiment to a prefix of a corpus that keeps growing."""
    from dblast_jax.train.batches import make_source
    full = corpus_io.Corpus(folder)
    first = corpus_io.Corpus(folder, max_shards=2)
    assert len(first) == sum(s["sequences"] for s in full.shards[:2]) < len(full)
    assert int(first[len(first) - 1]["tokens"][0]) == len(first) - 1
    src = make_source(str(folder), vocab_size=100, block_size=4, seq_len=16,
                      verify_temperature=1.0, corpus_shards=2)
    assert len(src) == len(first)
    with pytest.raises(ValueError, match="first 9 shards"):
        corpus_io.Corpus(folder, max_shards=9)
