"""Training drafters: configs and experiments, the sharded trainer, checkpoints.

    from dblast_jax.train import get_experiment, train
    result = train(get_experiment("tiny_dflash", ["num_steps=50"]), "/tmp/run")

Data (records, sources, the grain input pipeline) live in `dblast_jax.data`; the names
below that come from there (`Batcher`, `ListSource`, ...) are kept for existing code.
"""

from dblast_jax.data.pipeline import BatchIterator as Batcher, IteratorBatcher
from dblast_jax.data.records import ListSource, SyntheticMultiModal, load_jsonl
from dblast_jax.train.checkpoint import Checkpointer, ForeignCheckpointError, experiment_identity
from dblast_jax.train.config import (EXPERIMENTS, DrafterSpec, TrainConfig, apply_overrides,
                                     get_experiment, list_experiments)
from dblast_jax.train.objective import sample_anchors
from dblast_jax.train.trainer import (TrainResult, TrainState, Trainer, loss_terms,
                                      make_optimizer, make_train_step, train)

__all__ = [
    "Batcher", "Checkpointer", "DrafterSpec", "EXPERIMENTS", "ForeignCheckpointError", "IteratorBatcher",
    "ListSource", "SyntheticMultiModal", "TrainConfig", "TrainResult", "TrainState", "Trainer",
    "apply_overrides", "experiment_identity", "get_experiment", "list_experiments",
    "load_jsonl", "loss_terms", "make_optimizer", "make_train_step", "sample_anchors", "train",
]
