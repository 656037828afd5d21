"""The grain input pipeline: from a random-access source to this process's batches.

The trainer, held-out validation and `make_dataset` read data through one chain of
`grain.MapDataset` stages:

    source      records.ListSource (.jsonl / records), records.SyntheticMultiModal,
                corpus.Corpus (a regenerated corpus folder) or
                tfds_builders.TfdsCorpusSource (its TFDS array_record copy)
      -> EpochOrder     global position g -> record index (seeded, new order each epoch)
      -> ProcessRows    this process's rows of every global batch
                        (make_dataset: the strided share [shard_index::shard_count])
      -> map(source[i]) the record
      -> batch(batch_fn=records.collate)   right-pad / truncate to seq_len

The order. usable = source.usable_indices(seq_len, block_size) (records with a response
token followed by a whole block within seq_len), n = its size. Position g lies in epoch
e = g // n at slot s = g % n and holds record usable[perm_e[s]] with
perm_e = np.random.default_rng([seed, e, 7]).permutation(n) (shuffle=False:
usable[s]). A source whose usable_indices is None (every record usable and already
i.i.d.: SyntheticMultiModal) is read in index order, record g % len(source).

Batches and processes. Global batch k holds positions k*B .. k*B + B - 1. A process that
holds rows [r0, r1) of the batch-sharded array (`sharding.process_row_range`) reads
positions k*B + r0 .. k*B + r1 - 1 only; so every process count yields the same global
batches, and the processes' rows are disjoint and together the whole batch.

Every stage is a MapDataset, so batch k is a pure function of (seed, k) (`dataset[k]`)
and an iterator's whole state is one index. `BatchIterator` is the trainer's
checkpointable iterator over it; its state is the one the trainer has always stored,
{"kind": "batcher", "global": True, "batches": k, "seed": ..., "num_usable": n}
(checkpoints written before this pipeline drew the same order, and resume unchanged);
grain's own {"next_index": k} is accepted too.

`IteratorBatcher` batches a plain iterator of records (no random access, so not a
MapDataset): the trainer's path for `data=` given as an iterator factory.
Anchors are sampled later, on device (`train.objective.sample_anchors`).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import grain
import numpy as np

from dblast_jax.data.corpus import Corpus
from dblast_jax.data.records import (Record, as_record, collate, first_has_logp,
                                     record_is_usable)

__all__ = ["CorpusDataSource", "EpochOrder", "ProcessRows", "BatchIterator",
           "IteratorBatcher", "SYNC_READ", "pad_record", "train_order", "batch_dataset",
           "make_train_dataset", "make_dataset", "make_iterator"]

# Batches are read in the calling thread, one at a time, like the trainer always did (no
# look-ahead threads competing with the step for host cores; a batch with cached taps
# is large). Pass other grain.ReadOptions to prefetch.
SYNC_READ = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


class CorpusDataSource(Corpus):
    """A grain random-access source: record i of the corpus as numpy arrays only.

    Each record: tokens [L] int32, loss_mask [L] bool, and logp [L] float32 (at
    `verify_temperature`) when one is given.
    """

    def __getitem__(self, i: int) -> dict[str, Any]:
        r = super().__getitem__(int(i))
        out = {"tokens": r["tokens"], "loss_mask": r["loss_mask"]}
        if self.verify_key is not None:
            out["logp"] = r["logp"]
        return out

    def __repr__(self) -> str:
        return f"CorpusDataSource({str(self.folder)!r}, {len(self)} records)"


def pad_record(rec: dict[str, Any], seq_len: int) -> dict[str, np.ndarray]:
    """Truncate / right-pad one record to seq_len (token 0, mask False, logp 0): one row
    of `records.collate`."""
    batch = collate([rec], seq_len, "logp" in rec)
    out = {k: v[0] for k, v in batch.items()}
    out["lengths"] = np.int32(out["lengths"])
    return out


# ---- stages -------------------------------------------------------------------------------

class EpochOrder(grain.MapDataset):
    """Global position g -> record index, in the order of the module doc.

    usable: the usable record indices (None: all `size` records, in index order).
    num_epochs None: endless (len sys.maxsize); else num_epochs * n positions (an index
    past them wraps around, as in other grain MapDatasets)."""

    def __init__(self, usable: Optional[Sequence[int]], size: int, *, seed: int = 0,
                 shuffle: bool = True, num_epochs: Optional[int] = None):
        super().__init__()
        self.usable = None if usable is None else np.asarray(usable)
        self.num_records = int(size) if self.usable is None else int(self.usable.size)
        if self.num_records < 1:
            raise ValueError("no usable records")
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None, got {num_epochs}")
        self.seed, self.shuffle, self.num_epochs = int(seed), bool(shuffle), num_epochs
        self._cached: tuple[int, Optional[np.ndarray]] = (-1, None)

    def __len__(self) -> int:
        if self.num_epochs is None:
            return sys.maxsize
        return self.num_records * self.num_epochs

    def epoch_records(self, epoch: int) -> np.ndarray:
        """The record indices of one epoch, in order."""
        if self.usable is None:
            return np.arange(self.num_records)
        if not self.shuffle:
            return self.usable
        cached_epoch, perm = self._cached  # one tuple: safe under reader threads
        if cached_epoch != epoch:
            gen = np.random.default_rng([self.seed, int(epoch), 7])
            perm = self.usable[gen.permutation(self.usable.size)]
            self._cached = (int(epoch), perm)
        return perm

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        g = int(index)
        if self.num_epochs is not None:
            g %= len(self)
        n = self.num_records
        if self.usable is None:
            return g % n
        if not self.shuffle:
            return int(self.usable[g % n])
        return int(self.epoch_records(g // n)[g % n])

    def __str__(self) -> str:
        return (f"EpochOrder(records={self.num_records}, seed={self.seed}, "
                f"shuffle={self.shuffle}, num_epochs={self.num_epochs})")


class ProcessRows(grain.MapDataset):
    """Rows [r0, r1) of every global batch of `batch_size` consecutive parent elements:
    element j -> parent element (j // L) * batch_size + r0 + j % L, L = r1 - r0."""

    def __init__(self, parent: grain.MapDataset, batch_size: int, rows: tuple[int, int]):
        super().__init__(parent)
        r0, r1 = (int(r) for r in rows)
        if not 0 <= r0 < r1 <= batch_size:
            raise ValueError(f"rows {(r0, r1)} do not lie in a batch of {batch_size}")
        self.batch_size, self.rows = int(batch_size), (r0, r1)

    def __len__(self) -> int:
        return len(self._parent) // self.batch_size * (self.rows[1] - self.rows[0])

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        k, r = divmod(int(index), self.rows[1] - self.rows[0])
        return self._parent[k * self.batch_size + self.rows[0] + r]

    def __str__(self) -> str:
        return f"ProcessRows(batch_size={self.batch_size}, rows={self.rows})"


def _collate(records: Sequence[Record], seq_len: int, with_logp: Optional[bool]):
    return collate(records, seq_len, with_logp)


def train_order(source: Any, *, seq_len: int, block_size: int, seed: int = 0,
                shuffle: bool = True, num_epochs: Optional[int] = None) -> EpochOrder:
    """The global record order of training on `source` (its usable records)."""
    usable = source.usable_indices(seq_len, block_size)
    return EpochOrder(usable, len(source), seed=seed, shuffle=shuffle, num_epochs=num_epochs)


def batch_dataset(order: grain.MapDataset, source: Any, *, batch_size: int, seq_len: int,
                  rows: Optional[tuple[int, int]] = None,
                  with_logp: Optional[bool] = None) -> grain.MapDataset:
    """Element k: rows [r0, r1) (default: all) of global batch k of `order`, read from
    `source` and collated to seq_len; with_logp None: whether the first usable record
    has logp."""
    rows = (0, batch_size) if rows is None else tuple(rows)
    if with_logp is None:
        with_logp = first_has_logp(source, getattr(order, "usable", None))
    ds = ProcessRows(order, batch_size, rows).map(source.__getitem__)
    return ds.batch(rows[1] - rows[0], drop_remainder=True,
                    batch_fn=functools.partial(_collate, seq_len=seq_len,
                                               with_logp=bool(with_logp)))


def make_train_dataset(source: Any, *, batch_size: int, seq_len: int, block_size: int,
                       seed: int = 0, shuffle: bool = True,
                       rows: Optional[tuple[int, int]] = None,
                       with_logp: Optional[bool] = None) -> grain.MapDataset:
    """The trainer's endless MapDataset of this process's batches (module doc)."""
    order = train_order(source, seq_len=seq_len, block_size=block_size, seed=seed,
                        shuffle=shuffle)
    return batch_dataset(order, source, batch_size=batch_size, seq_len=seq_len, rows=rows,
                         with_logp=with_logp)


# ---- the trainer's iterator ---------------------------------------------------------------

class BatchIterator:
    """Checkpointable iterator over `make_train_dataset(source, ...)`: this process's rows
    [rows[0], rows[1]) of global batches 0, 1, 2, ... (endless).

    `dataset` is the grain MapDataset (batch k = dataset[k]); iteration goes through
    grain's DatasetIterator (`read_options`: default SYNC_READ). get_state() ->
    {"kind": "batcher", "global": True, "batches": k, "seed", "num_usable"}; set_state
    takes that (refusing another corpus size) or grain's {"next_index": k}."""

    def __init__(self, source: Any, *, batch_size: int, seq_len: int, block_size: int,
                 seed: int = 0, shuffle: bool = True, rows: Optional[tuple[int, int]] = None,
                 with_logp: Optional[bool] = None,
                 read_options: Optional[grain.ReadOptions] = None,
                 _order: Optional[EpochOrder] = None):
        self.source, self.batch_size, self.seq_len = source, batch_size, seq_len
        self.block_size, self.seed, self.shuffle = block_size, seed, shuffle
        self.rows = tuple(rows) if rows is not None else (0, batch_size)
        if not 0 <= self.rows[0] < self.rows[1] <= batch_size:
            raise ValueError(f"rows {self.rows} do not lie in a batch of {batch_size}")
        self.order = _order if _order is not None else train_order(
            source, seq_len=seq_len, block_size=block_size, seed=seed, shuffle=shuffle)
        self.usable = self.order.usable
        if with_logp is None:  # decided once, so every batch has the same fields
            with_logp = first_has_logp(source, self.usable)
        self.with_logp = bool(with_logp)
        self.read_options = read_options or SYNC_READ
        self.dataset = batch_dataset(self.order, source, batch_size=batch_size,
                                     seq_len=seq_len, rows=self.rows,
                                     with_logp=self.with_logp)
        self._it = iter(self.dataset.to_iter_dataset(self.read_options))

    @property
    def num_usable(self) -> int:
        return self.order.num_records

    def item_index(self, g: int) -> int:
        """The record at global position g."""
        return self.order[g]

    def with_source(self, source: Any, with_logp: Optional[bool] = None) -> "BatchIterator":
        """The same order and position over another source of the same records (e.g.
        `feature_cache.CachedFeatureSource`, records plus their cached taps; with_logp
        True where that source adds the log-probs these records lacked)."""
        if len(source) != len(self.source):
            raise ValueError(f"{len(source)} records, this pipeline reads {len(self.source)}")
        other = BatchIterator(source, batch_size=self.batch_size, seq_len=self.seq_len,
                              block_size=self.block_size, seed=self.seed,
                              shuffle=self.shuffle, rows=self.rows,
                              with_logp=self.with_logp if with_logp is None else with_logp,
                              read_options=self.read_options,
                              _order=self.order)
        other.set_state(self.get_state())
        return other

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._it)

    def get_state(self) -> dict[str, Any]:
        return {"kind": "batcher", "global": True,
                "batches": int(self._it.get_state()["next_index"]),
                "seed": int(self.seed), "num_usable": int(self.num_usable)}

    def set_state(self, state: Mapping[str, Any]) -> None:
        if "next_index" in state and "kind" not in state:  # grain's own iterator state
            self._it.set_state({"next_index": int(state["next_index"])})
            return
        if state.get("kind") != "batcher":
            raise ValueError(f"data state {dict(state)} was not written by a Batcher")
        if int(state.get("num_usable", self.num_usable)) != self.num_usable:
            raise ValueError(f"the checkpoint's data order was over {state['num_usable']} "
                             f"usable records; this corpus has {self.num_usable}: not the "
                             "same data")
        self._it.set_state({"next_index": int(state["batches"])})


# ---- reading a corpus outside the trainer -------------------------------------------------

def make_dataset(corpus: os.PathLike | str | Corpus, *, seq_len: int, batch_size: int,
                 seed: int = 0, verify_temperature: Optional[float] = None,
                 block_size: Optional[int] = None, shard_index: int = 0, shard_count: int = 1,
                 num_epochs: Optional[int] = 1, shuffle: bool = True,
                 drop_remainder: bool = True) -> grain.MapDataset:
    """Batches of a corpus for one of `shard_count` readers: the order of the module doc
    over `num_epochs` epochs (None: endless), this reader's share
    [shard_index::shard_count] of it, batched by batch_size.

    block_size: keep only records with an eligible anchor for blocks of this size (None:
    every record). `corpus`: a folder, a `Corpus`, a `CorpusDataSource`, or any
    random-access source with `usable_indices` and `pipeline_record(i)` (e.g.
    `tfds_builders.TfdsCorpusSource`).
    """
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index must lie in [0, shard_count={shard_count}), "
                         f"got {shard_index}")
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
    if isinstance(corpus, CorpusDataSource) or hasattr(corpus, "pipeline_record"):
        source = corpus  # a CorpusDataSource, or another source of the same records (TFDS)
    else:
        folder = corpus.folder if isinstance(corpus, Corpus) else corpus
        source = CorpusDataSource(folder, verify_temperature=verify_temperature)
    if block_size is not None:
        usable = source.usable_indices(seq_len, block_size)
    else:
        usable = np.arange(len(source))
    ds = EpochOrder(usable, len(source), seed=seed, shuffle=shuffle, num_epochs=num_epochs)
    if shard_count > 1:
        ds = ds[shard_index::shard_count]
    read = getattr(source, "pipeline_record", source.__getitem__)
    with_logp = "logp" in read(int(usable[0]))
    return ds.map(read).batch(batch_size, drop_remainder=drop_remainder,
                              batch_fn=functools.partial(_collate, seq_len=seq_len,
                                                         with_logp=with_logp))


def make_iterator(dataset: grain.MapDataset, state: Optional[dict] = None,
                  read_options: Optional[grain.ReadOptions] = None):
    """A checkpointable grain iterator (get_state / set_state), optionally restored;
    read in the calling thread unless `read_options` say otherwise."""
    it = iter(dataset.to_iter_dataset(read_options or SYNC_READ))
    if state is not None:
        it.set_state(state)
    return it


# ---- iterators without random access ------------------------------------------------------

class IteratorBatcher:
    """Batches from any iterator of records (per-process: it must yield this process's
    rows). State: the iterator's own get_state() when it has one; otherwise the number of
    records consumed, restored by re-creating the iterator with `make_iterator` and
    skipping that many."""

    def __init__(self, make_iterator: Callable[[], Iterator[Any]], *, local_batch_size: int,
                 seq_len: int, block_size: int, with_logp: Optional[bool] = None,
                 verify_temperature: Optional[float] = None, max_skips: int = 10000):
        self.make_iterator = make_iterator
        self.local_batch_size, self.seq_len, self.block_size = local_batch_size, seq_len, block_size
        self.with_logp, self.verify_temperature, self.max_skips = with_logp, verify_temperature, max_skips
        self._it = make_iterator()
        self._consumed = 0
        self._seen_usable = False

    def _next_record(self) -> Record:
        skipped = 0
        while True:
            try:
                item = next(self._it)
            except StopIteration:
                if self._consumed == 0:
                    raise ValueError("corpus is empty: the iterator yielded nothing") from None
                if not self._seen_usable:
                    raise ValueError(f"corpus is too short: no record has a response token "
                                     f"followed by a full block of {self.block_size} within "
                                     f"seq_len {self.seq_len}") from None
                self._it = self.make_iterator()  # next epoch
                continue
            self._consumed += 1
            rec = as_record(item, f"record {self._consumed}", self.verify_temperature)
            if record_is_usable(rec, self.seq_len, self.block_size):
                self._seen_usable = True
                return rec
            skipped += 1
            if skipped > self.max_skips:
                raise ValueError(f"{skipped} consecutive records were too short for a block of "
                                 f"{self.block_size} within seq_len {self.seq_len}")

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return collate([self._next_record() for _ in range(self.local_batch_size)],
                       self.seq_len, self.with_logp)

    def get_state(self) -> dict[str, Any]:
        if hasattr(self._it, "get_state"):
            state = self._it.get_state()
            if isinstance(state, bytes):
                return {"kind": "iterator", "bytes": state.decode("latin-1")}
            return {"kind": "iterator", "state": state}
        return {"kind": "position", "consumed": self._consumed}

    def set_state(self, state: Mapping[str, Any]) -> None:
        kind = state.get("kind")
        if kind == "iterator":
            if not hasattr(self._it, "set_state"):
                raise ValueError("checkpoint holds an iterator state but this iterator has "
                                 "no set_state()")
            self._it.set_state(state["bytes"].encode("latin-1") if "bytes" in state
                               else state["state"])
        elif kind == "position":
            self._it = self.make_iterator()
            self._consumed = 0
            for _ in range(int(state["consumed"])):
                try:
                    next(self._it)
                except StopIteration:
                    self._it = self.make_iterator()
                    next(self._it)
                self._consumed += 1
        else:
            raise ValueError(f"unknown data state {dict(state)}")
