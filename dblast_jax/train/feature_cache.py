"""Cached target features: the frozen target's taps of every training record, once.

Why: the target never changes during drafter training, and a record enters a batch as
its first `seq_len` tokens (right-padded), so the taps the drafter reads are a fixed
function of the record. Recomputing them every epoch is about half of a K = 1 step on
a CPU (`benchmarks/bench_train_step.py`); a corpus of a few hundred records is seen
many epochs over. The cache runs the target once per record and the trainer reads the
taps from disk (`TrainConfig.feature_cache`).

Layout: `<cache folder>/<fingerprint[:16]>/` with
    meta.json      what the features are of: records digest, target digest, tap layers,
                   seq_len, dtype (the fingerprint is their hash)
    taps.npy       [records, seq_len, n_taps, H] float32 (or bfloat16 stored as uint16)
    record_digests.npy  [records, 32] uint8: each record's sha256 (of its first seq_len
                   tokens)
    progress.json  {"done": n, "complete": bool}, rewritten atomically after each chunk
    teacher_ids.npy / teacher_logp.npy  [records, seq_len, k]: the target's top-k at T_v
                   (distillation; when asked for)
    logp.npy       [records, seq_len] float32: log p_target(tokens[t] | tokens[<t]) at T_v
                   of each record's own tokens, 0 on prompt tokens (when asked for: the AL
                   terms' input for a corpus stored without it, `dblast data regenerate
                   --verify-temperatures none`; it costs the pass nothing but the head)
A changed corpus, target, tap set or seq_len gets another subfolder, so features are
never read for records they were not computed from; an interrupted build resumes at
`done`. A record a sibling cache already holds (the same first seq_len tokens, the same
target and settings) is copied from it wherever it sits: a grown corpus, or a merge of
passes cached before, costs a target pass only for its new records. Records are those of the source in index order (the trainer's
input pipeline, `data/pipeline.py`, picks indices into the same source).

The cache folder must be local (or a gcsfuse mount): the taps are read through
`np.load(mmap_mode=...)`, and memory maps need a real file. A `gs://` folder is refused
(`check_local`); caches are local scratch, rebuilt from the corpus and the target.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dblast_jax.chunked_logits import token_logprobs
from dblast_jax.config import TargetConfig
from dblast_jax.io import paths
from dblast_jax.io.atomic import atomic_write_text
from dblast_jax.io.output_folder import check_output_folder
from dblast_jax.models import target as target_lib
from dblast_jax.data import records as records_lib
from dblast_jax.train import distill

__all__ = ["FeatureCache", "CachedFeatureSource", "build_feature_cache", "records_digest",
           "params_digest", "FORMAT"]

FORMAT = "dblast-feature-cache-v1"
DTYPES = {"float32": np.float32, "bfloat16": np.uint16}  # bf16 bits kept as uint16


def check_local(folder: os.PathLike | str) -> None:
    """ValueError (one line) for an object-store folder: see the module doc."""
    paths.require_local(
        folder, "feature_cache",
        "the taps are memory-mapped (np.load mmap_mode), which needs local files; put the "
        "cache on a local disk (it is scratch, rebuilt from the corpus and the target), "
        "e.g. feature_cache=/tmp/dblast_features, while the workdir stays on gs://")


def _atomic_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True))


def records_digest(source: Any, seq_len: int) -> str:
    """sha256 over the first seq_len tokens of every record (all the taps depend on)."""
    return _digests(source, seq_len)[0]


def _digests(source: Any, seq_len: int) -> tuple[str, np.ndarray]:
    """(records_digest, each record's own sha256 [n, 32] uint8), in one read."""
    h = hashlib.sha256(f"{len(source)}:{seq_len}".encode())
    each = np.zeros((len(source), 32), np.uint8)
    for i in range(len(source)):
        tokens = np.asarray(source[i]["tokens"][:seq_len], np.int32)
        h.update(np.int64(tokens.size).tobytes())
        h.update(tokens.tobytes())
        each[i] = np.frombuffer(hashlib.sha256(tokens.tobytes()).digest(), np.uint8)
    return h.hexdigest(), each


# a cache's key fields that depend on its records (the rest must match for rows to be reused)
_RECORD_FIELDS = ("records", "records_digest")
DIGESTS_FILE = "record_digests.npy"


def _rows_in_siblings(folder: Path, sub: Path, meta: dict, digests: np.ndarray
                      ) -> dict[int, tuple[Path, int]]:
    """Rows of this cache whose record a sibling cache already holds: {row: (sibling, its
    row)}.

    Why: every flagship leg merges the greedy answers with other sampled passes, so each
    merge is a new source with a cache of its own, while most of its records are in the
    caches of earlier merges (the greedy half in all of them; a leg on several passes has
    each pass in an earlier one-pass cache). A record's taps depend on its first seq_len
    tokens alone, so a row is reusable wherever it sits. A sibling qualifies when
    everything but its records matches (target, taps, seq_len, dtype, teacher, log-probs)
    and it kept its per-record digests; its first `done` rows are final."""
    want = {k: v for k, v in meta.items() if k not in _RECORD_FIELDS}
    held: dict[bytes, tuple[Path, int]] = {}
    for other in sorted(p for p in folder.iterdir() if p.is_dir() and p != sub):
        try:
            ometa = json.loads((other / "meta.json").read_text())
            done = int(json.loads((other / "progress.json").read_text())["done"])
            odig = np.load(other / DIGESTS_FILE)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a cache, an old one without digests, or unreadable: skip it
        if {k: v for k, v in ometa.items() if k not in _RECORD_FIELDS} != want:
            continue
        for j in range(min(done, len(odig))):
            held.setdefault(odig[j].tobytes(), (other, j))
    return {i: held[d.tobytes()] for i, d in enumerate(digests) if d.tobytes() in held}


def _copy_rows(rows: dict[int, tuple[Path, int]], arrays: dict[str, np.ndarray]) -> None:
    """Copy {row: (sibling, its row)} from the siblings' files into `arrays`."""
    by_sibling: dict[Path, list[tuple[int, int]]] = {}
    for row, (other, j) in rows.items():
        by_sibling.setdefault(other, []).append((row, j))
    for other, pairs in by_sibling.items():
        dst_rows = np.asarray([r for r, _ in pairs])
        src_rows = np.asarray([j for _, j in pairs])
        for name, dst in arrays.items():
            src = np.load(other / name, mmap_mode="r")
            for lo in range(0, len(pairs), 64):  # ~140 MB of taps at a time
                dst[dst_rows[lo:lo + 64]] = src[src_rows[lo:lo + 64]]


def params_digest(params: Any, sample: int = 4096) -> str:
    """A cheap identity of target weights: every leaf's path, shape, dtype and a strided
    sample of its values (a different checkpoint of the same shape changes it)."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        a = np.asarray(leaf)
        h.update(jax.tree_util.keystr(path).encode())
        h.update(f"{a.shape}{a.dtype}".encode())
        flat = a.reshape(-1)
        step = max(1, flat.size // sample)
        h.update(np.ascontiguousarray(flat[::step][:sample]).astype(np.float32).tobytes())
    return h.hexdigest()


class FeatureCache:
    """A finished cache: `taps(i)` -> [seq_len, n_taps, H] float32 of record i."""

    def __init__(self, folder: os.PathLike | str):
        check_local(folder)
        self.folder = Path(folder)
        meta_path, prog_path = self.folder / "meta.json", self.folder / "progress.json"
        if not meta_path.exists() or not prog_path.exists():
            raise FileNotFoundError(f"no feature cache at {self.folder}")
        self.meta = json.loads(meta_path.read_text())
        progress = json.loads(prog_path.read_text())
        if not progress.get("complete"):
            raise ValueError(f"feature cache {self.folder} is unfinished ({progress['done']} "
                             f"of {self.meta['records']} records); build it again to resume")
        self.dtype = self.meta["dtype"]
        try:
            self._taps = np.load(self.folder / "taps.npy", mmap_mode="r")
        except (OSError, ValueError) as e:
            raise ValueError(f"feature cache {self.folder}: taps.npy is unreadable ({e}): "
                             "corrupt; delete the folder to rebuild it") from None
        want = (self.meta["records"], self.meta["seq_len"], len(self.meta["tap_layers"]),
                self.meta["hidden_size"])
        if self._taps.shape != want or self._taps.dtype != DTYPES[self.dtype]:
            raise ValueError(f"feature cache {self.folder}: taps.npy is {self._taps.shape} "
                             f"{self._taps.dtype}, meta.json says {want} {self.dtype}: "
                             "corrupt; delete the folder to rebuild it")

        self.teacher_topk = int(self.meta.get("teacher_topk", 0))
        self._teacher_ids = self._teacher_logp = None
        if self.teacher_topk:
            try:
                self._teacher_ids = np.load(self.folder / "teacher_ids.npy", mmap_mode="r")
                self._teacher_logp = np.load(self.folder / "teacher_logp.npy", mmap_mode="r")
            except (OSError, ValueError) as e:
                raise ValueError(f"feature cache {self.folder}: the teacher arrays are "
                                 f"unreadable ({e}): corrupt; delete the folder to rebuild "
                                 "it") from None
            tshape = want[:2] + (self.teacher_topk,)
            if self._teacher_ids.shape != tshape or self._teacher_logp.shape != tshape:
                raise ValueError(f"feature cache {self.folder}: teacher arrays are "
                                 f"{self._teacher_ids.shape} / {self._teacher_logp.shape}, "
                                 f"expected {tshape}: corrupt; delete the folder to rebuild it")

        self.logp_temperature = self.meta.get("data_logp_temperature")
        self._logp = None
        if self.logp_temperature is not None:
            try:
                self._logp = np.load(self.folder / "logp.npy", mmap_mode="r")
            except (OSError, ValueError) as e:
                raise ValueError(f"feature cache {self.folder}: logp.npy is unreadable ({e}):"
                                 " corrupt; delete the folder to rebuild it") from None
            if self._logp.shape != want[:2]:
                raise ValueError(f"feature cache {self.folder}: logp.npy is "
                                 f"{self._logp.shape}, expected {want[:2]}: corrupt; delete "
                                 "the folder to rebuild it")

    def __len__(self) -> int:
        return int(self._taps.shape[0])

    def data_logp(self, i: int) -> Optional[np.ndarray]:
        """[seq_len] float32: record i's own tokens' log-probs at T_v, or None."""
        return None if self._logp is None else np.asarray(self._logp[int(i)], np.float32)

    def teacher(self, i: int) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """(ids [seq_len, k] int32, logp [seq_len, k] float32) of record i, or None."""
        if not self.teacher_topk:
            return None
        return (np.asarray(self._teacher_ids[int(i)]),
                np.asarray(self._teacher_logp[int(i)], np.float32))

    def taps(self, i: int) -> np.ndarray:
        x = np.asarray(self._taps[int(i)])
        if self.dtype == "bfloat16":
            x = (x.astype(np.uint32) << 16).view(np.float32)
        return x


class CachedFeatureSource:
    """A random-access source whose records also carry their cached "taps" (and "logp",
    where the cache computed it and the record has none: [L] like its tokens, 0 past the
    cache's seq_len, which a training window never reads)."""

    def __init__(self, source: Any, cache: FeatureCache):
        if len(cache) != len(source):
            raise ValueError(f"feature cache {cache.folder} holds {len(cache)} records, the "
                             f"data {len(source)}")
        self.source, self.cache = source, cache
        self.name = getattr(source, "name", "cached")

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict[str, Any]:
        rec = dict(self.source[i])
        rec["taps"] = self.cache.taps(i)
        teacher = self.cache.teacher(i)
        if teacher is not None:
            rec["teacher_ids"], rec["teacher_logp"] = teacher
        logp = self.cache.data_logp(i) if "logp" not in rec else None
        if logp is not None:
            full = np.zeros(len(rec["tokens"]), np.float32)
            m = min(len(full), len(logp))
            full[:m] = logp[:m]
            rec["logp"] = full
        return rec

    def usable_indices(self, seq_len: int, block_size: int):
        return self.source.usable_indices(seq_len, block_size)


WIDTH_MULTIPLE = 64  # batch widths of the build (a few compiled shapes)
BUILD_WINDOW = 256  # records sorted by length together; the unit of progress


def _widen(rows: np.ndarray, seq_len: int, fill) -> np.ndarray:
    """[B, width, ...] -> [B, seq_len, ...], the new positions holding `fill`."""
    if rows.shape[1] == seq_len:
        return rows
    pad = [(0, 0), (0, seq_len - rows.shape[1])] + [(0, 0)] * (rows.ndim - 2)
    return np.pad(rows, pad, constant_values=fill)


def _fingerprint(meta: dict) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()


def build_feature_cache(source: Any, target_config: TargetConfig, target_params: Any,
                        tap_layers: Sequence[int], seq_len: int, folder: os.PathLike | str, *,
                        target_name: str = "target", dtype: str = "float32",
                        batch_size: int = 8, progress: bool = True, log=print,
                        build: bool = True, teacher_topk: int = 0,
                        teacher_temperature: float = 1.0,
                        head: Optional[tuple[Any, str]] = None,
                        data_logp_temperature: Optional[float] = None,
                        window: int = BUILD_WINDOW) -> FeatureCache:
    """The cache of `source` under `folder` (built, or resumed, when not finished).
    build=False only opens a finished cache (the other processes of a multi-process run:
    build it first with a single-process run, e.g. `launch/train.py ... --stop_at=0`).
    teacher_topk > 0 also stores the target's top-k distribution per position at
    teacher_temperature (train/distill.py's convention) from the same pass; `head` is the
    target's (LM head weight, layout). data_logp_temperature: also store each record's own
    tokens' log-probs at that temperature (for a corpus stored without them)."""
    check_local(folder)
    check_output_folder(folder, "feature cache", "--override feature_cache=DIR")
    if int(window) < 1:
        raise ValueError(f"feature cache build window must be >= 1 record, got {window}")
    if dtype not in DTYPES:
        raise ValueError(f"feature cache dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    try:
        n = len(source)
    except TypeError:
        raise ValueError("feature_cache needs a finite random-access corpus (a corpus "
                         "folder, .jsonl or list of records)") from None
    if n > 10**8:
        raise ValueError(f"feature_cache needs a finite corpus; this source has {n} records "
                         "(synthetic data are generated on the fly: train without a cache)")
    digest, digests = _digests(source, seq_len)
    meta = {"format": FORMAT, "records": n, "records_digest": digest,
            "target": target_name, "target_digest": params_digest(target_params),
            "tap_layers": [int(x) for x in tap_layers], "seq_len": int(seq_len),
            "hidden_size": int(target_config.hidden_size), "dtype": dtype}
    if teacher_topk:  # only then: caches without a teacher keep their old key
        if head is None:
            raise ValueError("a feature cache with the teacher's top-k needs the target's head")
        meta["teacher_topk"] = int(teacher_topk)
        meta["teacher_temperature"] = float(teacher_temperature)
    if data_logp_temperature is not None:
        if head is None:
            raise ValueError("a feature cache with the data's log-probs needs the target's head")
        if not data_logp_temperature > 0:
            raise ValueError(f"data_logp_temperature must be > 0, got {data_logp_temperature}")
        meta["data_logp_temperature"] = float(data_logp_temperature)
    sub = Path(folder) / _fingerprint(meta)[:16]
    sub.mkdir(parents=True, exist_ok=True)
    meta_path, prog_path, taps_path = sub / "meta.json", sub / "progress.json", sub / "taps.npy"
    if meta_path.exists() and json.loads(meta_path.read_text()) != meta:
        raise ValueError(f"feature cache {sub} holds other features (meta.json differs); "
                         "delete it")
    done = 0
    if prog_path.exists() and taps_path.exists():
        state = json.loads(prog_path.read_text())
        if state.get("complete"):
            return FeatureCache(sub)
        done = int(state["done"])
    if not build:
        raise FileNotFoundError(f"feature cache {sub} is not finished; build it with a "
                                "single-process run first (launch/train.py ... --stop_at=0)")
    _atomic_json(meta_path, meta)
    shape = (n, seq_len, len(meta["tap_layers"]), meta["hidden_size"])
    tshape = (n, seq_len, int(teacher_topk))
    with_logp = data_logp_temperature is not None
    # file name -> (dtype, shape) of every array this cache holds
    specs = {"taps.npy": (DTYPES[dtype], shape)}
    if teacher_topk:
        specs["teacher_ids.npy"] = (np.int32, tshape)
        specs["teacher_logp.npy"] = (np.float32, tshape)
    if with_logp:
        specs["logp.npy"] = (np.float32, (n, seq_len))
    if done and all((sub / name).exists() for name in specs):
        arrays = {name: np.load(sub / name, mmap_mode="r+") for name in specs}
        for name, (_, want) in specs.items():
            if arrays[name].shape != want:
                raise ValueError(f"feature cache {sub}: {name} is {arrays[name].shape}, "
                                 f"expected {want}; delete the folder to rebuild it")
    else:
        done = 0
        arrays = {name: np.lib.format.open_memmap(sub / name, mode="w+", dtype=dt, shape=shp)
                  for name, (dt, shp) in specs.items()}
        tmp = sub / (DIGESTS_FILE + ".tmp")
        with open(tmp, "wb") as f:
            np.save(f, digests)
        os.replace(tmp, sub / DIGESTS_FILE)
    reusable = _rows_in_siblings(Path(folder), sub, meta, digests)
    if any(i >= done for i in reusable):
        ahead = sum(i >= done for i in reusable)
        log(f"feature cache {sub}: {ahead} of its {n - done} records to go are in sibling "
            f"caches ({', '.join(sorted({o.name for o, _ in reusable.values()}))}): their "
            f"rows are copied, {n - done - ahead} go through the target")
    _atomic_json(prog_path, {"done": done, "complete": done == n})

    taps = arrays["taps.npy"]
    layers = tuple(meta["tap_layers"])
    last = target_config.num_layers - 1
    needs_final = bool(teacher_topk) or with_logp
    fwd_layers = layers + ((last,) if needs_final and last not in layers else ())
    final_idx = fwd_layers.index(last) if needs_final else None

    def pass_fn(p, t):
        out = target_lib.forward(p, t, config=target_config, tap_layers=fwd_layers)[1]
        teacher = logp = None
        if teacher_topk:
            teacher = distill.teacher_from_final(out[:, :, final_idx], head[0], head[1],
                                                 teacher_topk, teacher_temperature)
        if with_logp:  # position t scores tokens[t] from the state at t - 1
            logp = token_logprobs(out[:, :-1, final_idx], head[0], head[1], t[:, 1:],
                                  data_logp_temperature).logprob
            logp = jnp.pad(logp, ((0, 0), (1, 0)))
        return out[:, :, :len(layers)], teacher, logp

    forward = jax.jit(pass_fn)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=n, initial=done, desc="feature cache", unit="rec", dynamic_ncols=True)
    while done < n:
        # A window of records, run shortest first in batches as wide as their longest
        # record (rounded up to WIDTH_MULTIPLE): right-padding to seq_len cost ~24% more
        # target passes on the flagship corpus. Taps are causal, so a record's rows do not
        # depend on the width it ran at; rows past a record's end are never read (past
        # its batch's width they hold zeros, the teacher's empty entries, log-prob 0).
        # `done` moves a window at a time, so a killed build redoes at most one window.
        stop = min(done + window, n)
        copied = {i: reusable[i] for i in range(done, stop) if i in reusable}
        _copy_rows(copied, arrays)
        if bar is not None:
            bar.update(len(copied))
        recs = {i: source[i] for i in range(done, stop) if i not in reusable}
        used = {i: min(len(r["tokens"]), seq_len) for i, r in recs.items()}
        order = sorted(recs, key=lambda i: (used[i], i))
        for lo in range(0, len(order), batch_size):
            idx = order[lo:lo + batch_size]
            width = min(seq_len, -(-max(used[i] for i in idx) // WIDTH_MULTIPLE)
                        * WIDTH_MULTIPLE)
            batch_recs = [recs[i] for i in idx]
            batch_recs += [batch_recs[-1]] * (batch_size - len(idx))  # fixed batch shape
            batch = records_lib.collate(batch_recs, width, with_logp=False)
            out, teacher, logp = forward(target_params, jnp.asarray(batch["tokens"]))
            out = np.asarray(jax.device_get(out), np.float32)[:len(idx)]
            if dtype == "bfloat16":  # round to nearest even, keep the top 16 bits
                bits = out.view(np.uint32)
                out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            rows = np.asarray(idx)
            taps[rows] = _widen(out, seq_len, 0)
            if teacher is not None:
                arrays["teacher_ids.npy"][rows] = _widen(
                    np.asarray(teacher.ids)[:len(idx)], seq_len, 0)
                arrays["teacher_logp.npy"][rows] = _widen(
                    np.asarray(teacher.logp)[:len(idx)], seq_len, distill.EMPTY_LOGP)
            if logp is not None:  # the corpus convention: prompt (and padding) tokens hold 0
                arrays["logp.npy"][rows] = _widen(np.where(
                    batch["loss_mask"], np.asarray(logp), 0.0)[:len(idx)], seq_len, 0.0)
            if bar is not None:
                bar.update(len(idx))
        for a in arrays.values():
            a.flush()
        done = stop
        _atomic_json(prog_path, {"done": done, "complete": done == n})
    if bar is not None:
        bar.close()
    del taps, arrays
    log(f"feature cache {sub}: {n} records x {seq_len} tokens x {len(layers)} taps")
    return FeatureCache(sub)

