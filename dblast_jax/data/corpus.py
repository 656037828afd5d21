"""The regenerated corpus on disk: shards, manifest, and a random-access reader.

Layout of a corpus folder::

    manifest.json        target identity, settings, prompt checksum, finished shards
    shard-00000.npz      one shard (written to a temp name, then os.replace'd)
    ...

The folder may be local (a gcsfuse mount too) or an object-store URI (`gs://bucket/corpus`):
paths go through `as_folder` (pathlib locally, `etils.epath` for a URI; a plain
`pathlib.Path("gs://b/x")` would be a local folder "gs:/b/x"), writes through the atomic
helpers of dblast_jax.io.paths (one object per write on a bucket), and a shard on a bucket
is read into memory whole (`np.load` of its bytes; sha256 checked on the same bytes).

A shard is a zip of .npy arrays (readable with `np.load`) written with fixed zip
timestamps, so equal contents give byte-identical files. Sequences are concatenated:

    tokens         [N] int32     prompt + the target's answer, one sequence after another
    response_mask  [N] uint8     1 on tokens the target generated (its stop token included)
    offsets        [S + 1] int64 sequence s is tokens[offsets[s]:offsets[s + 1]]
    prompt_lengths [S] int32
    stopped        [S] uint8     1 if the answer ended with a stop token (else truncated)
    gen_temperature[S] float32   temperature the answer was sampled at
    ids            [S] str       "source/id" of the prompt
    logp_<T>       [N] float32   (none in an unscored corpus) log p_target(tokens[t] | tokens[<t]) at verification
                                 temperature T (teacher-forced) on response tokens; 0 on
                                 prompt tokens (never scored)
    entropy_<T>    [N] float32   entropy (nats) of that predictive distribution (0 on prompts)

<T> is `temperature_key(T)` (e.g. "0.7", "1", "1.5"). Records read back follow the
record convention of `dblast_jax.data.records`: tokens, loss_mask, logp {key: array}.
A shard range "A:B" (shards A .. B - 1) is parsed by `parse_shard_range`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from dblast_jax.io import atomic as _atomic
from dblast_jax.io import paths as _paths
from dblast_jax.io.fetch import sha256_file

AnyPath = Any  # pathlib.Path (local) or etils.epath.Path (gs://...): see `as_folder`

__all__ = ["FORMAT", "MANIFEST", "temperature_key", "shard_name", "as_folder", "is_corpus_folder",
           "sha256_path", "write_shard", "read_shard", "atomic_write_bytes", "atomic_write_text",
           "read_manifest", "write_manifest", "Corpus", "prompt_digest", "prompt_digests"]

FORMAT = "dblast-corpus-v1"
MANIFEST = "manifest.json"
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


def temperature_key(t: float) -> str:
    return f"{float(t):g}"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.npz"


def parse_shard_range(spec: str) -> tuple[int, int]:
    """"A:B" -> (A, B): corpus shards A .. B - 1."""
    parts = str(spec).split(":")
    try:
        first, stop = (int(p) for p in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        first = stop = None
    if first is None or not 0 <= first < stop:
        raise ValueError(f"shard range {spec!r}: expected A:B with 0 <= A < B (shards A .. B-1)")
    return first, stop


def as_folder(path: os.PathLike | str) -> AnyPath:
    """A corpus folder (or a file in one) as a path object: `pathlib.Path` for a local path
    (as always), `etils.epath.Path` for `gs://...` and other object-store URIs."""
    text = os.fspath(path)
    return Path(text) if _paths.is_local(text) else _paths.as_path(text)


def is_corpus_folder(path: os.PathLike | str) -> bool:
    """True when `path` holds a corpus (its manifest.json); a bucket prefix counts."""
    text = os.fspath(path)
    if _paths.is_local(text):
        return os.path.isdir(text) and os.path.exists(os.path.join(text, MANIFEST))
    return _paths.isfile(_paths.join(text, MANIFEST))


def sha256_path(path: os.PathLike | str) -> str:
    """sha256 hex digest of a local file or an object (streamed in 1 MiB chunks)."""
    if _paths.is_local(os.fspath(path)):
        return sha256_file(path)
    h = hashlib.sha256()
    with _paths.as_path(os.fspath(path)).open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: AnyPath, data: bytes) -> None:
    """Write to a temp file in the same folder, then os.replace: never a half file (on an
    object store: one object write, dblast_jax.io.paths)."""
    _atomic.atomic_write_bytes(path, data)


def atomic_write_text(path: AnyPath, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def _npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name in sorted(arrays):
            arr = np.ascontiguousarray(arrays[name])
            if arr.dtype == object:
                raise TypeError(f"shard array {name!r} has dtype object (not storable)")
            body = io.BytesIO()
            np.lib.format.write_array(body, arr, allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            z.writestr(info, body.getvalue(), compresslevel=6)
    return buf.getvalue()


def write_shard(path: AnyPath, arrays: Mapping[str, np.ndarray]) -> str:
    """Write one shard atomically; returns its sha256."""
    _check_shard(arrays, str(path))
    data = _npz_bytes(arrays)
    atomic_write_bytes(path, data)
    return hashlib.sha256(data).hexdigest()


_REQUIRED = ("tokens", "response_mask", "offsets", "prompt_lengths", "stopped",
             "gen_temperature", "ids")


def _check_shard(arrays: Mapping[str, np.ndarray], where: str) -> None:
    missing = [k for k in _REQUIRED if k not in arrays]
    if missing:
        raise ValueError(f"{where}: shard lacks arrays {missing} (has {sorted(arrays)})")
    n = arrays["tokens"].shape[0]
    off = arrays["offsets"]
    s = off.shape[0] - 1
    if off[0] != 0 or off[-1] != n or np.any(np.diff(off) < 0):
        raise ValueError(f"{where}: offsets must rise from 0 to {n} (the token count)")
    for k, v in arrays.items():
        want = n if k in ("tokens", "response_mask") or k.startswith(("logp_", "entropy_")) \
            else (s + 1 if k == "offsets" else s)
        if v.shape != (want,):
            raise ValueError(f"{where}: array {k!r} has shape {v.shape}, expected ({want},)")


# np.load parses each array's header with ast.literal_eval, which CPython 3.11 does not
# make thread-safe ("SystemError: AST constructor recursion depth mismatch" when grain's
# reader threads load two shards at once): shard loads take turns (each shard is read once
# and cached, so this costs nothing measurable).
_NPZ_LOAD_LOCK = threading.Lock()


def read_shard(path: AnyPath, data: Optional[bytes] = None) -> dict[str, np.ndarray]:
    """The arrays of one shard file; `data`: its bytes, already read (an object-store
    shard is always read whole: `np.load` needs a seekable file)."""
    if data is None and not _paths.is_local(os.fspath(path)):
        data = _paths.read_bytes(os.fspath(path))
    with _NPZ_LOAD_LOCK, np.load(io.BytesIO(data) if data is not None else path,
                                 allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    _check_shard(arrays, str(path))
    return arrays


def read_manifest(folder: os.PathLike | str) -> Optional[dict]:
    path = as_folder(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); delete the corpus folder or fix "
                         "the manifest") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def write_manifest(folder: os.PathLike | str, manifest: dict) -> None:
    atomic_write_text(as_folder(folder) / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))


class Corpus:
    """Random access over the finished shards of a corpus folder.

    `corpus[i]` is a record dict: tokens [L] int32, loss_mask [L] bool, logp {T: [L]}
    (or one array when `verify_temperature` is given; no "logp" in an unscored corpus),
    entropy {T: [L]}, id,
    prompt_length, gen_temperature, stopped. `verify` checks each shard's sha256 against
    the manifest when it is first opened. Shards are loaded lazily and a few are kept
    (LRU), so a reader process touches only the shards its indices fall in.
    `max_shards` reads shards 0 .. max_shards - 1 only (all of them must be finished);
    `first_shard` skips the shards before it (a held-out validation range is
    `first_shard=A, max_shards=B`: shards A .. B - 1).
    """

    def __init__(self, folder: os.PathLike | str, verify_temperature: Optional[float] = None,
                 verify: bool = True, cache_shards: int = 4, max_shards: Optional[int] = None,
                 first_shard: int = 0):
        self.folder = as_folder(folder)  # pathlib.Path, or epath.Path for gs://...
        manifest = read_manifest(self.folder)
        if manifest is None:
            raise FileNotFoundError(f"no corpus at {self.folder} (missing {MANIFEST}); make one "
                                    "with `dblast data regenerate`")
        self.manifest = manifest
        self.name = str(self.folder)
        self.shards = sorted(manifest["shards"], key=lambda s: s["index"])
        if not self.shards:
            raise ValueError(f"corpus {self.folder} has no finished shard yet")
        first_shard = int(first_shard)
        if first_shard < 0 or (max_shards and first_shard >= max_shards):
            raise ValueError(f"corpus {self.folder}: empty shard range [{first_shard}, "
                             f"{max_shards})")
        if first_shard:
            self.shards = [s for s in self.shards if s["index"] >= first_shard]
        if max_shards:  # a fixed prefix: an experiment stays the same while the corpus grows
            first = [s for s in self.shards if s["index"] < max_shards]
            if len(first) < max_shards - first_shard:
                which = (f"first {max_shards} shards" if not first_shard else
                         f"{max_shards - first_shard} shards {first_shard} .. {max_shards - 1}")
                raise ValueError(f"corpus {self.folder} has {len(first)} of the {which} "
                                 "finished; run `dblast data regenerate` further or choose "
                                 "fewer shards")
            self.shards = first
        if not self.shards:
            raise ValueError(f"corpus {self.folder} has no finished shard from {first_shard} on")
        counts = np.array([s["sequences"] for s in self.shards], np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        self.temperatures = list(manifest["settings"]["verify_temperatures"])
        self.verify_key = None
        # an unscored corpus (no verification temperature, `dblast data regenerate
        # --verify-temperatures none`) has records without "logp" whatever is asked
        self.scored = bool(self.temperatures)
        if verify_temperature is not None and self.scored:
            want = temperature_key(verify_temperature)
            keys = [temperature_key(t) for t in self.temperatures]
            if want not in keys:
                raise ValueError(f"corpus {self.folder} stores log-probs at temperatures "
                                 f"{keys}, not at {want}; regenerate with it")
            self.verify_key = want
        self.verify = verify
        self._cache: OrderedDict[int, dict] = OrderedDict()
        self._cache_size = max(1, int(cache_shards))
        self._token_ranges: dict[int, tuple[int, int]] = {}  # shard -> (min id, max id)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getstate__(self):  # grain may pickle sources into worker processes
        state = dict(self.__dict__)
        state["_cache"] = OrderedDict()
        return state

    def shard(self, k: int) -> dict[str, np.ndarray]:
        """The arrays of the k-th finished shard (in manifest order)."""
        if k in self._cache:
            self._cache.move_to_end(k)
            return self._cache[k]
        entry = self.shards[k]
        path = self.folder / entry["file"]
        if not path.is_file():
            raise FileNotFoundError(f"corpus shard {path} listed in the manifest is missing")
        local = _paths.is_local(os.fspath(path))
        data = None if local else path.read_bytes()  # a bucket's shard: one read, in memory
        if self.verify:
            actual = sha256_file(path) if local else hashlib.sha256(data).hexdigest()
            if actual != entry["sha256"]:
                raise ValueError(f"corpus shard {path}: sha256 {actual} does not match the "
                                 f"manifest's {entry['sha256']} (corrupt or replaced)")
        arrays = read_shard(path, data)
        toks = arrays["tokens"]
        if toks.size:
            self._token_ranges[k] = (int(toks.min()), int(toks.max()))
        self._cache[k] = arrays
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return arrays

    def token_range(self) -> Optional[tuple[int, int]]:
        """(smallest, largest) token id over the selected shards (each shard is read once;
        the usable-record scan of training reads them anyway)."""
        for k in range(len(self.shards)):
            if k not in self._token_ranges:
                self.shard(k)
        if not self._token_ranges:
            return None
        ranges = [self._token_ranges[k] for k in range(len(self.shards))
                  if k in self._token_ranges]
        return min(r[0] for r in ranges), max(r[1] for r in ranges)

    def locate(self, i: int) -> tuple[int, int]:
        if not 0 <= i < len(self):
            raise IndexError(f"record {i} out of range for a corpus of {len(self)}")
        k = int(np.searchsorted(self._starts, i, side="right") - 1)
        return k, int(i - self._starts[k])

    def __getitem__(self, i: int) -> dict[str, Any]:
        k, j = self.locate(int(i))
        a = self.shard(k)
        lo, hi = int(a["offsets"][j]), int(a["offsets"][j + 1])
        logp = {temperature_key(t): a[f"logp_{temperature_key(t)}"][lo:hi]
                for t in self.temperatures}
        entropy = {temperature_key(t): a[f"entropy_{temperature_key(t)}"][lo:hi]
                   for t in self.temperatures}
        rec = {
            "tokens": a["tokens"][lo:hi],
            "loss_mask": a["response_mask"][lo:hi].astype(bool),
            "logp": logp[self.verify_key] if self.verify_key else logp,
            "entropy": entropy,
            "id": str(a["ids"][j]),
            "prompt_length": int(a["prompt_lengths"][j]),
            "gen_temperature": float(a["gen_temperature"][j]),
            "stopped": bool(a["stopped"][j]),
        }
        if not self.scored:
            del rec["logp"]
        return rec

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """(sequence lengths [S], prompt lengths [S]) of every record, in index order."""
        seq, prompt = [], []
        for k in range(len(self.shards)):
            a = self.shard(k)
            seq.append(np.diff(a["offsets"]))
            prompt.append(a["prompt_lengths"])
        return np.concatenate(seq), np.concatenate(prompt)

    def usable_indices(self, seq_len: int, block_size: int) -> np.ndarray:
        """Records with a response token followed by a whole block within seq_len (the
        source contract of `data.pipeline`, like `records.ListSource.usable_indices`)."""
        seq, prompt = self.lengths()
        last = np.minimum(seq, seq_len) - block_size
        ok = (last >= 0) & (prompt <= last) & (seq > prompt)
        if not ok.any():
            raise ValueError(f"corpus {self.folder}: none of its {len(seq)} records has a "
                             f"response token followed by a block of {block_size} within "
                             f"seq_len {seq_len} (longest record {int(seq.max())} tokens)")
        return np.nonzero(ok)[0]


def prompt_digest(arrays: Mapping[str, np.ndarray], s: int) -> bytes:
    """sha256 of the prompt tokens of sequence s of a shard's arrays."""
    lo = int(arrays["offsets"][s])
    return hashlib.sha256(arrays["tokens"][lo:lo + int(arrays["prompt_lengths"][s])]
                          .tobytes()).digest()


def prompt_digests(corpus: "Corpus") -> set[bytes]:
    """The prompt digest of every record (read from the shards, no record dicts): whether
    two corpora share prompts, whatever their ids (`--prompts-from` renames them)."""
    return {prompt_digest(a, s) for a in (corpus.shard(k) for k in range(len(corpus.shards)))
            for s in range(len(a["prompt_lengths"]))}

