"""A training workdir's drafter restored onto any topology (export, evaluation).

A checkpoint is written by orbax with the training mesh's shardings (say data = 8). To
read it elsewhere -- one CPU, a GPU with 2 devices, another mesh -- nothing of the
training run is rebuilt: the saved TrainConfig (train_config.json) and the recorded
drafter shape (experiment.json) give the drafter's abstract parameters, the project's
partition rules (sharding.DRAFTER_RULES) give their shardings on a mesh over the devices
present now, and orbax reads only the `params` of the checkpoint's train state
(optimizer state, data iterator state and the training data are not touched) straight
into those shardings. Neither the target's weights nor the training data are needed.

    restored = restore_drafter(workdir)              # mesh: fits the devices present
    restored = restore_drafter(workdir, mesh=make_mesh(1, 2, 1))
    export_workdir(workdir, "out", dtype="bfloat16")  # what `dblast export WORKDIR` does

While it reads, the workdir is locked like a training's (dblast_jax.workdir_lock): a
workdir that a training is writing is refused in one line naming it, rather than read
while orbax may be replacing its steps. A read-only workdir (a copied or mounted run) is
read without the lock. A `gs://` workdir (dblast_jax.io.paths) is read without one too:
object stores have no file locks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import typing
from typing import Any, Callable, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dblast_jax import errors
from dblast_jax import sharding as sharding_lib
from dblast_jax.config import DrafterConfig
from dblast_jax.dtypes import dtype_from_name
from dblast_jax.io import paths
from dblast_jax.io.dflash import export_drafter
from dblast_jax.models import drafter as drafter_lib
from dblast_jax.train import checkpoint as ckpt_lib
from dblast_jax.train.config import TrainConfig
from dblast_jax.train.trainer import NonFiniteError
from dblast_jax.workdir_lock import FolderLock, FolderLockedError

__all__ = ["RestoredDrafter", "is_training_workdir", "restore_mesh", "restore_drafter",
           "export_workdir"]

Params = dict[str, Any]


@dataclasses.dataclass
class RestoredDrafter:
    params: Params  # jax.Arrays placed on `mesh` by sharding.DRAFTER_RULES
    drafter_config: DrafterConfig
    train_config: TrainConfig
    step: int  # the checkpoint's step
    mesh: Mesh
    workdir: str

    @property
    def target_name(self) -> str:
        return self.train_config.target

    def params_host(self) -> Params:
        """The parameters as numpy on every process (gathered across processes if
        the mesh spans them)."""
        leaves = jax.tree.leaves(self.params)
        if all(x.is_fully_addressable for x in leaves):
            return jax.device_get(self.params)
        from jax.experimental import multihost_utils
        return multihost_utils.process_allgather(self.params, tiled=True)


def is_training_workdir(path: str) -> bool:
    """A folder with a train_config.json (what `dblast train --workdir` writes)."""
    return paths.isfile(paths.join(os.fspath(path), ckpt_lib.CONFIG_FILE))


def restore_mesh(mesh_shape: Optional[tuple[int, int, int]] = None,
                 devices: Optional[list] = None) -> Mesh:
    """The mesh to restore onto: `mesh_shape` (data, fsdp, tensor; e.g. the training
    config's) when the devices present fit it, else every device on the fsdp axis
    (parameters split where their dimensions divide, replicated elsewhere)."""
    devices = list(devices) if devices is not None else jax.devices()
    if mesh_shape is not None:
        try:
            return sharding_lib.make_mesh(*mesh_shape, devices=devices)
        except ValueError:
            pass
    return sharding_lib.make_mesh(1, -1, 1, devices=devices)


def _drafter_config(workdir: str, config: TrainConfig) -> tuple[DrafterConfig, dict]:
    """(the drafter's shape as the workdir recorded it in experiment.json, named as the
    run; that identity record): the target (and its weights) are not needed."""
    path = paths.join(workdir, ckpt_lib.IDENTITY_FILE)
    if not paths.isfile(path):
        raise ValueError(f"{path}: missing; {workdir} is not a complete training workdir "
                         "(experiment.json records the drafter's shape); restore it from "
                         "a copy of the run")
    identity = errors.read_json(path, fix="restore it from a copy of the run")
    stored = dict(identity.get("drafter_config") or {}) if isinstance(identity, dict) else {}
    fields = {f.name: f for f in dataclasses.fields(DrafterConfig)}
    hints = typing.get_type_hints(DrafterConfig)
    unknown = sorted(set(stored) - set(fields))
    missing = sorted(n for n, f in fields.items() if n != "name" and n not in stored
                     and f.default is dataclasses.MISSING)
    if unknown or missing:
        raise ValueError(f"{path}: drafter_config does not describe a drafter (unknown "
                         f"fields {unknown}, missing {missing}); restore the file from a "
                         "copy of the run")
    kw = {k: (tuple(v) if typing.get_origin(hints[k]) is tuple and v is not None else v)
          for k, v in stored.items()}
    return DrafterConfig(**kw, name=config.name), identity


def _take_lock(workdir: str, log: Callable[[str], None]) -> Optional[FolderLock]:
    """Process 0 locks the workdir for the read (a training writing there refuses it);
    every process hears of a refusal. A folder this process cannot write (read-only
    copy or mount) is read unlocked: no training can be writing it from here."""
    lock, refused = None, None
    if jax.process_index() == 0:
        try:
            lock = FolderLock(workdir, "export", log=log).acquire()
        except FolderLockedError as e:
            refused = e
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                refused = e
            else:
                log(f"reading {workdir} without its lock (the folder is not writable here)")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        got = multihost_utils.broadcast_one_to_all(np.int32(refused is None))
        if not int(got) and refused is None:
            refused = FolderLockedError(f"{workdir} is in use by another training "
                                        "(process 0 names it); wait for it to finish")
    if refused is not None:
        raise refused
    return lock


@contextlib.contextmanager
def _quiet_absl():
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        logger.setLevel(level)


def _restore_error(where: str, step: int, steps: list, err: BaseException) -> ValueError:
    first = errors._one_line(str(err))[:300] or type(err).__name__
    earlier = [s for s in steps if s < step]
    fallback = (f"or move {where} aside to restore step {earlier[-1]}" if earlier else
                "or retrain (no earlier checkpoint is kept)")
    return ValueError(f"cannot restore the checkpoint {where} ({type(err).__name__}: "
                      f"{first}); it is incomplete or corrupt: restore the workdir from a "
                      f"copy {fallback}")


def restore_drafter(workdir: str, *, mesh: Optional[Mesh] = None, step: Optional[int] = None,
                    log: Callable[[str], None] = print) -> RestoredDrafter:
    """The drafter parameters of a training workdir's checkpoint (default: the latest
    step) placed on `mesh` (default: `restore_mesh(config.mesh)`, i.e. the training mesh
    if the devices present fit it, else an fsdp mesh over them). Reads only the params
    of the train state; needs neither the training data, the target's weights nor the
    training's device count. Raises ValueError (one line) for a workdir without a
    checkpoint or with a corrupt one, ForeignCheckpointError when the checkpoint is not
    the workdir's experiment, FolderLockedError while a training writes there."""
    workdir = paths.normalize(workdir)
    log = log if jax.process_index() == 0 else (lambda s: None)
    saved = ckpt_lib.read_train_config(workdir)
    if saved is None:
        raise ValueError(f"{workdir} is not a training workdir (no "
                         f"{ckpt_lib.CONFIG_FILE}); pass the --workdir of `dblast train`")
    config = TrainConfig.from_dict(saved)
    dcfg, identity = _drafter_config(workdir, config)
    dtype = dtype_from_name(config.param_dtype)
    mesh = mesh if mesh is not None else restore_mesh(tuple(config.mesh))
    abstract = drafter_lib.abstract_drafter_params(dcfg, None, dtype)
    specs = drafter_lib.drafter_partition_specs(abstract, mesh)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                             is_leaf=lambda x: isinstance(x, P))
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
    restore_args = jax.tree.map(
        lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape,
                                       dtype=a.dtype), target)

    directory = paths.join(workdir, ckpt_lib.CHECKPOINT_DIR)
    lock = _take_lock(workdir, log)
    try:
        manager = None
        if ckpt_lib._checkpoint_steps(directory):
            options = ocp.CheckpointManagerOptions(read_only=True, create=False,
                                                   save_interval_steps=0)
            with _quiet_absl():  # orbax warns "Given directory is read only": intended
                manager = ocp.CheckpointManager(paths.as_path(directory), options=options)
        steps = sorted(manager.all_steps()) if manager is not None else []
        if not steps:
            if manager is not None:
                manager.close()
            raise ValueError(f"{workdir} holds no checkpoint ({directory} has no finished "
                             "step); train first (dblast train --workdir "
                             f"{workdir}) or pass another workdir")
        try:
            step = steps[-1] if step is None else int(step)
            if step not in steps:
                raise ValueError(f"{directory} has no step {step}; it holds steps {steps}")
            where = paths.join(directory, str(step))
            args = ocp.args.Composite(
                state=ocp.args.PyTreeRestore(item={"params": target},
                                             restore_args={"params": restore_args},
                                             partial_restore=True),
                experiment=ocp.args.JsonRestore())
            try:
                out = manager.restore(step, args=args)
            except (MemoryError, KeyboardInterrupt):
                raise
            except Exception as e:  # noqa: BLE001 -- orbax / tensorstore: one line instead
                if "RESOURCE_EXHAUSTED" in str(e):
                    raise
                raise _restore_error(where, step, steps, e) from e
        finally:
            manager.close()
    finally:
        if lock is not None:
            lock.release()
    diff = ckpt_lib._diff(dict(out.experiment or {}), identity)
    if diff:
        raise ckpt_lib.ForeignCheckpointError(
            f"checkpoint {where} belongs to another experiment than {workdir}'s "
            f"{ckpt_lib.IDENTITY_FILE}: {'; '.join(diff[:8])}; restore the workdir from a "
            "copy of the run")
    params = out.state["params"]
    log(f"restored {workdir} step {step} onto mesh {dict(mesh.shape)} "
        f"({mesh.size} device{'s' if mesh.size != 1 else ''})")
    return RestoredDrafter(params, dcfg, config, int(step), mesh, workdir)


def export_params(params: Any, drafter_config, folder: str, *, dtype: str,
                  force: bool = False, log: Callable[[str], None] = print) -> str:
    """The one export path of a trained drafter (Trainer.export and export_workdir):
    refuse non-finite parameters, write the DFlash layout from process 0, then a barrier.
    params: host (numpy) pytree."""
    bad = [jax.tree_util.keystr(path) for path, x in
           jax.tree_util.tree_leaves_with_path(params) if not np.all(np.isfinite(x))]
    if bad:
        raise NonFiniteError(f"refusing to export a drafter with non-finite parameters "
                             f"({', '.join(bad[:4])}) to {folder}; export an earlier "
                             "checkpoint or retrain with a lower learning_rate")
    if jax.process_index() == 0:
        export_drafter(params, drafter_config, folder, dtype=dtype, force=force)
        log(f"exported drafter to {folder}")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("dblast_export")
    return folder


def export_workdir(workdir: str, folder: str, *, dtype: Optional[str] = None,
                   force: bool = False, mesh: Optional[Mesh] = None,
                   step: Optional[int] = None, log: Callable[[str], None] = print) -> str:
    """Write a training workdir's drafter (its latest checkpoint) in the DFlash layout,
    as `Trainer.export` does at the end of a run, on whatever devices are present.
    dtype: 'float32' / 'bfloat16' (default: the training dtype); `force`: see
    io.dflash.export_drafter. Non-finite parameters are refused."""
    restored = restore_drafter(workdir, mesh=mesh, step=step, log=log)
    export_params(restored.params_host(), restored.drafter_config, folder,
                  dtype=dtype or restored.train_config.param_dtype, force=force, log=log)
    return folder
