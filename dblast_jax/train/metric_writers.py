"""Live metrics: the rows of metrics.jsonl / validation.jsonl as TensorBoard and W&B scalars.

The JSON lines in the workdir stay the record of a run; these writers only make the same
numbers watchable while it runs. One small interface, `MetricWriter`
(`write_scalars(step, scalars)`, `flush()`, `close()`), three implementations:

* `TensorBoardWriter`: event files through tensorboardX (pure Python, no TensorFlow);
  view them with `tensorboard --logdir WORKDIR/tensorboard`.
* `WandbWriter`: a Weights & Biases run; `wandb` is optional and imported only when one
  is asked for (missing: an ImportError naming `pip install wandb`).
* `FanOutWriter`: the same scalars to several writers.

`scalar_items` decides what a row contributes: finite ints / floats as they are, 1-D
lists of numbers (per-position `top1`, `accept_prefix`, per-branch `branch_usage`) as
`key/0`, `key/1`, ...; anything else (strings, bools, None, nested lists) and non-finite
values are skipped, never an error. Only the primary process (jax.process_index() == 0)
writes, like the JSON lines: the others get writers that do nothing.
"""

from __future__ import annotations

import math
import numbers
import os
import time
from typing import Any, Iterator, Mapping, Optional, Sequence

from dblast_jax.io import paths

__all__ = ["MetricWriter", "NullWriter", "TensorBoardWriter", "WandbWriter", "FanOutWriter",
           "scalar_items", "make_train_writer", "TENSORBOARD_DIR", "WANDB_MISSING"]

TENSORBOARD_DIR = "tensorboard"  # WORKDIR/tensorboard, beside metrics.jsonl
WANDB_MISSING = ("Weights & Biases logging (wandb_project={project!r}) needs the wandb "
                 "package: pip install wandb (or set wandb_project= empty to turn it off)")
_SKIP_KEYS = ("step",)  # the x-axis, not a scalar


def _is_primary(primary: Optional[bool]) -> bool:
    if primary is not None:
        return bool(primary)
    import jax
    return jax.process_index() == 0


def _number(v: Any) -> Optional[float]:
    """A finite real number as float; None for anything else (bools are not numbers here)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        # numpy scalars are numbers.Real; 0-d arrays are not: take their item
        item = getattr(v, "item", None)
        if item is None or getattr(v, "shape", None) != ():
            return None
        v = item()
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            return None
    f = float(v)
    return f if math.isfinite(f) else None


def scalar_items(scalars: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """(tag, value) for every finite number of a metrics row (see the module doc); tags
    are `prefix/key` (or `key` without a prefix); "step" is skipped."""
    head = f"{prefix}/" if prefix else ""
    for key, value in scalars.items():
        if key in _SKIP_KEYS:
            continue
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                f = _number(v)
                if f is not None:
                    yield f"{head}{key}/{i}", f
            continue
        f = _number(value)
        if f is not None:
            yield f"{head}{key}", f


class MetricWriter:
    """Scalars against a step. Subclasses implement `_write`; `write_scalars` filters."""

    def write_scalars(self, step: int, scalars: Mapping[str, Any], prefix: str = "") -> None:
        items = dict(scalar_items(scalars, prefix))
        if items:
            self._write(int(step), items)

    def _write(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "MetricWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NullWriter(MetricWriter):
    """Writes nothing (the non-primary processes, or every sink turned off)."""

    def _write(self, step: int, scalars: dict[str, float]) -> None:
        pass


def check_tensorboard_logdir(logdir: str) -> None:
    """tensorboardX writes event files locally, to gs:// through google-cloud-storage
    (each flush re-uploads the file as one object) and to s3:// through boto3; any other
    URI, or gs:// without that package, is refused here, before the first step."""
    if paths.is_local(logdir):
        return
    scheme = logdir.split("://", 1)[0].lower()
    needs = {"gs": ("google.cloud.storage", "google-cloud-storage"), "s3": ("boto3", "boto3")}
    if scheme not in needs:
        raise ValueError(f"TensorBoard event files cannot be written to {logdir!r} "
                         "(tensorboardX writes local folders, gs:// and s3:// only): use a "
                         "local or FUSE-mounted workdir, or tensorboard=false")
    module, package = needs[scheme]
    import importlib.util
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ImportError(f"TensorBoard event files to {logdir!r} need {package} "
                          f"(pip install {package}; tensorboardX uploads with it); or set "
                          "tensorboard=false, or use a local / gcsfuse-mounted workdir")


class TensorBoardWriter(MetricWriter):
    """TensorBoard event files in `logdir` (tensorboardX; created at the first write, so
    a run that logs nothing leaves no file). `purge_step`: TensorBoard hides the events of
    earlier files in this folder at steps >= it (a resumed run redoes those steps, so
    the curves show each step once). `flush_secs`: how stale a live view may be."""

    def __init__(self, logdir: str, *, purge_step: Optional[int] = None,
                 flush_secs: int = 10, primary: Optional[bool] = None):
        self.logdir = os.fspath(logdir)
        self.purge_step = purge_step
        self.flush_secs = flush_secs
        self.primary = _is_primary(primary)
        self._writer = None
        if self.primary:
            check_tensorboard_logdir(self.logdir)

    def _summary_writer(self):
        if self._writer is None:
            from tensorboardX import SummaryWriter
            if paths.is_local(self.logdir):  # gs://: objects, no folders to create
                os.makedirs(self.logdir, exist_ok=True)
            # tensorboardX names a file by the second it opened ('wb'): a restart within
            # the same second would overwrite the previous file; the nanosecond suffix
            # keeps both, in start order (TensorBoard reads the files sorted by name)
            self._writer = SummaryWriter(self.logdir, purge_step=self.purge_step,
                                         flush_secs=self.flush_secs,
                                         filename_suffix=f".{time.time_ns()}")
        return self._writer

    def _write(self, step: int, scalars: dict[str, float]) -> None:
        if not self.primary:
            return
        writer = self._summary_writer()
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()


class WandbWriter(MetricWriter):
    """A Weights & Biases run (`wandb.init(project=..., name=..., config=..., dir=...)`
    at construction, `run.log(scalars, step=step)`, `run.finish()` at close). Each start
    of a training run (a resume too) is its own W&B run, from the resumed step on: W&B
    drops steps lower than those it already has, so continuing one W&B run across a
    resume that redoes steps would lose them (`init_kw` may still pass id= and
    resume="allow")."""

    def __init__(self, project: str, *, name: str = "", config: Optional[Mapping] = None,
                 dir: Optional[str] = None, primary: Optional[bool] = None, **init_kw: Any):
        self.project = project
        self._run = None
        if not _is_primary(primary):
            return
        try:
            import wandb
        except ImportError:
            raise ImportError(WANDB_MISSING.format(project=project)) from None
        if dir is not None:
            os.makedirs(dir, exist_ok=True)
        self._run = wandb.init(project=project, name=name or None,
                               config=dict(config) if config is not None else None,
                               dir=dir, **init_kw)

    def _write(self, step: int, scalars: dict[str, float]) -> None:
        if self._run is not None:
            self._run.log(scalars, step=step)

    def close(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            run.finish()


class FanOutWriter(MetricWriter):
    """The same scalars to every writer; close() closes them all (the first error is
    raised after the others were closed)."""

    def __init__(self, writers: Sequence[MetricWriter]):
        self.writers = list(writers)

    def write_scalars(self, step: int, scalars: Mapping[str, Any], prefix: str = "") -> None:
        for w in self.writers:
            w.write_scalars(step, scalars, prefix)

    def _write(self, step: int, scalars: dict[str, float]) -> None:
        for w in self.writers:
            w._write(step, scalars)

    def flush(self) -> None:
        for w in self.writers:
            w.flush()

    def close(self) -> None:
        error = None
        for w in self.writers:
            try:
                w.close()
            except Exception as e:  # noqa: BLE001 -- close the rest, then raise
                error = error or e
        if error is not None:
            raise error


def make_train_writer(config: Any, workdir: str, *, start_step: int = 0,
                      primary: Optional[bool] = None) -> MetricWriter:
    """The writers a TrainConfig asks for: TensorBoard in WORKDIR/tensorboard
    (`config.tensorboard`), W&B (`config.wandb_project`, `config.wandb_run_name`; files
    under WORKDIR/wandb). A resumed run (start_step > 0) purges TensorBoard events past
    its checkpoint, as the JSON lines drop their rows past it."""
    primary = _is_primary(primary)
    if not primary:
        return NullWriter()
    writers: list[MetricWriter] = []
    if getattr(config, "tensorboard", False):
        writers.append(TensorBoardWriter(paths.join(workdir, TENSORBOARD_DIR),
                                         purge_step=int(start_step) + 1, primary=True))
    project = getattr(config, "wandb_project", "")
    if project:
        writers.append(WandbWriter(project, name=getattr(config, "wandb_run_name", ""),
                                   config=config.to_dict() if hasattr(config, "to_dict")
                                   else None,
                                   # W&B keeps its run files in a local folder: a gs://
                                   # workdir leaves them in W&B's default (./wandb)
                                   dir=workdir if paths.is_local(workdir) else None,
                                   primary=True))
    if not writers:
        return NullWriter()
    return writers[0] if len(writers) == 1 else FanOutWriter(writers)
