"""Atomic file writes for the whole project: a reader sees the old or the new file, never half.

Each write goes to a temporary file in the destination's folder, which is flushed and
fsync'ed, given the mode a plain `open(path, "w")` would give (0o666 less the umask,
e.g. 0o644; `tempfile.mkstemp` alone would leave 0o600), renamed over the destination
with `os.replace`, and the folder is fsync'ed (best effort) so the rename survives a
crash. The destination's parent folders are created when missing.

An object-store destination (`gs://...`) is written as one object in one call instead
(dblast_jax.io.paths: single-object uploads are atomic there, a rename is not).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import uuid
from typing import Any, Iterator

__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_write_json", "current_umask",
           "default_file_mode", "fsync_dir", "fsync_file", "local_atomic_path",
           "make_temp_dir"]

_UMASK_LOCK = threading.Lock()


def _umask_from_proc() -> int | None:
    try:  # Linux >= 4.7 reports it without changing it
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


def current_umask() -> int:
    """The process umask. Read from /proc where possible; otherwise set-and-restore (the
    only portable way), under a lock so this module never races itself."""
    mask = _umask_from_proc()
    if mask is not None:
        return mask
    with _UMASK_LOCK:
        old = os.umask(0o022)
        os.umask(old)
    return old


def default_file_mode() -> int:
    """The mode a newly created regular file gets: 0o666 & ~umask."""
    return 0o666 & ~current_umask()


def fsync_dir(folder: str | os.PathLike) -> None:
    """fsync a folder so renames into it are durable; best effort (some platforms and
    file systems cannot open or fsync a directory)."""
    try:
        fd = os.open(os.fspath(folder), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically (temp file in the same folder, fsync, chmod to the
    umask's normal mode, os.replace, fsync the folder). On any error the temp file is
    removed and `path` is unchanged. An object-store URI (gs://...): one object write
    (dblast_jax.io.paths)."""
    from dblast_jax.io import paths  # cycle: paths imports this module
    if not paths.is_local(path):
        paths.atomic_write_bytes(path, data)
        return
    local_atomic_write_bytes(path, data)


def local_atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """atomic_write_bytes for a local path (the temp file + rename protocol above)."""
    with local_atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)


@contextlib.contextmanager
def local_atomic_path(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[str]:
    """A temporary file beside local `path` (`.{name}.XXXXXXXX{suffix}`, created empty)
    for the caller to write by name. On a clean exit it is fsync'ed, given the umask's
    normal mode and renamed over `path`, and the folder is fsync'ed; on any error (the
    caller's too) it is removed and `path` is unchanged."""
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{os.path.basename(path)}.", suffix=suffix)
    os.close(fd)
    try:
        yield tmp
        fsync_file(tmp)
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(parent)


def fsync_file(path: str | os.PathLike) -> None:
    """fsync a written (and closed) file by name."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_temp_dir(parent: str | os.PathLike, name: str, kind: str) -> str:
    """Create and return `parent/.{name}.{kind}-{pid}-{random}`: a sibling folder that a
    whole-folder write fills before renaming it into place (or moving its files in)."""
    # os.mkdir, not mkdtemp: a folder renamed into place keeps the umask's usual mode
    path = os.path.join(os.fspath(parent), f".{name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(path)
    return path


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 2,
                      sort_keys: bool = False) -> None:
    """`obj` as JSON (plus a final newline), written atomically. The text is produced
    before anything is written, so an unserialisable object leaves `path` untouched."""
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n")
