"""The drafter trainer: one jitted, sharded step; checkpointed, resumable, multi-host.

Read in order: `objective.loss_terms` is the objective on one batch,
`step.make_train_step` wraps it in gradients + optax (`step` also holds the jit and
compile caches), and `Trainer` here owns the loop (data, read through the grain pipeline
of `data/pipeline.py`; mesh, checkpoints, metrics, export).

The step, for a batch of B sequences of T tokens (right-padded) and A anchors each:
  1. anchors: A distinct eligible positions per row drawn from fold_in(rng, step)
     (`objective.sample_anchors`: response tokens whose whole block fits);
  2. the frozen target (stop_gradient; it has no optimizer state) runs once over the
     sequences and gives the drafter's feature taps and, when the loss or the AL metrics
     need them and the batch does not carry them, the log-probs of the data tokens at
     the verification temperature T_v (its final hidden state is tapped and projected
     chunk by chunk: never [B, T, V] at once);
  3. the drafter's `train_hidden` gives branch hidden states [B, A, K, b-1, H] and the
     category prior [B, A, K]; `chunked_logits.token_logprobs` turns them into the
     branch log-probs of the label tokens with a scan over vocabulary chunks (the
     [B, A, K, b-1, V] logits never exist, forward or backward);
  4. `losses.combined_loss`: DFlash (position-decayed CE, K = 1), mixture NLL, or
     NLL + lambda * truncated AL surrogate, with lambda and tau on schedules;
  5. gradients (optionally accumulated over micro-batches with a scan), global-norm
     clipping, AdamW with linear warmup + cosine decay;
  6. a step whose loss, gradient norm or update is not finite is not applied; the host
     stops the run there (`nonfinite_policy` "error", before any checkpoint of it) or
     skips it ("skip", up to `max_skipped_steps`).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import time
from typing import Any, Callable, Iterable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dblast_jax import sharding as sharding_lib
from dblast_jax.config import DrafterConfig, TargetConfig
from dblast_jax.dtypes import dtype_from_name
from dblast_jax.generation import load_target
from dblast_jax.models import drafter as drafter_lib
from dblast_jax.models import target as target_lib
from dblast_jax.data import pipeline as pipeline_lib
from dblast_jax.data import records as records_lib
from dblast_jax.train import checkpoint as ckpt_lib
from dblast_jax.train import feature_cache as fc
from dblast_jax.train import metric_writers
from dblast_jax.train import sampled_head
from dblast_jax.train import tap_scaling
from dblast_jax.train import validation as validation_lib
from dblast_jax.train import warm_start
from dblast_jax.train.checkpoint import (Checkpointer, check_workdir, experiment_identity,
                                         read_log_rows)
from dblast_jax.train.config import TrainConfig
from dblast_jax.io import paths
from dblast_jax.io.output_folder import check_output_folder
from dblast_jax.workdir_lock import FolderLock, FolderLockedError

# moved to objective/step; re-exported for existing imports
from dblast_jax.train.objective import (  # noqa: F401
    lam_at, loss_terms, mixture_conditional_logq, target_features, target_features_and_teacher,
    target_head, tau_at)
from dblast_jax.train.step import (  # noqa: F401
    COUNT_METRICS, FINITE_KEY, HashableShardings, TrainState, compiled_eval_step,
    compiled_train_step, eval_config, lr_schedule, make_optimizer, make_train_step,
    step_cache_key, step_memory_analysis)

_step_cache_key = step_cache_key  # the old private names, for existing imports
_compiled_eval = compiled_eval_step

Array = jax.Array
Params = dict[str, Any]
HEAD_TOKENS_FILE = "train_head_tokens.json"  # the sampled training head's frequent tokens

__all__ = ["TrainState", "TrainResult", "make_optimizer", "lr_schedule", "loss_terms",
           "make_train_step", "target_features", "mixture_conditional_logq", "Trainer", "train",
           "target_head", "resolve_target", "step_memory_analysis", "NonFiniteError",
           "TrainingIOError", "check_data_for_target"]


class NonFiniteError(FloatingPointError, ValueError):
    """A train step produced a non-finite loss, gradient or update (str(): one line)."""


class TrainingIOError(OSError):
    """Writing a checkpoint or a metrics line failed, e.g. a full disk (str(): one line
    with the step, the file and the fix; `errno` is the underlying error's)."""

    def __init__(self, message: str, errno_: Optional[int] = None):
        super().__init__(message)
        self.errno = errno_


# ---- targets and data ---------------------------------------------------------------------------

def resolve_target(target: Any, config: TrainConfig):
    """A `generation.Target`, a (TargetConfig, params[, name]) tuple, or None (load
    config.target with `load_target`) -> (TargetConfig, params, name)."""
    if target is None:
        if not config.target:
            raise ValueError("no target: set target (--target PRESET_OR_PATH)")
        dtype = dtype_from_name(config.param_dtype)
        target = load_target(config.target, dtype=dtype)
    if hasattr(target, "config") and hasattr(target, "params"):
        return target.config, target.params, getattr(target, "name", target.config.name)
    if isinstance(target, tuple) and len(target) in (2, 3):
        tcfg, tparams = target[0], target[1]
        return tcfg, tparams, (target[2] if len(target) == 3 else tcfg.name)
    raise TypeError(f"target must be a Target, (TargetConfig, params) or None; got "
                    f"{type(target).__name__}")


check_data_for_target = records_lib.check_data_for_target


def _make_batcher(data: Any, config: TrainConfig, tcfg: TargetConfig, rows: tuple[int, int]):
    """The batches of this process (rows `rows` of every global batch): a
    `pipeline.BatchIterator` over the grain pipeline for any random-access data, the
    iterator itself for a ready one, `pipeline.IteratorBatcher` for an iterator factory."""
    b, t = config.drafter.block_size, config.seq_len
    if data is None:
        data = config.data
    if isinstance(data, str):
        data = records_lib.make_source(
            data, vocab_size=tcfg.vocab_size, block_size=b, seq_len=t,
            verify_temperature=config.verify_temperature, seed=config.seed,
            num_phrases=config.synthetic_num_phrases, phrase_len=config.synthetic_phrase_len,
            logit_scale=config.synthetic_logit_scale, corpus_shards=config.data_shards)
    if isinstance(data, (list, tuple)):
        data = records_lib.ListSource(data, name="corpus",
                                      verify_temperature=config.verify_temperature)
    if hasattr(data, "usable_indices"):
        return pipeline_lib.BatchIterator(data, batch_size=config.batch_size, seq_len=t,
                                          block_size=b, seed=config.seed, rows=rows)
    if hasattr(data, "__next__") and hasattr(data, "get_state"):
        return data  # a ready batcher
    if callable(data):
        return pipeline_lib.IteratorBatcher(data, local_batch_size=rows[1] - rows[0],
                                            seq_len=t, block_size=b,
                                            verify_temperature=config.verify_temperature)
    raise TypeError(f"data must be 'synthetic', a .jsonl path, a random-access source, a "
                    f"list of records, a batcher, or a function returning an iterator; got "
                    f"{type(data).__name__}")


# ---- the loop ---------------------------------------------------------------------------------

@dataclasses.dataclass
class TrainResult:
    workdir: str
    step: int  # the step reached
    history: list[dict[str, Any]]  # logged metrics of this run
    export_path: Optional[str]
    timing: dict[str, float]
    params: Any = None  # final drafter params (global jax arrays)


def _os_error_in(e: Optional[BaseException]) -> Optional[OSError]:
    """The OSError behind `e` (itself, or in its cause / context chain; TensorStore's
    errors with an OS error code included), if any."""
    return ckpt_lib.os_error_in(e)


def _to_py(x):
    x = np.asarray(x)
    return x.tolist() if x.ndim else x.item()


class Trainer:
    """One training run in `workdir` (resumed if the workdir holds this experiment).

    target: a generation.Target, (TargetConfig, params[, name]) or None (load
    config.target). data: None (config.data), 'synthetic', a .jsonl path, a random-access
    source, a list of records, a batcher or an iterator factory. mesh: a Mesh or None
    (config.mesh over all devices). validation_data: the held-out data of
    `validate_every` (anything `data` may be); None: config.validation_data / _shards."""

    def __init__(self, config: TrainConfig, workdir: str, *, target: Any = None,
                 data: Any = None, validation_data: Any = None, mesh: Optional[Mesh] = None,
                 drafter_config: Optional[DrafterConfig] = None, progress: bool = True,
                 async_checkpoints: bool = True, log: Callable[[str], None] = print):
        self.config = config
        self.log = log if jax.process_index() == 0 else (lambda s: None)
        self.progress = progress and jax.process_index() == 0
        tcfg, tparams, tname = resolve_target(target, config)
        dcfg = drafter_config or config.drafter_config(tcfg)
        drafter_lib.check_drafter_fits_target(dcfg, tcfg)
        if config.train_head_tokens > 0:
            sampled_head.check_sizes(config.train_head_tokens, config.train_head_sampled,
                                     tcfg.vocab_size)
        self.target_config, self.drafter_config, self.target_name = tcfg, dcfg, tname
        # Every check (identity, mesh, data) runs before anything is written.
        self.identity = experiment_identity(dcfg, tname, config.loss, config.tap_rms_scaling)
        self.workdir = paths.normalize(workdir)  # local: absolute; or gs://...
        check_workdir(self.workdir, self.identity)
        self.mesh = mesh if mesh is not None else sharding_lib.make_mesh(*config.mesh)
        self.dtype = dtype_from_name(config.param_dtype)
        batch_shape = (config.batch_size, config.seq_len)
        self.rows = sharding_lib.process_row_range(self.batch_row_sharding(batch_shape),
                                                   batch_shape)
        self.batcher = _make_batcher(data, config, tcfg, self.rows)
        self._check_data(getattr(self.batcher, "source", None), tparams,
                         getattr(self.batcher, "with_logp", None), "training data")
        if isinstance(getattr(self.batcher, "with_logp", None), bool):  # refused now, not at step 1
            self.logp_mode(("logp",) if self.batcher.with_logp else ())
        self.validation_data = self._validation_data(data, validation_data, tcfg)
        if self.validation_data is not None:
            self._check_data(self.validation_data, tparams, None, "validation data")
        if config.feature_cache:
            self._use_feature_cache(tparams, tname)
        self._setup_shardings(tparams)

        # One writer per workdir (the primary process holds the lock for the run); then
        # nothing in the workdir is rewritten before the checkpoint has been restored.
        self._lock = None
        self._failed = False
        self._take_lock()
        try:
            record = dict(config.to_dict(), target=config.target or tname)
            self.ckpt = Checkpointer(self.workdir, self.identity, keep=config.keep_checkpoints,
                                     async_save=async_checkpoints)
            self.tparams = jax.tree.map(sharding_lib.host_value_to_global, tparams,
                                        self.tparams_sh)
            self.skipped_steps = 0
            self.head_ids = self._train_head_ids() if config.train_head_tokens > 0 else None
            self.state = self._init_or_restore()
            self.ckpt.write_train_config(record)
        except BaseException:
            if hasattr(self, "ckpt"):
                try:
                    self.ckpt.close()
                except Exception:
                    pass
            self._release_lock()
            raise

    # -- setup
    def _take_lock(self) -> None:
        """Process 0 locks the workdir; every process learns whether it got it."""
        refused = None
        if jax.process_index() == 0:
            try:
                self._lock = FolderLock(self.workdir, "training", log=self.log).acquire()
            except Exception as e:  # noqa: BLE001 -- the other processes must hear of it too
                refused = e
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            got = multihost_utils.broadcast_one_to_all(np.int32(refused is None))
            if not int(got) and refused is None:
                refused = FolderLockedError(f"{self.workdir} is in use by another training "
                                            "(process 0 names it); wait for it or use "
                                            "another workdir")
        if refused is not None:
            raise refused

    def _check_data(self, source: Any, tparams: Params, with_logp: Optional[bool],
                    what: str) -> None:
        """Token ids within the target's vocabulary; a corpus's stored log-probs from
        this target (when this run reads them)."""
        if source is None:
            return
        cfg = self.config
        if with_logp is None:
            with_logp = getattr(source, "manifest", None) is not None
        uses_logp = ((cfg.uses_al or cfg.track_al) and cfg.logp_source != "target"
                     and bool(with_logp))
        check_data_for_target(source, self.target_config, self.target_name, tparams,
                              uses_logp=uses_logp, log=self.log, what=what)

    def _use_feature_cache(self, tparams: Params, tname: str) -> None:
        """Read the frozen target's taps from a cache built once (feature_cache.py)."""
        cfg = self.config
        fc.check_local(cfg.feature_cache)  # memory-mapped: gs:// is refused, in one line
        if not isinstance(self.batcher, pipeline_lib.BatchIterator):
            raise ValueError("feature_cache needs a random-access corpus (a corpus folder, "
                             ".jsonl or records), not an iterator")
        needs_logp = cfg.uses_al or cfg.track_al
        if needs_logp and cfg.logp_source == "target":
            raise ValueError("feature_cache replaces the target's pass of every step, so "
                             "logp_source='target' has no target pass to score in: leave "
                             "logp_source=auto (the log-probs the data carry, or those the "
                             "cache computes for data without them)")
        # data without log-probs (an unscored corpus): the cache's pass scores them at T_v
        cache_logp = needs_logp and not self.batcher.with_logp
        cache = fc.build_feature_cache(
            self.batcher.source, self.target_config, tparams,
            self.drafter_config.target_layer_ids, cfg.seq_len, cfg.feature_cache,
            target_name=tname, dtype=cfg.feature_cache_dtype, batch_size=cfg.batch_size,
            progress=self.progress, log=self.log, build=jax.process_count() == 1,
            teacher_topk=cfg.distill_topk if cfg.distill_weight > 0 else 0,
            teacher_temperature=cfg.verify_temperature,
            head=target_head(tparams, self.target_config),
            data_logp_temperature=cfg.verify_temperature if cache_logp else None)
        self.batcher = self.batcher.with_source(
            fc.CachedFeatureSource(self.batcher.source, cache),
            with_logp=True if cache_logp else None)

    def _validation_data(self, data: Any, given: Any, tcfg: TargetConfig) -> Any:
        cfg = self.config
        if not cfg.validate_every:
            return None
        if given is not None:
            return given
        if isinstance(data, str) and data != cfg.data:
            cfg.replace(data=data)  # the config's held-out checks, against the real data
        if data is not None and not isinstance(data, str) and not cfg.validation_data:
            raise ValueError("validate_every with training data given as an object needs "
                             "held-out data: pass validation_data= or set "
                             "config.validation_data")
        train_data = data if isinstance(data, str) else cfg.data
        return validation_lib.make_validation_source(
            cfg, tcfg, data=cfg.validation_data or train_data)

    def batch_row_sharding(self, shape: tuple[int, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, sharding_lib.data_fsdp_batch_spec(shape, self.mesh))

    def _setup_shardings(self, tparams: Params) -> None:
        mesh, cfg = self.mesh, self.config
        abstract = drafter_lib.abstract_drafter_params(self.drafter_config, self.target_config,
                                                       self.dtype)
        self.param_specs = drafter_lib.drafter_partition_specs(abstract, mesh)
        param_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), self.param_specs,
                                is_leaf=lambda x: isinstance(x, P))
        self.tx, self.schedule = make_optimizer(cfg)
        abstract_opt = jax.eval_shape(self.tx.init, abstract)
        opt_sh = sharding_lib.opt_state_shardings(abstract_opt, self.param_specs, mesh)
        self.state_sh = TrainState(step=sharding_lib.replicated(mesh), params=param_sh,
                                   opt_state=opt_sh, rng=sharding_lib.replicated(mesh))
        self.tparams_sh = sharding_lib.named_shardings(tparams, mesh)

    def _fresh_state(self) -> TrainState:
        cfg = self.config
        host = drafter_lib.init_drafter_params(self.drafter_config, self.target_config,
                                               cfg.seed, self.dtype)
        if cfg.drafter_init == "target":
            host = warm_start.warm_start_from_target(host, self.tparams, self.drafter_config,
                                                     self.target_config)
        elif cfg.drafter_init.startswith(warm_start.DRAFTER_PREFIX):
            source = cfg.drafter_init[len(warm_start.DRAFTER_PREFIX):]
            src_config, src_params = warm_start.load_source_drafter(
                source, self.target_config, cfg.target, log=self.log)
            host = warm_start.warm_start_from_drafter(host, self.drafter_config, src_params,
                                                      src_config)
            if src_config.num_layers < self.drafter_config.num_layers:
                self.log(f"drafter_init: growing {source} from {src_config.num_layers} to "
                         f"{self.drafter_config.num_layers} layers (new layers start as the "
                         "identity: zero o_proj and down_proj)")
        row_scale = None
        if cfg.tap_rms_scaling:
            row_scale = tap_scaling.fc_row_scale(self._tap_rms())
            if cfg.drafter_init == "random":  # W = W' / s with W' at its usual init
                kernel = np.asarray(host["fc"]["kernel"], np.float32) * row_scale
                host = {**host, "fc": {**host["fc"], "kernel": jnp.asarray(
                    kernel.astype(np.dtype(jnp.dtype(self.dtype))))}}
        put = sharding_lib.host_value_to_global
        params = jax.tree.map(put, host, self.state_sh.params)
        opt_state = jax.jit(self.tx.init, out_shardings=self.state_sh.opt_state)(params)
        if row_scale is not None:  # kept in the optimizer state: resumes carry it
            opt_state = tap_scaling.with_row_scale(
                opt_state, put(row_scale, tap_scaling.row_scale_of(self.state_sh.opt_state)))
        return TrainState(step=put(np.int32(0), self.state_sh.step), params=params,
                          opt_state=opt_state,
                          rng=put(np.asarray(jax.random.PRNGKey(cfg.seed)), self.state_sh.rng))

    def _tap_rms(self) -> np.ndarray:
        """Per-channel RMS of fc's inputs (the target's taps) over the valid positions of
        the first batch_size records of the training data (tap_rms_scaling)."""
        cfg, tcfg, dcfg = self.config, self.target_config, self.drafter_config
        source = getattr(self.batcher, "source", None)
        if source is None or not hasattr(source, "__getitem__"):
            raise ValueError("tap_rms_scaling measures the taps on the first training records "
                             "and needs random-access training data (a corpus folder, "
                             ".jsonl, a list of records or 'synthetic'), not an iterator")
        n = min(len(source), cfg.batch_size)
        batch = records_lib.collate([source[i] for i in range(n)], cfg.seq_len,
                                    with_logp=False)
        valid = np.arange(cfg.seq_len)[None, :] < batch["lengths"][:, None]
        if "taps" in batch:  # read from the feature cache
            taps = batch["taps"]
        else:
            rep = sharding_lib.replicated(self.mesh)
            forward = jax.jit(lambda p, t: target_lib.forward(
                p, t, config=tcfg, tap_layers=dcfg.target_layer_ids)[1], out_shardings=rep)
            tokens = sharding_lib.host_value_to_global(batch["tokens"], rep)
            taps = np.asarray(forward(self.tparams, tokens).addressable_data(0))
        rms = tap_scaling.channel_rms(taps, valid)
        per_tap = rms.reshape(len(dcfg.target_layer_ids), -1)
        self.log("tap_rms_scaling: fc input RMS on %d positions, per tap (layer: median / max) "
                 % int(valid.sum()) + ", ".join(
                     f"{layer}: {np.median(r):.3g} / {r.max():.3g}"
                     for layer, r in zip(dcfg.target_layer_ids, per_tap)))
        return rms

    def _train_head_ids(self) -> np.ndarray:
        """The sampled training head's frequent tokens: read from the workdir when a run
        of the same train_head_tokens wrote them (a resume keeps its head), else counted on
        the training data's first records and written there."""
        cfg = self.config
        path = paths.join(self.workdir, HEAD_TOKENS_FILE)
        if paths.exists(path):
            try:
                ids = np.asarray(json.loads(paths.read_text(path))["ids"], np.int32)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path} is unreadable ({e}); delete it to count the "
                                 "frequent tokens again") from e
            if ids.shape == (cfg.train_head_tokens,):
                return ids
        source = getattr(self.batcher, "source", None)
        source = getattr(source, "source", source)  # a feature cache's records, without taps
        ids, stats = sampled_head.frequent_token_ids(source, self.target_config.vocab_size,
                                                     cfg.train_head_tokens)
        self.log(f"train_head_tokens: the {cfg.train_head_tokens} most frequent response "
                 f"tokens of {stats['records']} records cover {100 * stats['coverage']:.1f}% "
                 f"of their {stats['response_tokens']} response tokens; + "
                 f"{cfg.train_head_sampled} sampled per step")
        if jax.process_index() == 0:
            paths.atomic_write_json(path, {"ids": ids.tolist(), **stats})
        return ids

    def _abstract_state(self) -> dict[str, Any]:
        abstract = drafter_lib.abstract_drafter_params(self.drafter_config, self.target_config,
                                                       self.dtype)
        tree = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract,
                          opt_state=jax.eval_shape(self.tx.init, abstract),
                          rng=jax.ShapeDtypeStruct((2,), jnp.uint32))
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            tree, self.state_sh).to_dict()

    def _init_or_restore(self) -> TrainState:
        latest = self.ckpt.latest_step()
        if latest is None:
            self.start_step = 0
            state = self._fresh_state()
            # lines of an earlier attempt that never reached a checkpoint are redone
            for check_only in (True, False):
                for name in ("metrics.jsonl", validation_lib.VALIDATION_FILE):
                    self._truncate_metrics(0, name, check_only=check_only)
            return state
        state, data_state = self.ckpt.restore(self._abstract_state(), latest)
        if isinstance(data_state, Mapping) and "nonfinite_skipped" in data_state:
            data_state = dict(data_state)
            self.skipped_steps = int(data_state.pop("nonfinite_skipped"))
        self.batcher.set_state(data_state)
        self.start_step = int(latest)
        for name in ("metrics.jsonl", validation_lib.VALIDATION_FILE):
            self._truncate_metrics(latest, name, check_only=True)
        self.log(f"resumed {self.workdir} at step {latest}")
        for name in ("metrics.jsonl", validation_lib.VALIDATION_FILE):
            self._truncate_metrics(latest, name)
        return TrainState.from_dict(state)

    def _truncate_metrics(self, step: int, name: str = "metrics.jsonl",
                          check_only: bool = False) -> None:
        """Drop metric lines written after the restored checkpoint (they will be redone),
        and a last line cut short by a crash or a full disk (one log line says so). A
        corrupt line before the last is an error naming the file and line."""
        path = paths.join(self.workdir, name)
        if jax.process_index() != 0 or not paths.exists(path):
            return
        rows, lines, dropped = read_log_rows(path, log=None if check_only else self.log)
        if check_only:
            return
        keep = [ln for row, ln in zip(rows, lines) if row.get("step", 0) <= step]
        if not paths.is_local(path):  # an object: rewritten whole, in one write
            if len(keep) == len(lines) and not dropped and (
                    not keep or paths.read_bytes(path).endswith(b"\n")):
                return  # nothing to drop: leave it untouched
        elif len(keep) == len(lines) and not dropped:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() == 0:
                    return
                f.seek(-1, os.SEEK_END)
                if f.read(1) == b"\n":
                    return  # nothing to drop, ends with a newline: leave it untouched
        paths.atomic_write_text(path, "".join(ln + "\n" for ln in keep))

    def _append_row(self, path: str, row: Mapping[str, Any], step: int) -> None:
        """One JSON line appended to a workdir log (primary process). On an object store
        (gs://) the log is rewritten whole instead (io.paths.append_text)."""
        try:
            if paths.is_local(path):
                with open(path, "a") as f:
                    f.write(json.dumps(row) + "\n")
            else:
                paths.append_text(path, json.dumps(row) + "\n")
        except OSError as e:
            raise self._io_error(f"could not append step {step} to {path}", e) from e

    def _io_error(self, what: str, e: BaseException) -> TrainingIOError:
        self._failed = True
        cause = _os_error_in(e)
        err = getattr(cause, "errno", None)
        try:  # a save still in flight finishes first (close() would wait for it too)
            self.ckpt.wait()
        except Exception:  # noqa: BLE001 -- that save failed: the disk says what is left
            pass
        try:  # from the disk: the manager also counts a save that failed in the background
            last = self.ckpt.last_finished_step()
        except Exception:
            last = None
        resume = (f"step {last}, its last finished checkpoint" if last is not None
                  else "step 0: no checkpoint was finished yet")
        text = " ".join(str(cause or e).split())
        reason = f"the disk is full ({text})" if err == errno.ENOSPC else text
        fix = ("free disk space and rerun the same command" if err == errno.ENOSPC
               else "fix the cause and rerun the same command")
        return TrainingIOError(f"{what}: {reason}; {fix}: training resumes from {resume}",
                               err)

    def _check_finite(self, pending: list) -> None:
        """Host check of the finite flags of the steps run since the last check."""
        if not pending:
            return
        flags = jax.device_get([p[1] for p in pending])
        cfg = self.config
        bad = [(p[0], p[2]) for p, ok in zip(pending, flags) if not bool(ok)]
        pending.clear()
        for step, vals in bad:
            loss, gnorm = (float(v) for v in jax.device_get(vals))
            what = f"non-finite training step {step} (loss {loss}, grad norm {gnorm})"
            if cfg.nonfinite_policy == "skip" and self.skipped_steps < cfg.max_skipped_steps:
                self.skipped_steps += 1
                self.log(f"{what}: update skipped ({self.skipped_steps} of at most "
                         f"{cfg.max_skipped_steps})")
                continue
            self._failed = True
            last = self.ckpt.latest_step()
            kept = (f"the last good checkpoint (step {last}) is kept" if last is not None
                    else "no checkpoint was written")
            limit = (f" after {self.skipped_steps} skipped steps (max_skipped_steps "
                     f"{cfg.max_skipped_steps})" if cfg.nonfinite_policy == "skip" else "")
            raise NonFiniteError(
                f"{what}{limit} in {self.workdir}; nothing non-finite was saved and no export "
                f"was written, {kept}. Lower learning_rate (it is {cfg.learning_rate}) or "
                "grad_clip, check the data, or set nonfinite_policy=skip")

    # -- data on device
    def logp_mode(self, batch_keys: Iterable[str]) -> Optional[str]:
        cfg = self.config
        need = cfg.uses_al or cfg.track_al
        if not need:
            return None
        has = "logp" in batch_keys
        if cfg.logp_source == "data":
            if not has:
                raise ValueError("logp_source='data' but the corpus stores no logp (an "
                                 "unscored corpus); set logp_source=auto (a feature_cache "
                                 "then scores it once) or logp_source=target")
            return "data"
        if cfg.logp_source == "target":
            return "target"
        return "data" if has else "target"

    def global_batch(self, local: Mapping[str, np.ndarray], mode: Optional[str]
                     ) -> dict[str, Array]:
        """Process-local rows -> global arrays sharded on the batch axis."""
        out = {}
        for k, v in local.items():
            if k == "logp" and mode != "data":
                continue
            shape = (self.config.batch_size,) + v.shape[1:]
            if v.shape[0] != self.rows[1] - self.rows[0]:
                raise ValueError(f"batch field {k!r} has {v.shape[0]} rows; this process "
                                 f"holds rows {self.rows} of {shape[0]}")
            out[k] = jax.make_array_from_process_local_data(self.batch_row_sharding(shape), v,
                                                            shape)
        return out

    def _step_fn(self, mode: Optional[str], batch: Mapping[str, Array]):
        batch_sh = {k: v.sharding for k, v in batch.items()}
        key = HashableShardings((self.state_sh, self.tparams_sh, batch_sh))
        head = None if self.head_ids is None else sampled_head.HashableIds(self.head_ids)
        return compiled_train_step(step_cache_key(self.config), self.drafter_config,
                                   self.target_config, mode, self.mesh, key, head)

    # -- the loop
    def run(self, stop_at: Optional[int] = None) -> TrainResult:
        """Train to config.num_steps (or `stop_at`, saving a checkpoint there, as a
        graceful preemption would). Returns the logged history of this run."""
        cfg = self.config
        check_stop_at(stop_at)
        end = cfg.num_steps if stop_at is None else min(int(stop_at), cfg.num_steps)
        step = self.start_step
        history: list[dict[str, Any]] = []
        metrics_path = paths.join(self.workdir, "metrics.jsonl")
        primary = jax.process_index() == 0
        self._live_metrics()  # opened before the first step: a missing wandb fails here
        bar = None
        if self.progress and step < end:
            from tqdm.auto import tqdm
            bar = tqdm(total=end, initial=step, desc=cfg.name, dynamic_ncols=True)
        t_start = time.perf_counter()
        t_last, steps_since, first_step_s = t_start, 0, None
        pending: list = []  # (step, finite flag, (loss, grad norm)) not yet checked
        try:
            while step < end:
                step, t_last, steps_since, first_step_s = self._one_step(
                    step, end, history, metrics_path, primary, bar, pending, t_last,
                    steps_since, first_step_s)
            self._check_finite(pending)
            if bar is not None:
                bar.close()
                bar = None
            try:
                self.ckpt.wait()
            except Exception as e:
                if _os_error_in(e) is None:
                    raise
                failed = self.ckpt.failed_step if self.ckpt.failed_step is not None else step
                raise self._io_error(f"could not finish the checkpoint of step {failed} in "
                                     f"{self.ckpt.directory}", e) from e
        except BaseException:
            self._failed = True
            if bar is not None:
                bar.close()
            raise
        total = time.perf_counter() - t_start
        export_path = None
        if step >= cfg.num_steps and cfg.export and (stop_at is None or stop_at >= cfg.num_steps):
            export_path = self.export(paths.join(self.workdir, "export"))
        timed = [h for h in history if "step_time_s" in h]
        timing = {"wall_s": total, "first_step_s": first_step_s or 0.0,
                  "steps": float(step - self.start_step)}
        if timed:
            timing["step_time_s"] = float(np.mean([h["step_time_s"] for h in timed]))
            timing["tokens_per_s"] = float(np.mean([h["tokens_per_s"] for h in timed]))
        self.start_step = step
        return TrainResult(self.workdir, step, history, export_path, timing, self.state.params)

    def _one_step(self, step, end, history, metrics_path, primary, bar, pending, t_last,
                  steps_since, first_step_s):
        """One optimizer step of `run`, its metrics line, validation and checkpoint."""
        cfg = self.config
        local = next(self.batcher)
        mode = self.logp_mode(local.keys())
        batch = self.global_batch(local, mode)
        fn = self._step_fn(mode, batch)
        self.state, metrics = fn(self.state, self.tparams, batch)
        step += 1
        steps_since += 1
        metrics = dict(metrics)
        pending.append((step, metrics.pop(FINITE_KEY),
                        (metrics["loss"], metrics["grad_norm"])))
        if step % cfg.log_every == 0 or step == end or first_step_s is None:
            self._check_finite(pending)
            m = jax.device_get(metrics)
            now = time.perf_counter()
            dt = now - t_last
            row = {"step": step, **{k: _to_py(v) for k, v in m.items()}}
            if first_step_s is None:
                first_step_s = dt  # includes compilation
                row["compile_and_step_s"] = dt
            else:
                row["step_time_s"] = dt / steps_since
                row["tokens_per_s"] = int(m["tokens"]) * steps_since / dt
            t_last, steps_since = now, 0
            if cfg.nonfinite_policy == "skip":
                row["skipped_steps"] = self.skipped_steps
            history.append(row)
            if primary:
                self._append_row(metrics_path, row, step)
                self._live_metrics().write_scalars(step, row, "train")
            if bar is not None:
                post = {"loss": f"{row['loss']:.3f}"}
                if "al_estimate" in row:
                    post["AL"] = f"{row['al_estimate']:.2f}"
                if "tokens_per_s" in row:
                    post["tok/s"] = f"{row['tokens_per_s']:.0f}"
                bar.set_postfix(post, refresh=False)
        if bar is not None:
            bar.update(1)
        if self.validation_data is not None and (step % cfg.validate_every == 0
                                                 or step == end):
            self._validate(step, bar)
        if step % cfg.checkpoint_every == 0 or step == end:
            self._check_finite(pending)  # never a non-finite step in a checkpoint
            data_state = self.batcher.get_state()
            if self.skipped_steps and isinstance(data_state, Mapping):
                data_state = dict(data_state, nonfinite_skipped=self.skipped_steps)
            try:
                self.ckpt.save(step, self.state.to_dict(), data_state)
            except Exception as e:
                if _os_error_in(e) is None:
                    raise
                # the step whose save failed: an earlier one written in the background
                # fails only when this save waits for it
                failed = self.ckpt.failed_step if self.ckpt.failed_step is not None else step
                raise self._io_error(f"could not save the checkpoint of step {failed} in "
                                     f"{self.ckpt.directory}", e) from e
        return step, t_last, steps_since, first_step_s

    def _validate(self, step: int, bar: Any) -> dict[str, Any]:
        """Held-out metrics at `step` -> workdir/validation.jsonl (+ a log line)."""
        cfg = self.config
        t0 = time.perf_counter()
        m = self.evaluate(self.validation_data, cfg.validation_batches, step=step)
        row = {"step": step, **m, "validation_s": time.perf_counter() - t0}
        if jax.process_index() == 0:
            self._append_row(paths.join(self.workdir, validation_lib.VALIDATION_FILE), row,
                             step)
            self._live_metrics().write_scalars(step, row, "heldout")
        text = (f"validation @ {step}: block nll {m.get('block_nll', m['nll']):.3f}, "
                f"top-1 {m['top1_mean']:.3f}")
        if "al_estimate" in m:
            text += (f", expected accepted {m['al_estimate']:.3f} (mixture "
                     f"{m['al_estimate_mixture']:.3f})")
        if bar is not None:
            bar.write(text)
        else:
            self.log(text)
        return row

    # -- evaluation and export
    def evaluate(self, data: Any, num_batches: int = 4, seed: int = 1234,
                 step: Optional[int] = None,
                 verify_temperature: Optional[float] = None) -> dict[str, Any]:
        """Mean metrics over `num_batches` batches of `data` (anything `Trainer` accepts
        as data, read from its start) with fixed anchors from `seed`; no update.
        verify_temperature: score acceptance at this T_v instead of the config's (a source
        made for it, e.g. `validation.make_validation_source(config.replace(
        verify_temperature=T), ...)`; its eval step is compiled once more)."""
        cfg = self.config if verify_temperature is None else self.config.replace(
            verify_temperature=float(verify_temperature))
        batcher = _make_batcher(data, cfg, self.target_config, self.rows)
        step = int(self.state.step) if step is None else step

        def run_batch(local, rng):
            mode = "data" if ("logp" in local and cfg.logp_source != "target") else "target"
            batch = self.global_batch(local, mode)
            fn = compiled_eval_step(step_cache_key(eval_config(cfg)), self.drafter_config,
                                    self.target_config, mode, self.mesh)
            return fn(self.state.params, self.tparams, batch, rng, jnp.int32(step))

        return validation_lib.mean_metrics(batcher, num_batches, run_batch, seed)

    def params_host(self) -> Params:
        """The drafter parameters as numpy on every process (gathered if sharded across
        processes)."""
        leaves = jax.tree.leaves(self.state.params)
        if all(x.is_fully_addressable for x in leaves):
            return jax.device_get(self.state.params)
        from jax.experimental import multihost_utils
        return multihost_utils.process_allgather(self.state.params, tiled=True)

    def export(self, folder: str, dtype: Optional[str] = None,
               force: bool = False) -> Optional[str]:
        """Write the drafter in DFlash format (dblast_jax.io.dflash), primary process only;
        dtype 'float32' / 'bfloat16' (default: the training parameters' dtype); `force`:
        see dflash.export_drafter (a folder that is not empty and not a previous export)."""
        try:
            from dblast_jax.train.restore import export_params  # cycle: restore imports this
        except ImportError as e:  # the export module is optional
            self.log(f"export skipped: dblast_jax.io.dflash unavailable ({e})")
            return None
        return export_params(self.params_host(), self.drafter_config, folder,
                             dtype=dtype or self.config.param_dtype, force=force, log=self.log)

    def _live_metrics(self) -> metric_writers.MetricWriter:
        """The TensorBoard / W&B writers of the config (train/metric_writers.py), opened
        once per Trainer: rows go there as they go to metrics.jsonl ("train/...") and
        validation.jsonl ("heldout/..."), against the step. A resumed run purges the
        TensorBoard events past its checkpoint (those steps are redone)."""
        writer = getattr(self, "_metric_writer", None)
        if writer is None:
            writer = self._metric_writer = metric_writers.make_train_writer(
                self.config, self.workdir, start_step=self.start_step)
        return writer

    def close(self) -> None:
        writer, self._metric_writer = getattr(self, "_metric_writer", None), None
        if writer is not None:
            try:
                writer.close()
            except Exception as e:  # noqa: BLE001 -- a view of the run; never fails it
                self.log(f"closing the live-metrics writers failed: {e}")
        try:
            self.ckpt.close()
        except Exception as e:
            if not self._failed and _os_error_in(e) is None:
                raise
            if not self._failed:  # a failed run already raised its own, clearer error
                raise self._io_error(f"could not finish the checkpoints in "
                                     f"{self.ckpt.directory}", e) from e
        finally:
            self._release_lock()

    def _release_lock(self) -> None:
        lock, self._lock = getattr(self, "_lock", None), None
        if lock is not None:
            lock.release()


def check_stop_at(stop_at: Optional[int]) -> None:
    """A stop step must be a step number: 0 or less would train nothing and exit 0."""
    if stop_at is not None and int(stop_at) < 1:
        raise ValueError(f"stop_at (--stop-at / --stop_at) must be a step >= 1, got {stop_at}; "
                         "omit it to train to the schedule's end")


def train(config: TrainConfig, workdir: str, *, target: Any = None, data: Any = None,
          mesh: Optional[Mesh] = None, stop_at: Optional[int] = None, progress: bool = True,
          **kw) -> TrainResult:
    """Build a Trainer, run it, close it."""
    check_stop_at(stop_at)  # before the Trainer touches the workdir
    # absent, empty or a training workdir (io/output_folder.py), on every process alike
    check_output_folder(workdir, "training workdir", "--workdir")
    trainer = Trainer(config, workdir, target=target, data=data, mesh=mesh, progress=progress,
                      **kw)
    try:
        return trainer.run(stop_at=stop_at)
    finally:
        trainer.close()

