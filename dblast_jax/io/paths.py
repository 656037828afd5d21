"""Paths that may be local folders or object-store URIs (`gs://bucket/run`, ...).

Training workdirs, their logs and checkpoints, and drafter exports go through here (and
through `etils.epath`, which orbax uses too), so each may be a `gs://` path directly. A
path without a URI scheme is local and keeps the plain-file behaviour it always had
(`open`, `os.replace`, fsync, flock); plain `open` / `os.makedirs` elsewhere is for local
scratch only.

Writes:
  * `atomic_write_bytes/_text/_json`: local -- temp file in the same folder, fsync,
    the umask's usual mode, `os.replace`, fsync of the folder (dblast_jax.io.atomic);
    object store -- the whole object in one `write_bytes` call: a single-object upload is
    atomic there (readers see the old object or the new one), while a "rename" is a copy
    plus a delete and is not, so no temporary object is used.
  * `append_text` (the JSON-lines logs metrics.jsonl / validation.jsonl): local -- an
    append (`open(path, "a")`), as before; object store -- objects cannot be appended to,
    so the whole log is read, extended and rewritten as one object on every flush. That
    is O(size) per row, fine for logs of a few MB (one row per `log_every` steps); a cut
    rewrite leaves the previous version, never half a line.

Regenerated corpora (dblast_jax/data/corpus.py, regenerate.py) may be on gs:// too: their
shards, `.done.json` records and manifest are written with the helpers here, and a shard
is read whole into memory (`corpus.as_folder` gives epath paths for URIs).

What still needs a local (or FUSE-mounted) path: feature caches (`np.load(mmap_mode)`
needs a real file), `.jsonl` data files, TFDS copies of a corpus, evaluation and
`dblast validate --out` folders (refused on gs://), and the W&B run folder; see
`require_local`.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Union

from etils import epath

from dblast_jax.io import atomic as _atomic

__all__ = ["PathLike", "as_path", "is_local", "normalize", "join", "exists", "isdir",
           "isfile", "listdir", "makedirs", "read_bytes", "read_text", "atomic_write_bytes",
           "atomic_write_text", "atomic_write_json", "append_text", "require_local",
           "missing_backend"]

PathLike = Union[str, os.PathLike]

# "gs://", "s3://", "file://" ... (a Windows drive letter "C:\\" has no "//")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def _str(path: PathLike) -> str:
    return os.fspath(path) if not isinstance(path, str) else path


def is_local(path: PathLike) -> bool:
    """True for a path on this machine's file system (no URI scheme); False for
    `gs://...` and other object-store URIs. A gcsfuse mount point is local."""
    return _SCHEME.match(_str(path)) is None


def as_path(path: PathLike) -> epath.Path:
    """`path` as an `etils.epath.Path` (gs://, s3://, ... or local)."""
    return epath.Path(path)


def normalize(path: PathLike) -> str:
    """The canonical string of `path`: local -> absolute (os.path.abspath, as before);
    an URI -> as epath spells it (one slash between parts, none at the end)."""
    text = _str(path)
    if is_local(text):
        return os.path.abspath(text)
    return str(as_path(text))


def join(base: PathLike, *parts: str) -> str:
    """`os.path.join` for local paths, the URI's own join otherwise (a string)."""
    if is_local(base):
        return os.path.join(_str(base), *parts)
    return str(as_path(base).joinpath(*parts))


def exists(path: PathLike) -> bool:
    return os.path.exists(path) if is_local(path) else as_path(path).exists()


def isdir(path: PathLike) -> bool:
    return os.path.isdir(path) if is_local(path) else as_path(path).is_dir()


def isfile(path: PathLike) -> bool:
    return os.path.isfile(path) if is_local(path) else as_path(path).is_file()


def listdir(path: PathLike) -> list[str]:
    if is_local(path):
        return os.listdir(path)
    return [p.name for p in as_path(path).iterdir()]


def makedirs(path: PathLike) -> None:
    """Create `path` and its parents (exist_ok). On an object store folders are only
    prefixes; the call is cheap and harmless there."""
    if is_local(path):
        os.makedirs(path, exist_ok=True)
    else:
        as_path(path).mkdir(parents=True, exist_ok=True)


def read_bytes(path: PathLike) -> bytes:
    if is_local(path):
        with open(path, "rb") as f:
            return f.read()
    return as_path(path).read_bytes()


def read_text(path: PathLike, encoding: str = "utf-8") -> str:
    return read_bytes(path).decode(encoding)


def _write_object(path: PathLike, data: bytes) -> None:
    """One object written in one call (atomic on object stores); parents first (a no-op
    on GCS, needed by the test double and by FUSE-like backends)."""
    p = as_path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    """Readers see the old content or the new one, never half: see the module doc."""
    if is_local(path):
        _atomic.local_atomic_write_bytes(path, data)
    else:
        _write_object(path, data)


def atomic_write_text(path: PathLike, text: str, encoding: str = "utf-8") -> None:
    atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: PathLike, obj: Any, *, indent: int | None = 2,
                      sort_keys: bool = False) -> None:
    """`obj` as JSON (plus a final newline); serialised before anything is written."""
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n")


def append_text(path: PathLike, text: str, encoding: str = "utf-8") -> None:
    """Append `text` to a log: a plain append locally; on an object store the whole
    object is rewritten (read + extend + one write), since objects cannot be appended."""
    if is_local(path):
        with open(path, "a", encoding=encoding) as f:
            f.write(text)
        return
    p = as_path(path)
    old = p.read_bytes() if p.exists() else b""
    _write_object(p, old + text.encode(encoding))


def require_local(path: PathLike, what: str, hint: str = "") -> None:
    """Refuse an object-store URI where only a local file will do (ValueError)."""
    if not is_local(path):
        raise ValueError(f"{what} must be a local path (or a gcsfuse mount), got "
                         f"{_str(path)!r}" + (f": {hint}" if hint else ""))


# The package an object-store scheme needs (epath goes through fsspec, which raises
# "ImportError: Please install gcsfs to access Google Storage" at the first call), and
# how to get it.
_BACKEND_INSTALL = {"gcsfs": "pip install 'dblast_jax[gcs]'", "s3fs": "pip install s3fs"}
_PLEASE_INSTALL = re.compile(r"[Pp]lease install (\S+?)(?: to access|\b)")


def missing_backend(err: BaseException, path: str = "") -> str | None:
    """The one-line message for an object-store path used without its file-system package
    (gs:// without the `gcs` extra), or None when `err` is something else. `path`, when
    known, leads the message."""
    if not isinstance(err, ImportError):
        return None
    match = _PLEASE_INSTALL.search(str(err))
    name = match.group(1) if match else getattr(err, "name", None)
    if name not in _BACKEND_INSTALL:
        return None
    scheme = _SCHEME.match(path).group(0) if path and _SCHEME.match(path) else {
        "gcsfs": "gs://", "s3fs": "s3://"}[name]
    where = f"{path}: " if path else ""
    extra = " (the gcs extra)" if name == "gcsfs" else ""
    return (f"{where}{scheme} paths need the {name} package{extra}, which is not installed: "
            f"{_BACKEND_INSTALL[name]}, or use a local (or gcsfuse-mounted) folder")
