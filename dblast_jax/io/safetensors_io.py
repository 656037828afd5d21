"""Low-level safetensors access shared by the checkpoint formats (HF targets, drafters).

`SafetensorsReader` opens a single `*.safetensors` file or a sharded set described by a
`*.safetensors.index.json`, and reads tensors (or slices of them) lazily: nothing is
read until asked for, and a slice reads only the bytes it covers. `write_safetensors`
writes a dict of numpy arrays as one file or as size-bounded shards with an index.
Every library error is re-raised as `CheckpointError` naming the file involved.

Folders and files may be object-store URIs (`gs://...`, dblast_jax.io.paths): a remote
file is read by copying it to a local temporary file first (safetensors' numpy `load`
of bytes cannot decode bfloat16, and `safe_open` needs a file), and written as one
object from `safetensors.numpy.save`'s bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save, save_file

from dblast_jax.io import paths
from dblast_jax.io.atomic import default_file_mode

Index = tuple  # a tuple of slices, one per dimension

# safetensors dtype tag -> numpy dtype name (bfloat16 via ml_dtypes, which jax registers).
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
           "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
           "BOOL": "bool"}


class CheckpointError(ValueError):
    """A checkpoint folder or file is missing, corrupt, or does not match the config."""


INDEX_SUFFIX = ".safetensors.index.json"


def _path(p: str | os.PathLike):
    """A pathlib.Path for a local path (as before), an etils.epath.Path for gs://..."""
    return Path(p) if paths.is_local(p) else paths.as_path(p)


def checkpoint_files(folder: str | os.PathLike) -> tuple[list[Path], Optional[Path]]:
    """(the safetensors files that make up the checkpoint in `folder`, its index or None).

    With one `*.safetensors.index.json`, the shards its weight_map names; a
    `*.safetensors` beside them that the index does not name is refused (one loader
    would ignore it, another take it for part of the checkpoint). Without an index,
    the folder's single `*.safetensors`; several are refused, since nothing says how
    they fit together (read in turn, a later file would silently override an earlier
    one). No safetensors at all: ([], None), for the caller to word.
    """
    folder = _path(folder)
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    indexes = [n for n in names if n.endswith(INDEX_SUFFIX)]
    tensors = [n for n in names if n.endswith(".safetensors")]
    if len(indexes) > 1:
        raise CheckpointError(f"{folder} holds several safetensors indexes "
                              f"({', '.join(indexes)}); keep the one that describes the "
                              "checkpoint")
    if indexes:
        index = folder / indexes[0]
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            listed = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"index file {index} is not valid JSON with a "
                                  f"'weight_map': {e}") from e
        unlisted = [n for n in tensors if n not in listed]
        if unlisted:
            raise CheckpointError(f"{folder}: {', '.join(unlisted)} beside {index.name}, "
                                  "which does not list it; remove the file or add its "
                                  "tensors to the index")
        missing = [n for n in listed if not (folder / n).is_file()]
        if missing:
            raise CheckpointError(f"index {index} refers to shard(s) that do not exist: "
                                  f"{', '.join(missing)}")
        return [folder / n for n in listed], index
    if len(tensors) > 1:
        raise CheckpointError(f"{folder} holds several safetensors files "
                              f"({', '.join(tensors)}) and no *{INDEX_SUFFIX} to tie them "
                              "together; keep one file or add an index")
    return [folder / n for n in tensors], None


@contextlib.contextmanager
def _open_remote(path):
    """safe_open of a local temporary copy of an object-store file (removed on exit)."""
    try:
        data = paths.read_bytes(path)
    except FileNotFoundError as e:
        raise CheckpointError(f"safetensors file {path} does not exist") from e
    except OSError as e:
        raise CheckpointError(f"cannot read safetensors file {path}: {e}") from e
    with tempfile.TemporaryDirectory(prefix="dblast-safetensors-") as tmp:
        local = os.path.join(tmp, "copy.safetensors")
        with open(local, "wb") as f:
            f.write(data)
        del data
        try:
            handle = safe_open(local, framework="numpy")
        except Exception as e:
            raise CheckpointError(f"cannot read safetensors file {path} (corrupt or "
                                  f"truncated?): {e}") from e
        with handle:
            yield handle


def _open(path: Path):
    if not paths.is_local(path):
        return _open_remote(path)
    try:
        return safe_open(str(path), framework="numpy")
    except FileNotFoundError as e:
        raise CheckpointError(f"safetensors file {path} does not exist") from e
    except Exception as e:  # SafetensorError (corrupt / truncated header or data), OSError
        raise CheckpointError(f"cannot read safetensors file {path} (corrupt or truncated?): "
                              f"{e}") from e


class SafetensorsReader(contextlib.AbstractContextManager):
    """Lazy reader over one safetensors file or an indexed set of shards.

    Use as a context manager (file handles are closed on exit):
        with SafetensorsReader.from_index(folder / "model.safetensors.index.json") as r:
            w = r.read("model.norm.weight")
    """

    def __init__(self, files: Sequence[Path], key_to_file: Optional[Mapping[str, Path]] = None,
                 index_path: Optional[Path] = None):
        self._stack = contextlib.ExitStack()
        self._handles: dict[Path, object] = {}
        self._key_to_file: dict[str, Path] = {}
        try:
            for path in files:
                self._handles[path] = self._stack.enter_context(_open(path))
            if key_to_file is None:
                for path, handle in self._handles.items():
                    for key in handle.keys():
                        if key in self._key_to_file:
                            raise CheckpointError(
                                f"tensor {key!r} appears in both {self._key_to_file[key]} "
                                f"and {path}")
                        self._key_to_file[key] = path
            else:
                contents = {p: set(h.keys()) for p, h in self._handles.items()}
                for key, path in key_to_file.items():
                    if key not in contents[path]:
                        raise CheckpointError(
                            f"index {index_path} maps {key!r} to {path.name}, but that "
                            f"file does not contain it")
                    self._key_to_file[key] = path
        except BaseException:
            self._stack.close()
            raise

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "SafetensorsReader":
        return cls([_path(path)])

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> "SafetensorsReader":
        """The checkpoint in `folder` (see `checkpoint_files`: its index's shards, or its
        single safetensors file)."""
        files, index = checkpoint_files(folder)
        if not files:
            raise CheckpointError(f"{folder} holds no *.safetensors files")
        return cls.from_index(index) if index is not None else cls.from_file(files[0])

    @classmethod
    def from_index(cls, index_path: str | os.PathLike) -> "SafetensorsReader":
        """Open the shards named in a `*.safetensors.index.json` (its `weight_map`)."""
        index_path = _path(index_path)
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except FileNotFoundError as e:
            raise CheckpointError(f"index file {index_path} does not exist") from e
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"index file {index_path} is not valid JSON with a "
                                  f"'weight_map': {e}") from e
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"index file {index_path} has an empty or invalid weight_map")
        folder = index_path.parent
        key_to_file = {k: folder / v for k, v in weight_map.items()}
        files = sorted(set(key_to_file.values()))
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise CheckpointError(f"index {index_path} refers to shard(s) that do not exist: "
                                  f"{', '.join(missing)}")
        return cls(files, key_to_file, index_path)

    def __exit__(self, *exc) -> None:
        self._stack.close()

    close = __exit__

    # ---- queries -----------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._key_to_file)

    def __contains__(self, key: str) -> bool:
        return key in self._key_to_file

    def file_of(self, key: str) -> Path:
        return self._key_to_file[key]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def dtype(self, key: str) -> np.dtype:
        tag = self._slice(key).get_dtype()
        if tag not in _DTYPES:
            raise CheckpointError(f"tensor {key!r} in {self.file_of(key)} has unsupported "
                                  f"dtype {tag}")
        return np.dtype(_DTYPES[tag])

    def read(self, key: str, index: Optional[Index] = None) -> np.ndarray:
        """The whole tensor, or only `index` (a tuple of slices) of it, as numpy."""
        try:
            if index is None:
                return self._handles[self.file_of(key)].get_tensor(key)
            return np.asarray(self._slice(key)[tuple(index)])
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {key!r} from {self.file_of(key)}: "
                                  f"{e}") from e

    def _slice(self, key: str):
        if key not in self._key_to_file:
            raise CheckpointError(f"tensor {key!r} is not in the checkpoint")
        return self._handles[self._key_to_file[key]].get_slice(key)


# ---- writing -------------------------------------------------------------------------------

def shard_groups(sizes: Iterable[tuple[str, int]], max_shard_bytes: Optional[int]
                 ) -> list[list[str]]:
    """Greedy packing of (key, nbytes) in order into groups of at most `max_shard_bytes`.

    A tensor larger than the limit gets a shard of its own (it cannot be split).
    """
    groups: list[list[str]] = [[]]
    used = 0
    for key, nbytes in sizes:
        if max_shard_bytes is not None and groups[-1] and used + nbytes > max_shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(key)
        used += nbytes
    return groups


def write_safetensors(tensors: Mapping[str, np.ndarray], folder: str | os.PathLike,
                      max_shard_bytes: Optional[int] = None, prefix: str = "model"
                      ) -> list[str]:
    """Write `tensors` into `folder` as `{prefix}.safetensors`, or, when they do not fit in
    one shard of `max_shard_bytes`, as `{prefix}-0000i-of-0000n.safetensors` plus
    `{prefix}.safetensors.index.json`. Metadata `format: pt` lets PyTorch loaders accept
    the files. Returns the names of the files written."""
    folder = _path(folder)
    groups = shard_groups(((k, int(v.nbytes)) for k, v in tensors.items()), max_shard_bytes)
    meta = {"format": "pt"}
    mode = default_file_mode()  # safetensors creates its files 0600; give the umask's mode
    if paths.is_local(folder):
        write, chmod = save_file, os.chmod
    else:  # an object store: each file one object write (no modes there)
        def write(tensors, path, metadata):
            paths.atomic_write_bytes(path, save(tensors, metadata=metadata))

        def chmod(path, mode):
            pass
    if len(groups) == 1:
        name = f"{prefix}.safetensors"
        write({k: np.ascontiguousarray(tensors[k]) for k in groups[0]}, folder / name,
              metadata=meta)
        chmod(folder / name, mode)
        return [name]
    n = len(groups)
    weight_map: dict[str, str] = {}
    names = []
    for i, group in enumerate(groups, start=1):
        name = f"{prefix}-{i:05d}-of-{n:05d}.safetensors"
        write({k: np.ascontiguousarray(tensors[k]) for k in group}, folder / name,
              metadata=meta)
        chmod(folder / name, mode)
        weight_map.update({k: name for k in group})
        names.append(name)
    index = {"metadata": {"total_size": int(sum(v.nbytes for v in tensors.values()))},
             "weight_map": dict(sorted(weight_map.items()))}
    index_name = f"{prefix}.safetensors.index.json"
    (folder / index_name).write_text(json.dumps(index, indent=2) + "\n")
    return names + [index_name]
