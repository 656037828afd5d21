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


# ---- the trainer's pipeline: the documented order, process rows, state ----------------------

def _reference_batches(records, *, batch_size, seq_len, block_size, seed, rows, count):
    """The documented order (data/pipeline.py) rebuilt with plain numpy: usable records,
    permutation default_rng([seed, epoch, 7]) per epoch, global batch k = positions
    k*B .. k*B + B - 1, rows [r0, r1) of it, right-padded with 0 / False / 0.0."""
    usable = np.array([i for i, r in enumerate(records)
                       if min(len(r["tokens"]), seq_len) >= block_size
                       and any(r["loss_mask"][:min(len(r["tokens"]), seq_len) - block_size + 1])])
    n, out = usable.size, []
    for k in range(count):
        rows_ = []
        for g in range(k * batch_size + rows[0], k * batch_size + rows[1]):
            perm = np.random.default_rng([seed, g // n, 7]).permutation(n)
            rows_.append(records[usable[perm[g % n]]])
        tokens = np.zeros((len(rows_), seq_len), np.int32)
        mask = np.zeros((len(rows_), seq_len), bool)
        logp = np.zeros((len(rows_), seq_len), np.float32)
        for i, r in enumerate(rows_):
            m = min(len(r["tokens"]), seq_len)
            tokens[i, :m], mask[i, :m], logp[i, :m] = (r["tokens"][:m], r["loss_mask"][:m],
                                                       r["logp"][:m])
        out.append({"tokens": tokens, "loss_mask": mask, "logp": logp,
                    "lengths": np.array([min(len(r["tokens"]), seq_len) for r in rows_],
                                        np.int32)})
    return out


def _random_records(seed=7, n=19):
    gen = np.random.default_rng(seed)
    recs = []
    for _ in range(n):
        length, prompt = int(gen.integers(2, 15)), int(gen.integers(0, 6))
        recs.append({"tokens": gen.integers(1, 60, length).astype(np.int32),
                     "loss_mask": np.arange(length) >= prompt,
                     "logp": -gen.random(length).astype(np.float32)})
    return recs


def test_train_pipeline_is_the_documented_order():
    from dblast_jax.data.records import ListSource
    recs = _random_records()
    src = ListSource(recs)
    kw = dict(batch_size=4, seq_len=10, block_size=4, seed=11)
    n = src.usable_indices(10, 4).size
    assert 4 < n < len(recs)  # some records are unusable
    count = 3 * n // 4 + 2  # three epochs and more
    for rows in [(0, 4), (0, 2), (2, 4), (1, 3)]:
        want = _reference_batches(recs, rows=rows, count=count, **kw)
        ds = pipeline.make_train_dataset(src, rows=rows, **kw)
        it = pipeline.BatchIterator(src, rows=rows, **kw)
        for k, w in enumerate(want):
            for got in (ds[k], next(it)):
                assert set(got) == set(w)
                for key in w:
                    np.testing.assert_array_equal(got[key], w[key], err_msg=f"{rows} {k} {key}")
                    assert got[key].dtype == w[key].dtype


def test_synthetic_source_is_read_in_index_order():
    from dblast_jax.data.records import SyntheticMultiModal
    src = SyntheticMultiModal(97, block_size=4, seq_len=32, seed=2)
    it = pipeline.BatchIterator(src, batch_size=3, seq_len=32, block_size=4, seed=5,
                                rows=(1, 3))
    for k in range(3):
        b = next(it)
        for row, i in enumerate((3 * k + 1, 3 * k + 2)):
            n = len(src[i]["tokens"])
            np.testing.assert_array_equal(b["tokens"][row, :n], src[i]["tokens"])


def test_two_processes_read_disjoint_rows_that_make_the_global_batch(folder):
    src = corpus_io.Corpus(folder, verify_temperature=1.0)
    kw = dict(batch_size=6, seq_len=16, block_size=4, seed=3)
    full = pipeline.BatchIterator(src, **kw)
    parts = [pipeline.BatchIterator(src, rows=r, **kw) for r in ((0, 3), (3, 6))]
    n = full.num_usable
    seen = []
    for k in range(2 * n // 6 + 1):  # past two epochs
        g, mine = next(full), [next(p) for p in parts]
        for key in g:
            np.testing.assert_array_equal(g[key], np.concatenate([m[key] for m in mine]))
        ids = [[int(x) for x in m["tokens"][:, 0]] for m in mine]  # record r starts with r
        assert not set(ids[0]) & set(ids[1])
        seen += ids[0] + ids[1]
    assert sorted(seen[:n]) == sorted(int(i) for i in src.usable_indices(16, 4))  # epoch 0
    assert seen[:n] != seen[n:2 * n]  # epoch 1: a new order


def test_state_restores_mid_epoch_and_reads_old_checkpoints(folder):
    import json
    src = corpus_io.Corpus(folder, verify_temperature=0.7)
    kw = dict(batch_size=4, seq_len=16, block_size=4, seed=9, rows=(2, 4))
    it = pipeline.BatchIterator(src, **kw)
    for _ in range(5):  # mid-epoch (fewer than 37 / 4 batches per epoch)
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # as the checkpoint stores it
    assert state == {"kind": "batcher", "global": True, "batches": 5, "seed": 9,
                     "num_usable": it.num_usable}
    want = [next(it) for _ in range(12)]  # crosses into the next epochs
    for restore in (state, {"next_index": 5}):  # the trainer's format, grain's own
        again = pipeline.BatchIterator(src, **kw)
        again.set_state(restore)
        for w in want:
            got = next(again)
            for key in w:
                np.testing.assert_array_equal(got[key], w[key])
    with pytest.raises(ValueError, match="not the same data"):
        again.set_state(dict(state, num_usable=state["num_usable"] + 1))


def test_data_code_does_not_depend_on_the_trainer():
    from pathlib import Path
    import dblast_jax.data as data_pkg
    for path in Path(data_pkg.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert "dblast_jax.train" not in text and "from dblast_jax import train" not in text, path
