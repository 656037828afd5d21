"""Old import path of the data code, kept for existing imports; nothing is defined here.

Records, sources and `collate` live in `dblast_jax.data.records`; the input pipeline
(grain MapDatasets, the trainer's checkpointable `BatchIterator`, here still called
`Batcher`) in `dblast_jax.data.pipeline`; the on-device anchor / label ops in
`dblast_jax.train.objective`.
"""

from dblast_jax.data.pipeline import BatchIterator as Batcher, IteratorBatcher  # noqa: F401
from dblast_jax.data.records import (  # noqa: F401
    Record, ListSource, SyntheticMultiModal, as_record, check_data_for_target, collate,
    load_jsonl, make_source, record_is_usable, token_id_range)
from dblast_jax.train.objective import (  # noqa: F401
    block_labels, eligible_anchor_mask, gather_block, sample_anchors)

__all__ = [
    "as_record", "load_jsonl", "ListSource", "SyntheticMultiModal", "Batcher",
    "IteratorBatcher", "collate", "record_is_usable", "eligible_anchor_mask",
    "sample_anchors", "gather_block", "block_labels", "make_source", "token_id_range",
    "check_data_for_target",
]
