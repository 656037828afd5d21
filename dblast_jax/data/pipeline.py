"""grain input pipeline over a regenerated corpus (what the trainer consumes).

    source (corpus shards, random access)
      -> usable records only (a response token followed by a whole block within seq_len)
      -> shuffle(seed), reshuffled every epoch
      -> repeat(num_epochs)
      -> [shard_index::shard_count]       per-process share of the global order
      -> pad / truncate to seq_len (+ loss mask, lengths, stored target log-probs)
      -> batch(batch_size)

Every stage is a `grain.MapDataset`, so element k of the pipeline is a pure function of
(seed, k): two runs with one seed agree, and the iterator state is one index
(`it.get_state()` / `it.set_state(state)`) that a checkpoint can store. Processes with
different `shard_index` read disjoint elements of the same global order.
Anchors are sampled later, on device, by the trainer (`train.batches.sample_anchors`).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import grain
import numpy as np

from dblast_jax.data.corpus import Corpus

__all__ = ["CorpusDataSource", "pad_record", "make_dataset", "make_iterator"]


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
    """Truncate / right-pad one record to seq_len (token 0, mask False, logp 0)."""
    n = min(len(rec["tokens"]), seq_len)
    tokens = np.zeros((seq_len,), np.int32)
    tokens[:n] = rec["tokens"][:n]
    mask = np.zeros((seq_len,), bool)
    mask[:n] = rec["loss_mask"][:n]
    out = {"tokens": tokens, "loss_mask": mask, "lengths": np.int32(n)}
    if "logp" in rec:
        logp = np.zeros((seq_len,), np.float32)
        logp[:n] = rec["logp"][:n]
        out["logp"] = logp
    return out


def make_dataset(corpus: os.PathLike | str | Corpus, *, seq_len: int, batch_size: int,
                 seed: int = 0, verify_temperature: Optional[float] = None,
                 block_size: Optional[int] = None, shard_index: int = 0, shard_count: int = 1,
                 num_epochs: Optional[int] = 1, shuffle: bool = True,
                 drop_remainder: bool = True) -> grain.MapDataset:
    """The batched MapDataset of one process. `num_epochs=None` repeats forever.

    block_size: keep only records with an eligible anchor for blocks of this size.
    `corpus`: a folder, a `Corpus`, a `CorpusDataSource`, or any random-access source with
    `usable_indices` and `pipeline_record(i)` (e.g. `tfds_builders.TfdsCorpusSource`).
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
        indices = source.usable_indices(seq_len, block_size)
    else:
        indices = np.arange(len(source))
    ds = grain.MapDataset.source([int(i) for i in indices])
    if shuffle:
        ds = ds.seed(seed).shuffle()  # reshuffles each epoch when repeated below
    ds = ds.repeat(num_epochs)
    if shard_count > 1:
        ds = ds[shard_index::shard_count]
    read = getattr(source, "pipeline_record", source.__getitem__)
    ds = ds.map(lambda i: pad_record(read(i), seq_len))
    return ds.batch(batch_size, drop_remainder=drop_remainder)


def make_iterator(dataset: grain.MapDataset, state: Optional[dict] = None):
    """A checkpointable iterator (get_state / set_state), optionally restored."""
    it = iter(dataset)
    if state is not None:
        it.set_state(state)
    return it
