"""Carry an unfinished training run to another machine, and resume it there exactly.

A workdir on local disk dies with its machine; a run longer than a machine's lifetime
(a 10,000-step comparison run on a 3-hour CPU session, a preemptible VM) can still finish
if its state travels through something that lasts (a git checkout, a mounted bucket).
`pack_run` copies the workdir's newest *finished* checkpoint (params, optimizer state,
step, RNG, the data iterator's state) and its small files (identity, config, logs) into
one folder with a sha256 manifest; `unpack_run` checks every file against it and puts
them back into a workdir, where the trainer resumes from that step bit-exactly, as from
a kill on the same machine. Older checkpoints, feature caches (rebuilt where missing),
exports and TensorBoard event files stay behind; metrics.jsonl, which travels, holds
every logged step. A SmolLM2 drafter's carried run is ~56 MB (K = 1 + a correction head)
to ~62 MB (K = 4): float32 params and the two Adam moments.

    pack:    WORKDIR/{experiment.json, train_config.json, metrics.jsonl, ...}
             WORKDIR/checkpoints/<newest finished step>/...
      ->     DEST/carried_run.json  (step, sha256 and size of every file)
             DEST/files/...          (the same relative paths)
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

from dblast_jax.io.atomic import atomic_write_json
from dblast_jax.pretrained import file_sha256
from dblast_jax.train.checkpoint import (CHECKPOINT_DIR, CONFIG_FILE, IDENTITY_FILE,
                                         finished_steps)

MANIFEST = "carried_run.json"
FILES = "files"
FORMAT = 1
# workdir entries never carried: the writer's lock, and what is rebuilt or not needed to
# resume (older checkpoints are skipped by taking the newest step only)
_SKIP_TOP = {".lock", CHECKPOINT_DIR, "export"}

__all__ = ["CarryError", "pack_run", "unpack_run", "carried_step", "MANIFEST"]


class CarryError(ValueError):
    """A carried run that cannot be packed or resumed as it is (clear message, nothing
    in the workdir changed)."""


def _files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _carried_paths(workdir: Path, step: int) -> list[Path]:
    """Relative paths carried from `workdir` for checkpoint `step`."""
    top = [p.relative_to(workdir) for p in sorted(workdir.iterdir())
           if p.is_file() and p.name not in _SKIP_TOP and not p.name.endswith(".tmp")]
    ckpt = workdir / CHECKPOINT_DIR / str(step)
    return top + [p.relative_to(workdir) for p in _files_under(ckpt)]


def carried_step(src: os.PathLike | str) -> Optional[int]:
    """The step a carried run resumes from, or None where `src` holds none."""
    path = Path(src) / MANIFEST
    if not path.is_file():
        return None
    return int(json.loads(path.read_text())["step"])


def pack_run(workdir: os.PathLike | str, dest: os.PathLike | str, *,
             log: Callable[[str], None] = print, attempts: int = 3) -> int:
    """Copy `workdir`'s newest finished checkpoint and small files into `dest`: an absent
    or empty folder, or an earlier carried run (replaced whole: a reader sees the old
    carried run or the new one); anything else is refused, never overwritten. Safe beside
    the trainer that writes the workdir: a checkpoint it deletes mid-copy
    (keep_checkpoints) is retried with the newer one. Returns the carried step."""
    workdir, dest = Path(workdir), Path(dest)
    if dest.exists() and not (dest / MANIFEST).is_file() and (
            not dest.is_dir() or any(dest.iterdir())):
        raise CarryError(f"carry destination {dest} exists and holds no carried run "
                         f"({MANIFEST}); give an absent or empty folder, or an earlier "
                         "carried run to replace")
    if not (workdir / IDENTITY_FILE).is_file():
        raise CarryError(f"{workdir} is not a training workdir (no {IDENTITY_FILE})")
    if dest.resolve() == workdir.resolve() or workdir.resolve() in dest.resolve().parents:
        raise CarryError(f"carry destination {dest} must lie outside the workdir {workdir}")
    tmp = dest.with_name(dest.name + ".tmp")
    for attempt in range(attempts):
        steps = finished_steps(str(workdir / CHECKPOINT_DIR))
        if not steps:
            raise CarryError(f"{workdir} has no finished checkpoint to carry (train past "
                             "the first checkpoint_every steps first)")
        step = steps[-1]
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            entries = {}
            for rel in _carried_paths(workdir, step):
                out = tmp / FILES / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(workdir / rel, out)
                entries[str(rel)] = {"sha256": file_sha256(out), "bytes": out.stat().st_size}
        except FileNotFoundError:
            if attempt + 1 == attempts:
                raise
            log(f"checkpoint {step} of {workdir} went away while being copied; retrying")
            time.sleep(1.0)
            continue
        break
    if not any(rel.startswith(f"{CHECKPOINT_DIR}/") for rel in entries):
        raise CarryError(f"checkpoint {step} of {workdir} holds no files")
    atomic_write_json(tmp / MANIFEST, {"format": FORMAT, "step": step, "files": entries,
                                       "workdir": workdir.name})
    old = dest.with_name(dest.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)
    total = sum(e["bytes"] for e in entries.values())
    log(f"carried {workdir} at step {step} to {dest} ({len(entries)} files, "
        f"{total / 2**20:.1f} MiB)")
    return step


def unpack_run(src: os.PathLike | str, workdir: os.PathLike | str, *,
               log: Callable[[str], None] = print) -> Optional[int]:
    """Put a carried run back into `workdir` so the trainer resumes from its step.
    Every file is checked against the manifest first (a missing or altered file is an
    error and nothing is written). A workdir already at or past the carried step is left
    alone (returns None); one behind it, or empty, gets the carried checkpoint beside its
    own and the carried logs and config (which match that checkpoint). The workdir's
    identity must be the carried one's. Returns the step the run now resumes from."""
    src, workdir = Path(src), Path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise CarryError(f"{workdir} is a file, not a workdir folder")
    manifest_path = src / MANIFEST
    if not manifest_path.is_file():
        raise CarryError(f"{src} holds no carried run ({MANIFEST} is missing)")
    try:
        manifest = json.loads(manifest_path.read_text())
        step, entries = int(manifest["step"]), dict(manifest["files"])
    except (ValueError, KeyError, TypeError) as e:
        raise CarryError(f"{manifest_path} is corrupt ({e}); carry the run again") from None
    if manifest.get("format") != FORMAT:
        raise CarryError(f"{manifest_path}: format {manifest.get('format')!r}, this "
                         f"version reads {FORMAT}")
    for rel, entry in entries.items():
        path = src / FILES / rel
        if not path.is_file():
            raise CarryError(f"carried run {src} is missing {rel}; nothing was unpacked")
        if path.stat().st_size != entry["bytes"] or file_sha256(path) != entry["sha256"]:
            raise CarryError(f"carried run {src}: {rel} does not match its sha256 in "
                             f"{MANIFEST} (corrupt or altered); nothing was unpacked")
    identity = src / FILES / IDENTITY_FILE
    if (workdir / IDENTITY_FILE).is_file() and identity.is_file():
        if json.loads(identity.read_text()) != json.loads((workdir / IDENTITY_FILE).read_text()):
            raise CarryError(f"{workdir} holds another experiment than the run carried in "
                             f"{src} ({IDENTITY_FILE} differs); unpack into an empty workdir")
    have = finished_steps(str(workdir / CHECKPOINT_DIR))
    if have and have[-1] >= step:
        log(f"{workdir} is at step {have[-1]}, at or past the carried step {step}: "
            "left as it is")
        return None
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt_prefix = f"{CHECKPOINT_DIR}/{step}/"
    staging = workdir / CHECKPOINT_DIR / f"{step}.carried-tmp"
    shutil.rmtree(staging, ignore_errors=True)
    for rel in entries:
        if rel.startswith(ckpt_prefix):
            out = staging / rel[len(ckpt_prefix):]
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / FILES / rel, out)
    os.replace(staging, workdir / CHECKPOINT_DIR / str(step))  # the step appears whole
    for rel in entries:  # the small files last: they describe the checkpoint now present
        if not rel.startswith(f"{CHECKPOINT_DIR}/"):
            tmp = workdir / (rel + ".carried-tmp")
            shutil.copyfile(src / FILES / rel, tmp)
            os.replace(tmp, workdir / rel)
    log(f"unpacked the run carried in {src} into {workdir}: it resumes from step {step}")
    return step
