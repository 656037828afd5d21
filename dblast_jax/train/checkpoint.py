"""Checkpoints of a training run (orbax) and the workdir's experiment identity.

Workdir layout:
    experiment.json      identity: drafter config, target name, loss (never overwritten)
    train_config.json    the full TrainConfig of the latest start (restart needs only
                         the workdir); written once the checkpoint has been restored
    .lock                held by the one trainer writing here (dblast_jax.workdir_lock)
    checkpoints/<step>/  orbax: state (params, optimizer state, step, RNG), data (the
                         data iterator's state, one JSON per process), experiment
    metrics.jsonl        one JSON object per logged step (a resume drops lines past its
                         checkpoint and a last line cut short; see `read_log_rows`)
    export/              the drafter in DFlash format, written at the end

The workdir may be a `gs://` path (dblast_jax.io.paths): the JSON files are then written
as single objects, metrics.jsonl is rewritten whole on each flush, and orbax commits a
step with a commit file instead of a rename; there is no .lock (object stores have none).

Atomicity is orbax's: a step directory is written under a temporary name and renamed
once every process has finished (multi-process: the primary process commits after a
barrier), and only the `keep` newest are kept; the temporary folder of a save cut
short is removed at the next start. A workdir whose identity differs from the run's is
refused before anything is written.
"""

from __future__ import annotations

import dataclasses
import errno as errno_lib
import json
import logging
import os
import re
import threading
from typing import Any, Callable, Mapping, Optional

import jax
import orbax.checkpoint as ocp
from etils import epath

from dblast_jax.io import paths

IDENTITY_FILE = "experiment.json"
CONFIG_FILE = "train_config.json"
CHECKPOINT_DIR = "checkpoints"
IDENTITY_VERSION = 1

__all__ = ["ForeignCheckpointError", "experiment_identity", "check_workdir", "Checkpointer",
           "DataStateSave", "DataStateRestore", "read_train_config", "read_log_rows",
           "os_error_in", "finished_steps"]


class ForeignCheckpointError(ValueError):
    """The workdir holds another experiment's checkpoints."""


def experiment_identity(drafter_config, target_name: str, loss: str,
                        tap_rms_scaling: bool = False) -> dict[str, Any]:
    """What must match for a checkpoint to be resumed: the drafter's shape (its params and
    optimizer state), the target it reads features from, and the objective.
    tap_rms_scaling changes the optimizer state's structure; it is recorded only when on,
    so workdirs of before keep their identity."""
    dc = dataclasses.asdict(drafter_config)
    dc = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dc.items()}
    dc.pop("name", None)  # a label, not a shape
    if dc.get("correction") == "none":  # recorded only when on: older workdirs resume
        dc.pop("correction")
        dc.pop("correction_rank", None)
    if dc.get("block_attention") == "bidirectional":  # likewise
        dc.pop("block_attention")
    out = {"version": IDENTITY_VERSION, "drafter_config": dc, "target": str(target_name),
           "loss": str(loss)}
    if tap_rms_scaling:
        out["tap_rms_scaling"] = True
    return out


def _diff(a: Mapping, b: Mapping, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b), key=str):
        va, vb = a.get(k, "<absent>"), b.get(k, "<absent>")
        if isinstance(va, Mapping) and isinstance(vb, Mapping):
            out += _diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: workdir has {va!r}, this run has {vb!r}")
    return out


def _read_json(path: str) -> Any:
    return json.loads(paths.read_text(path))


def _checkpoint_steps(ckpt_dir: str) -> list[int]:
    if not paths.isdir(ckpt_dir):
        return []
    return sorted(int(n) for n in paths.listdir(ckpt_dir) if n.isdigit())


COMMIT_FILE = "commit_success.txt"  # orbax's mark of a finished step on an object store


def finished_steps(ckpt_dir: str) -> list[int]:
    """The steps whose checkpoint is complete on disk, read from the folder (not from the
    manager, which counts a save still in flight, or one that failed in the background):
    locally a step folder gets its name only once finished (a save cut short stays
    `N.orbax-checkpoint-tmp`); on an object store it holds orbax's commit file."""
    steps = _checkpoint_steps(ckpt_dir)
    if paths.is_local(ckpt_dir):
        return steps
    return [s for s in steps if paths.exists(paths.join(ckpt_dir, str(s), COMMIT_FILE))]


# ---- I/O failures, whichever layer reports them ------------------------------------------------

# TensorStore (orbax's array writer) reports a failed write as a ValueError such as
# 'RESOURCE_EXHAUSTED: ... Failed writing: "PATH": ... No space left on device
# [os_error_code='28']': the OSError behind it, rebuilt from the message.
_OS_ERROR_CODE = re.compile(r"\[os_error_code='?(\d+)'?\]")
_FAILED_PATH = re.compile(r'(?:Failed writing|Error writing local file|Error opening file|'
                          r'local file): "([^"]+)"')


def os_error_in(e: Optional[BaseException]) -> Optional[OSError]:
    """The OSError behind `e` (itself, or in its cause / context chain), if any; a
    TensorStore error carrying an OS error code counts as that OSError."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        code = _OS_ERROR_CODE.search(str(e)) if isinstance(e, Exception) else None
        if code is not None:
            number = int(code.group(1))
            where = _FAILED_PATH.search(str(e))
            return OSError(number, os.strerror(number), *([where.group(1)] if where else []))
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


class _QuietBackgroundIOErrors(logging.Filter):
    """Drops the ERROR records (with their tracebacks) that orbax's background save
    threads and asyncio log when a checkpoint write fails for an I/O reason, e.g. a full
    disk: one failed save logged some 30 tracebacks, burying the trainer's one-line
    error. The main thread gets the same exception at the next save or wait, and the
    trainer reports it in one line (TrainingIOError); `--debug` / DBLAST_DEBUG=1 keeps
    the records."""

    def __init__(self):
        super().__init__()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        from dblast_jax.errors import debug_enabled  # errors imports io, not train
        if debug_enabled():
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if os_error_in(exc) is None and _OS_ERROR_CODE.search(record.getMessage()) is None \
                and "No space left on device" not in record.getMessage():
            return True
        self.dropped += 1
        return False


_QUIET = _QuietBackgroundIOErrors()
_QUIET_LOGGERS = ("absl", "asyncio")  # orbax logs through absl; asyncio's "exception was
_quiet_users = 0                      # never retrieved" for a failed gather
_quiet_lock = threading.Lock()


def _quiet_background_errors(on: bool) -> None:
    """Install (on) / remove (off, after the last Checkpointer closed) the filter."""
    global _quiet_users
    with _quiet_lock:
        _quiet_users += 1 if on else -1
        for name in _QUIET_LOGGERS:
            logger = logging.getLogger(name)
            if _quiet_users > 0 and _QUIET not in logger.filters:
                logger.addFilter(_QUIET)
            elif _quiet_users <= 0 and _QUIET in logger.filters:
                logger.removeFilter(_QUIET)
        _quiet_users = max(_quiet_users, 0)


def check_workdir(workdir: str, identity: Mapping[str, Any]) -> bool:
    """Raise ForeignCheckpointError if `workdir` belongs to another experiment.
    Returns True when it already belongs to this one (a resume), False when fresh."""
    id_path = paths.join(workdir, IDENTITY_FILE)
    ckpt_dir = paths.join(workdir, CHECKPOINT_DIR)
    if paths.exists(id_path):
        try:
            theirs = _read_json(id_path)
        except (OSError, json.JSONDecodeError) as e:
            raise ForeignCheckpointError(f"{id_path} is unreadable ({e}); refusing to touch "
                                         f"workdir {workdir!r}") from None
        diff = _diff(theirs, dict(identity))
        if diff:
            raise ForeignCheckpointError(
                f"workdir {workdir!r} holds another experiment's checkpoint "
                f"({theirs.get('drafter_config', {}).get('num_categories', '?')} categories, "
                f"loss {theirs.get('loss')!r}, target {theirs.get('target')!r}); nothing was "
                "overwritten. Differences: " + "; ".join(diff[:8])
                + (" ..." if len(diff) > 8 else "") + ". Use another --workdir.")
        return True
    steps = _checkpoint_steps(ckpt_dir)
    if steps:
        item = paths.join(ckpt_dir, str(steps[-1]), "experiment")
        raise ForeignCheckpointError(
            f"workdir {workdir!r} holds checkpoints (steps {steps}) but no {IDENTITY_FILE}; "
            f"they are not this run's ({'identity item at ' + item if paths.exists(item) else 'no identity recorded'}). "
            "Nothing was overwritten; use another --workdir.")
    return False


def read_log_rows(path: str, log: Optional[Callable[[str], None]] = None
                  ) -> tuple[list[dict[str, Any]], list[str], bool]:
    """The rows of an append-only JSON-lines log (metrics.jsonl, validation.jsonl):
    (rows, their lines without the newline, whether a cut last line was dropped). A last
    line that does not parse (a write cut short by a crash or a full disk) is dropped and
    `log` gets one line saying so; a line before it that does not parse is an error
    naming the file and the line."""
    text = paths.read_bytes(path).decode("utf-8", errors="replace")
    lines = text.split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    rows, kept, dropped = [], [], False
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if n == len(lines):
                dropped = True
                if log is not None:
                    log(f"{path}: dropped its incomplete last line {n} (a write cut short "
                        "by a crash or a full disk); that step is redone")
                break
            raise ValueError(f"{path}:{n}: corrupt line in the middle of the log ({e}); "
                             f"remove or repair line {n} (only a cut last line is dropped "
                             "automatically), then rerun") from None
        rows.append(row)
        kept.append(line)
    return rows, kept, dropped


def read_train_config(workdir: str) -> Optional[dict[str, Any]]:
    path = paths.join(workdir, CONFIG_FILE)
    return _read_json(path) if paths.exists(path) else None


def _is_primary() -> bool:
    return jax.process_index() == 0


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def _atomic_write_json(path: str, obj: Any) -> None:
    paths.atomic_write_json(path, obj, indent=1, sort_keys=True)


# ---- per-process data-iterator state as an orbax item ---------------------------------------

class DataStateHandler:
    """Orbax checkpoint handler: every process writes its data iterator's JSON state to
    `process_{i}-of-{n}.json`. A state marked {"global": true} is the same on every
    process, so it restores under another process count too."""

    def save(self, directory: epath.Path, item: Any = None, args: Any = None):
        state = item if item is not None else args.state
        i, n = jax.process_index(), jax.process_count()
        (directory / f"process_{i}-of-{n}.json").write_text(json.dumps(state, sort_keys=True))

    def restore(self, directory: epath.Path, item: Any = None, args: Any = None):
        i, n = jax.process_index(), jax.process_count()
        own = directory / f"process_{i}-of-{n}.json"
        if own.exists():
            return json.loads(own.read_text())
        others = sorted(p for p in directory.iterdir() if p.name.startswith("process_"))
        for p in others:
            state = json.loads(p.read_text())
            if isinstance(state, Mapping) and state.get("global"):
                return state
        raise ValueError(f"{directory}: no data state for process {i} of {n} (found "
                         f"{[p.name for p in others]}); the data iterator is per-process and "
                         "the process count changed")

    def metadata(self, directory):
        return None

    def structure(self, directory):
        return None

    def finalize(self, directory):
        pass

    def close(self):
        pass

    @classmethod
    def typestr(cls):
        return f"{cls.__module__}.{cls.__qualname__}"


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataStateSave(ocp.args.CheckpointArgs):
    state: Any


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataStateRestore(ocp.args.CheckpointArgs):
    state: Any = None


# ---- the manager ----------------------------------------------------------------------------

class Checkpointer:
    """Orbax CheckpointManager over workdir/checkpoints with the identity guard.

    Construction checks the workdir (ForeignCheckpointError before any write), then the
    primary process records the identity and the train config."""

    def __init__(self, workdir: str, identity: Mapping[str, Any], *, keep: int,
                 train_config: Optional[Mapping[str, Any]] = None, async_save: bool = True):
        self.workdir = paths.normalize(workdir)
        self.identity = dict(identity)
        self.resuming = check_workdir(self.workdir, self.identity)
        _barrier("dblast_checkpoint_checked")
        if _is_primary():
            paths.makedirs(self.workdir)
            if not self.resuming:
                _atomic_write_json(paths.join(self.workdir, IDENTITY_FILE), self.identity)
            if train_config is not None:
                _atomic_write_json(paths.join(self.workdir, CONFIG_FILE), dict(train_config))
        _barrier("dblast_checkpoint_identity")
        self.directory = paths.join(self.workdir, CHECKPOINT_DIR)
        # A save cut short (kill, full disk) leaves <step>.orbax-checkpoint-tmp behind:
        # never a step (latest_step ignores it); removed here so the step can be saved again.
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save,
                                               cleanup_tmp_directories=True)
        self.manager = ocp.CheckpointManager(paths.as_path(self.directory), options=options)
        self.saving: Optional[int] = None  # the step whose (async) save may be in flight
        self.failed_step: Optional[int] = None  # the step whose save raised
        self._quiet = True
        _quiet_background_errors(True)

    def write_train_config(self, train_config: Mapping[str, Any]) -> None:
        """Record the run's TrainConfig (primary process); the trainer calls this once the
        checkpoint has been restored, so a refused resume rewrites nothing."""
        if _is_primary():
            _atomic_write_json(paths.join(self.workdir, CONFIG_FILE), dict(train_config))
        _barrier("dblast_checkpoint_config")

    def latest_step(self) -> Optional[int]:
        """The newest step the manager knows of: a save still in flight (or failed in
        the background) counts; `last_finished_step` reads the disk instead."""
        return self.manager.latest_step()

    def last_finished_step(self) -> Optional[int]:
        """The newest checkpoint complete on disk: the step a rerun resumes from."""
        steps = finished_steps(self.directory)
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, data_state: Any) -> None:
        """Save (async for arrays); `state` is a pytree of jax arrays. The previous save
        is finished first: its failure (a full disk in the background) raises here, with
        `failed_step` naming it."""
        self.wait()
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  data=DataStateSave(data_state),
                                  experiment=ocp.args.JsonSave(self.identity))
        self.saving = int(step)
        try:
            self.manager.save(int(step), args=args, force=True)
        except BaseException:
            self.failed_step = int(step)
            raise

    def restore(self, abstract_state: Any, step: Optional[int] = None) -> tuple[Any, Any]:
        """(state, data_state) of `step` (default: the latest). `abstract_state`: a pytree
        of jax.ShapeDtypeStruct with shardings, as the restored arrays should be placed."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                  data=DataStateRestore(),
                                  experiment=ocp.args.JsonRestore())
        out = self.manager.restore(int(step), args=args)
        diff = _diff(dict(out.experiment), self.identity)
        if diff:
            raise ForeignCheckpointError(f"checkpoint {self.directory}/{step} belongs to "
                                         f"another experiment: {'; '.join(diff[:8])}")
        return out.state, out.data

    def wait(self) -> None:
        try:
            self.manager.wait_until_finished()
        except BaseException:
            self.failed_step = self.saving
            raise
        self.saving = None

    def close(self) -> None:
        try:
            self.manager.wait_until_finished()
            self.manager.close()
        finally:
            # after a failed save the filter stays: asyncio logs a failed gather when the
            # future is collected, which may be after this
            if self._quiet and self.failed_step is None:
                self._quiet = False
                _quiet_background_errors(False)
