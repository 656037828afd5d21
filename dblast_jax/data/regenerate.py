"""Regenerate a training corpus: the target answers each prompt with its own text.

Drafters learn the target's distribution, so the data are the target's own answers
(DFlash-style). For every (prompt, generation temperature) the target samples an answer
with the on-device sampler (`generate_scored_tokens`, batched), which also keeps, per
response token, the target's float32 log-probability of that token (and the entropy of
its predictive distribution) at each requested verification temperature, from the very
logits the token was sampled from: the input of the AL loss, computed once here instead
of every training step, in the one target pass per answer. (`teacher_forced` computes the
same numbers from a second, teacher-forced pass over prompt + answer, which is what
regeneration did before and cost ~28% of its time; the two agree up to float rounding,
tests/test_regenerate.py.) Prompt tokens are never scored (anchors and block labels are
response tokens), so they hold 0. With no verification temperature the corpus is unscored
(tokens only, ~10x smaller): its tokens are those a scored run with the same seed samples,
and a trainer scores them itself (the feature cache stores their log-probs,
train/feature_cache.py).

Work is split into shards (`shard_size` prompts at one generation temperature). Each
shard is written atomically and recorded in manifest.json with its sha256; a restarted
run checks that target, settings and prompts are unchanged and skips finished shards.
Shard k uses the key fold_in(key(seed), k) (batch j inside it: fold_in(that, j)) and
always runs full-size batches (the last is padded with a copy), so the corpus does not
depend on where a run was interrupted, nor on how many processes or devices made it.

Several processes (`jax.distributed` initialised, e.g. one per pod host) share the work:
the unfinished shards are dealt round-robin (the j-th to process j % P), every process
holds the whole target on its own devices (optionally on a `mesh` of them: rows over the
data axis) and samples without cross-process collectives, and writes only its shards,
each followed by a small record `.shard-NNNNN.npz.done.json` (the manifest entry and the
corpus identity). Process 0 holds the folder lock, writes the manifest at the start and,
after a barrier, once more from the shards and records on disk (and drops the records it
merged), so the folder is byte-for-byte a one-process run's apart from timings. A killed
run leaves only complete shards (atomic writes) and is resumed by running it again with
any process count. `out_dir` must be one folder every process sees (a shared file system,
or an object-store folder `gs://bucket/corpus`: shards, records and manifest are then whole
objects, each written in one call -- no temp files, no renames -- and there is no lock).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from dblast_jax import sharding
from dblast_jax.config import SamplingConfig, TargetConfig
from dblast_jax.sampling import token_logprobs_and_entropies
from dblast_jax.data import corpus as corpus_io
from dblast_jax.data.dedup import training_prompts
from dblast_jax.data.sources import Prompt
from dblast_jax.data.templates import chat_messages
from dblast_jax.io import paths
from dblast_jax.io.atomic import atomic_write_json
from dblast_jax.io.output_folder import check_output_folder
from dblast_jax.models import target as target_lm
from dblast_jax.distributed import barrier, shared_file_error
from dblast_jax.sampler import PAD_ID, cache_size_for, generate_scored_tokens, generate_tokens
from dblast_jax.workdir_lock import FolderLock

__all__ = ["RegenConfig", "WorkItem", "encode_work", "regenerate", "teacher_forced",
           "params_digest", "params_fingerprint", "check_corpus_target"]

PromptLike = Union[Prompt, Sequence[int]]


@dataclasses.dataclass(frozen=True)
class RegenConfig:
    """Settings of one corpus (all recorded in the manifest; a resume must match them)."""

    gen_temperatures: tuple[float, ...] = (1.0,)  # answer each prompt once per temperature
    # log-probs stored at each of these; () stores none (an unscored, tokens-only corpus:
    # 10x smaller on disk, for data a trainer scores itself, e.g. in its feature cache)
    verify_temperatures: tuple[float, ...] = (1.0,)
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 512
    max_prompt_tokens: int = 1024  # longer prompts are skipped (counted in the manifest)
    batch_size: int = 8
    shard_size: int = 256
    seed: int = 0
    system: Optional[str] = None  # optional system message for text prompts
    pad_multiple: int = 64  # prompt / sequence widths are rounded up to this (fewer compiles)
    # rows per LM-head block of `teacher_forced`. Regeneration scores in its generation
    # loop and no longer reads this; it stays a setting so that corpora made with the
    # teacher-forced pass keep their identity (a resumed run compares settings)
    logprob_rows: int = 512

    def __post_init__(self):
        if not self.gen_temperatures:
            raise ValueError("need at least one generation temperature")
        if any(t < 0 for t in self.gen_temperatures):
            raise ValueError(f"generation temperatures must be >= 0, got {self.gen_temperatures}")
        if any(t <= 0 for t in self.verify_temperatures):
            raise ValueError(f"verification temperatures must be > 0, got "
                             f"{self.verify_temperatures}")
        keys = [corpus_io.temperature_key(t) for t in self.verify_temperatures]
        if len(set(keys)) != len(keys):
            raise ValueError(f"duplicate verification temperatures {self.verify_temperatures}")
        for f in ("max_new_tokens", "max_prompt_tokens", "batch_size", "shard_size",
                  "pad_multiple", "logprob_rows"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["gen_temperatures"] = [float(t) for t in self.gen_temperatures]
        d["verify_temperatures"] = [float(t) for t in self.verify_temperatures]
        return d


@dataclasses.dataclass(frozen=True)
class WorkItem:
    id: str  # "source/id"
    tokens: tuple[int, ...]  # the chat-templated prompt


def encode_work(prompts: Sequence[PromptLike], tokenizer=None,
                system: Optional[str] = None) -> list[WorkItem]:
    """Prompt records (first user turn, chat template) or token-id lists -> work items.

    Multi-turn prompts (ShareGPT) contribute their first turn: later user turns refer to
    answers the target did not write.
    """
    items = []
    for i, p in enumerate(prompts):
        if isinstance(p, Prompt):
            if tokenizer is None:
                raise ValueError(f"prompt {p.source}/{p.id} is text but the target has no "
                                 "tokenizer; pass token-id prompts")
            ids = tokenizer.encode_chat(chat_messages(p.turns[:1], system=system))
            items.append(WorkItem(f"{p.source}/{p.id}", tuple(int(t) for t in ids)))
        else:
            ids = tuple(int(t) for t in p)
            if not ids:
                raise ValueError(f"token prompt {i} is empty")
            items.append(WorkItem(f"tokens/{i}", ids))
    return items


def params_digest(params) -> str:
    """sha256 over every parameter (path, dtype, shape, bytes): the target's identity."""
    h = hashlib.sha256()
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in sorted(flat, key=lambda kv: jax.tree_util.keystr(kv[0])):
        arr = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)}|{arr.dtype}|{arr.shape}|".encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def params_fingerprint(params, sample: int = 1024) -> str:
    """A cheap identity of target weights that does not depend on the dtype they were
    loaded in (float32 or bfloat16 of the same checkpoint agree): every leaf's path and
    shape and a strided sample of its values, rounded to bfloat16. Sliced before the
    host copy, so it costs little even for a large target."""
    import ml_dtypes
    h = hashlib.sha256(b"dblast-params-fingerprint-v1|")
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in sorted(flat, key=lambda kv: jax.tree_util.keystr(kv[0])):
        shape = tuple(int(d) for d in np.shape(leaf))
        size = int(np.prod(shape)) if shape else 1
        step = max(1, size // sample)
        values = np.asarray(leaf.reshape(-1)[::step][:sample] if hasattr(leaf, "reshape")
                            else np.reshape(leaf, -1)[::step][:sample])
        h.update(f"{jax.tree_util.keystr(path)}|{shape}|".encode())
        h.update(values.astype(np.float32).astype(ml_dtypes.bfloat16).tobytes())
    return h.hexdigest()


def check_corpus_target(manifest: dict, corpus: str, target_name: str, params,
                        log: Optional[Callable[[str], None]] = None) -> None:
    """Raise ValueError unless the corpus's stored log-probs come from this target.

    The manifest's `params_fingerprint` (corpora written since it exists) is compared
    with this target's. An older manifest has none (its `params_sha256` hashes the
    weights as loaded then: loader- and dtype-dependent, so it cannot be recomputed
    reliably): its target is checked by name, and a different name is reported through
    `log` as a warning."""
    stored = manifest.get("target") or {}
    theirs = stored.get("name", "?")
    fix = ("its stored log-probs are another model's: train against the target that made "
           "it, regenerate the corpus with this target (`dblast data regenerate`), or have "
           "this target compute them (--override logp_source=target)")
    fingerprint = stored.get("params_fingerprint")
    if fingerprint:
        ours = params_fingerprint(params)
        if ours != fingerprint:
            raise ValueError(f"corpus {corpus} was made by target {theirs!r}, whose weights "
                             f"differ from this target {target_name!r} (parameter fingerprint "
                             f"{fingerprint[:12]} vs {ours[:12]}); " + fix)
        return
    if log is None:
        return
    if theirs != target_name:
        log(f"warning: corpus {corpus} was made by target {theirs!r}, this run trains "
            f"against {target_name!r}; its manifest predates parameter fingerprints, so its "
            f"stored log-probs are used as they are (if they are another model's: {fix})")
    else:
        log(f"note: corpus {corpus} predates parameter fingerprints; its target was checked "
            f"by name ({theirs!r}) only")


def _head(params, config: TargetConfig):
    if config.tie_word_embeddings:
        return params["embed"]["embedding"], "vh"
    return params["lm_head"]["kernel"], "hv"


@functools.partial(jax.jit, static_argnames=("config", "temperatures", "num_new", "row_block"))
def teacher_forced(params, tokens, prompt_lengths, *, config: TargetConfig,
                   temperatures: tuple[float, ...], num_new: int, row_block: int = 512):
    """Target log-probs and entropies of the response tokens of right-padded sequences.

    tokens [B, W] int32 (prompt + response + padding), prompt_lengths [B].
    Returns (logp, entropy), each [n_T, B, num_new] float32: entry [., b, j] is for token
    prompt_lengths[b] + j given all tokens before it, at temperature T (entries past a
    row's end are meaningless). Only response positions go through the LM head (prompts
    are often much longer than answers), each row block's logits [row_block, V] are
    computed once and shared by every temperature, and no [B, W, V] array is built.
    """
    b, w = tokens.shape
    lengths = jnp.full((b,), w, jnp.int32)  # causal: padding after a row never leaks back
    _, hidden, _ = target_lm.prefill(params, tokens, lengths, config=config, cache_size=w,
                                     tap_layers=(config.num_layers - 1,),
                                     last_logits_only=True)
    hidden = hidden[:, :, 0]  # final-normed states [B, W, H]
    pos = jnp.clip(prompt_lengths[:, None] - 1 + jnp.arange(num_new)[None, :], 0, w - 2)
    h = jnp.take_along_axis(hidden, pos[:, :, None], axis=1).reshape(b * num_new, -1)
    tgt = jnp.take_along_axis(tokens, pos + 1, axis=1).reshape(-1)
    head, layout = _head(params, config)
    head = head.astype(jnp.float32)
    spec = "nh,vh->nv" if layout == "vh" else "nh,hv->nv"
    rows = b * num_new
    row_block = min(row_block, rows)  # never pad a small batch up to a big block
    blocks = -(-rows // row_block)
    pad = blocks * row_block - rows
    h = jnp.pad(h.astype(jnp.float32), ((0, pad), (0, 0))).reshape(blocks, row_block, -1)
    tgt = jnp.pad(tgt, (0, pad)).reshape(blocks, row_block)

    def one_block(args):
        hb, tb = args
        logits = jnp.einsum(spec, hb, head, preferred_element_type=jnp.float32)
        return token_logprobs_and_entropies(logits, tb, temperatures)

    lp, en = jax.lax.map(one_block, (h, tgt))  # [blocks, n_T, row_block]
    fix = lambda x: jnp.moveaxis(x, 1, 0).reshape(len(temperatures), -1)[:, :rows].reshape(
        len(temperatures), b, num_new)
    return fix(lp), fix(en)


def _round_up(n: int, m: int) -> int:
    return int(math.ceil(n / m) * m)


def _pad_batch(rows: Sequence[Sequence[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    arr = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        arr[i, :len(r)] = r
    return arr, np.asarray([len(r) for r in rows], np.int32)


@dataclasses.dataclass(frozen=True)
class _ShardPlan:
    index: int
    gen_temperature: float
    start: int  # prompt range [start, end) of the filtered work list
    end: int


def _plan(n_items: int, cfg: RegenConfig) -> list[_ShardPlan]:
    plans, k = [], 0
    per_t = max(1, math.ceil(n_items / cfg.shard_size)) if n_items else 0
    for t in cfg.gen_temperatures:
        for j in range(per_t):
            plans.append(_ShardPlan(k, float(t), j * cfg.shard_size,
                                    min(n_items, (j + 1) * cfg.shard_size)))
            k += 1
    return plans


def _run_shard(target, items: Sequence[WorkItem], plan: _ShardPlan, cfg: RegenConfig,
               stop_tokens: tuple[int, ...], on_batch: Callable[[int, int], None],
               place: Callable = lambda a: jnp.asarray(a)) -> tuple[dict, dict]:
    """Generate + score one shard; returns (its arrays (see corpus.py), timings).
    `place` puts a host batch [B, ...] on device (over a mesh's data axis, if any)."""
    config = target.config
    sampling = SamplingConfig(temperature=plan.gen_temperature, top_k=cfg.top_k,
                              top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                              stop_tokens=tuple(stop_tokens))
    shard_items = list(items[plan.start:plan.end])
    # length-sorted batches waste less padding; the sort is stable, so deterministic
    order = sorted(range(len(shard_items)), key=lambda i: len(shard_items[i].tokens))
    shard_key = jax.random.fold_in(jax.random.key(cfg.seed), plan.index)
    temps = tuple(float(t) for t in cfg.verify_temperatures)
    seqs, plens, stopped, logps, ents, ids = [], [], [], [], [], []
    timing = {"generate_seconds": 0.0}  # generation and scoring are one pass
    for b, lo in enumerate(range(0, len(order), cfg.batch_size)):
        batch = [shard_items[i] for i in order[lo:lo + cfg.batch_size]]
        real = len(batch)
        batch += [batch[0]] * (cfg.batch_size - real)  # fixed batch shape
        width = _round_up(max(len(w.tokens) for w in batch), cfg.pad_multiple)
        toks, lens = _pad_batch([w.tokens for w in batch], width)
        t0 = time.perf_counter()
        # one target pass per answer: the loop scores each token from the logits it was
        # sampled from (no teacher-forced pass over prompt + answer afterwards)
        args = (target.params, place(toks), place(lens), jax.random.fold_in(shard_key, b))
        kwargs = dict(config=config, sampling=sampling, cache_size=cache_size_for(
            width, cfg.max_new_tokens, multiple=cfg.pad_multiple))
        if temps:
            out, counts, lp, en = generate_scored_tokens(*args, **kwargs,
                                                         score_temperatures=temps)
        else:  # unscored: the same tokens (same key), no log-probs
            out, counts = generate_tokens(*args, **kwargs)
            lp = en = np.zeros((0, cfg.batch_size, cfg.max_new_tokens), np.float32)
        out, counts = np.asarray(out), np.asarray(counts)
        lp, en = np.asarray(lp), np.asarray(en)
        timing["generate_seconds"] += time.perf_counter() - t0
        rows = []
        for r in range(cfg.batch_size):
            answer = [int(t) for t in out[r, :counts[r]] if t != PAD_ID]
            rows.append(list(batch[r].tokens) + answer)
        new_tokens = 0
        for r in range(real):
            n, p = len(rows[r]), len(batch[r].tokens)
            seqs.append(np.asarray(rows[r], np.int32))
            plens.append(p)
            stopped.append(int(n > p and rows[r][-1] in stop_tokens))
            full_lp = np.zeros((len(temps), n), np.float32)  # prompt tokens hold 0
            full_en = np.zeros((len(temps), n), np.float32)
            full_lp[:, p:] = lp[:, r, :n - p]
            full_en[:, p:] = en[:, r, :n - p]
            logps.append(full_lp)
            ents.append(full_en)
            ids.append(batch[r].id)
            new_tokens += n - p
        on_batch(real, new_tokens)
    lengths = np.asarray([len(s) for s in seqs], np.int64)
    mask = [np.arange(len(s)) >= p for s, p in zip(seqs, plens)]
    arrays = {
        "tokens": np.concatenate(seqs).astype(np.int32),
        "response_mask": np.concatenate(mask).astype(np.uint8),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "prompt_lengths": np.asarray(plens, np.int32),
        "stopped": np.asarray(stopped, np.uint8),
        "gen_temperature": np.full(len(seqs), plan.gen_temperature, np.float32),
        "ids": np.asarray(ids, dtype=np.str_),
    }
    for ti, t in enumerate(temps):
        key = corpus_io.temperature_key(t)
        arrays[f"logp_{key}"] = np.concatenate([x[ti] for x in logps]).astype(np.float32)
        arrays[f"entropy_{key}"] = np.concatenate([x[ti] for x in ents]).astype(np.float32)
    return arrays, timing


def _identity(target, items: Sequence[WorkItem], cfg: RegenConfig,
              stop_tokens: tuple[int, ...], skipped: int) -> dict:
    h = hashlib.sha256()
    for w in items:
        h.update(json.dumps([w.id, list(w.tokens)]).encode())
        h.update(b"\n")
    sources: dict[str, int] = {}
    for w in items:
        src = w.id.split("/", 1)[0]
        sources[src] = sources.get(src, 0) + 1
    return {
        "target": {"name": getattr(target, "name", "target"),
                   "config": json.loads(json.dumps(dataclasses.asdict(target.config),
                                                   default=str)),
                   "params_sha256": params_digest(target.params),
                   "params_fingerprint": params_fingerprint(target.params)},
        "settings": {**cfg.to_json(), "stop_tokens": [int(t) for t in stop_tokens]},
        "prompts": {"count": len(items), "sha256": h.hexdigest(), "sources": sources,
                    "skipped_too_long": skipped},
    }


def _check_resume(existing: dict, identity: dict, folder) -> None:
    if "merged_from" in existing:
        raise ValueError(f"{folder} is a merged corpus (`dblast data merge`); regenerate into "
                         "one of its sources (or a new folder) and merge again")
    for key in ("target", "settings", "prompts"):
        old, new = existing.get(key) or {}, identity[key]
        if key == "target" and "params_fingerprint" not in old:
            new = {k: v for k, v in new.items() if k != "params_fingerprint"}  # older corpus
        if old != new:
            diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            raise ValueError(f"{folder} holds a corpus made with a different {key} "
                             f"(differs in {diff}); use a new output folder or the "
                             "original settings to resume")


def regenerate(target, prompts: Sequence[PromptLike], out_dir, cfg: RegenConfig = RegenConfig(),
               *, max_shards: Optional[int] = None, progress: bool = True,
               stop_tokens: Optional[Sequence[int]] = None, mesh=None) -> dict:
    """Make (or resume) a corpus in `out_dir`; returns the manifest.

    target: a `dblast_jax.generation.Target` (config, params, tokenizer, name).
    prompts: `Prompt` records (need the tokenizer) or token-id lists (pre-tokenised).
    max_shards: stop after this many *new* shards, counted over all processes (the
    manifest says `complete: false`).
    mesh: a (data, fsdp, tensor) Mesh over this process's devices
    (`dblast_jax.distributed.local_mesh`): the target is placed on it by the partition
    rules and each batch split over its data axis; None: one device.
    With `jax.process_count() > 1` every process calls this with the same arguments and
    makes its share of the shards (see the module docstring); each returns the manifest.
    One run writes a folder at a time (process 0 holds `out_dir/.lock`; a second run is
    refused). `out_dir` may be `gs://bucket/corpus` (no lock there: one run per folder is
    then up to you).
    """
    return _regenerate(target, prompts, out_dir, cfg, max_shards=max_shards,
                       progress=progress, stop_tokens=stop_tokens, mesh=mesh)


def _check_prompt_ids(items: Sequence[WorkItem], vocab_size: int) -> None:
    for w in items:
        if w.tokens and (min(w.tokens) < 0 or max(w.tokens) >= vocab_size):
            bad = max(w.tokens) if max(w.tokens) >= vocab_size else min(w.tokens)
            raise ValueError(f"prompt {w.id} holds token id {bad}, outside the target's "
                             f"vocabulary of {vocab_size} (ids 0 .. {vocab_size - 1}): the "
                             "prompts were tokenized for another model; tokenize them with "
                             "this target's tokenizer")


# Test hook (never set in normal use): a process that has written this many shards kills
# itself with SIGKILL, as a preempted host would (tests/test_regenerate_multiprocess.py).
_KILL_AFTER_ENV = "DBLAST_TEST_REGEN_KILL_AFTER_SHARDS"
_DONE_SUFFIX = ".done.json"


def _done_record(index: int) -> str:
    """The per-shard record written after the shard: `.shard-NNNNN.npz.done.json`."""
    return f".{corpus_io.shard_name(index)}{_DONE_SUFFIX}"


def _identity_key(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def _finished(folder, manifest: Optional[dict], key: str) -> dict[int, dict]:
    """Shards complete on disk: the manifest's entries and the per-shard records of this
    corpus (same identity) whose file is present with the recorded sha256."""
    done: dict[int, dict] = {}

    def verified(entry) -> bool:
        path = folder / str(entry.get("file", ""))
        return path.is_file() and corpus_io.sha256_path(path) == entry.get("sha256")

    for entry in (manifest or {}).get("shards", []):
        if verified(entry):
            done[entry["index"]] = entry
    for record in sorted(folder.glob(f".shard-*{_DONE_SUFFIX}")):
        try:
            data = json.loads(record.read_text())
            entry, index = data["entry"], int(data["entry"]["index"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable: the shard is made again
        if data.get("identity") == key and index not in done and verified(entry):
            done[index] = entry
    return done


def _write_merged(folder, identity: dict, key: str, n_plans: int) -> dict:
    """(Process 0) the manifest from what is on disk; the records it absorbed are
    removed afterwards (a crash in between leaves duplicates of manifest entries only)."""
    done = _finished(folder, corpus_io.read_manifest(folder), key)
    manifest = {"format": corpus_io.FORMAT, **identity, "num_shards": n_plans,
                "shards": [done[i] for i in sorted(done)], "complete": False}
    _finish(manifest, n_plans)
    corpus_io.write_manifest(folder, manifest)
    for record in folder.glob(f".shard-*{_DONE_SUFFIX}"):
        try:
            index = int(record.name[len(".shard-"):].split(".", 1)[0])
        except ValueError:
            continue
        if index in done:
            record.unlink(missing_ok=True)
    return manifest


def _regenerate(target, prompts: Sequence[PromptLike], out_dir, cfg: RegenConfig, *,
                max_shards: Optional[int], progress: bool,
                stop_tokens: Optional[Sequence[int]], mesh=None) -> dict:
    folder = corpus_io.as_folder(out_dir)  # pathlib locally, epath for gs://
    pid, nproc = jax.process_index(), jax.process_count()
    # Process 0 locks the folder before anything else (a second writer is refused before
    # it reads or checks a thing); the others hear of a refusal with the resume check below.
    lock, error = None, None
    if pid == 0:
        try:  # absent, empty or a corpus folder (io/output_folder.py); then the lock
            check_output_folder(str(folder), "corpus", "--out")
            lock = FolderLock(str(folder), "regeneration",
                              log=print if progress else None).acquire()
        except Exception as e:  # noqa: BLE001 -- the other processes must hear of it too
            if nproc == 1:
                raise
            error = e
    try:
        return _regenerate_locked(target, prompts, folder, cfg, error,
                                  max_shards=max_shards, progress=progress,
                                  stop_tokens=stop_tokens, mesh=mesh)
    finally:
        if lock is not None:
            lock.release()


def _regenerate_locked(target, prompts: Sequence[PromptLike], folder, cfg: RegenConfig,
                       error: Optional[Exception], *, max_shards: Optional[int], progress: bool,
                       stop_tokens: Optional[Sequence[int]], mesh=None) -> dict:
    pid, nproc = jax.process_index(), jax.process_count()
    stops = tuple(int(t) for t in (target.stop_ids if stop_tokens is None else stop_tokens))
    all_items = encode_work(prompts, getattr(target, "tokenizer", None), cfg.system)
    items = [w for w in all_items if len(w.tokens) <= cfg.max_prompt_tokens]
    if not items:
        raise ValueError(f"no prompt fits max_prompt_tokens={cfg.max_prompt_tokens} "
                         f"({len(all_items)} given)")
    _check_prompt_ids(items, target.config.vocab_size)
    limit = target.config.max_position_embeddings
    need = _round_up(max(len(w.tokens) for w in items), cfg.pad_multiple) + cfg.max_new_tokens
    if need > limit:
        raise ValueError(f"longest prompt + max_new_tokens ({need}) exceed the target's "
                         f"context of {limit}; lower max_prompt_tokens or max_new_tokens")
    identity = _identity(target, items, cfg, stops, len(all_items) - len(items))
    key = _identity_key(identity)
    plans = _plan(len(items), cfg)

    # Process 0 (holding the lock): resume check, stray temp files, the manifest of what is
    # done. The others hear the outcome (and the done shards) before anyone writes a shard.
    done = {}
    if pid == 0 and error is None:
        try:
            existing = corpus_io.read_manifest(folder)
            if existing is not None:
                _check_resume(existing, identity, folder)
            folder.mkdir(parents=True, exist_ok=True)  # a no-op on an object store
            if paths.is_local(os.fspath(folder)):  # (object-store writes make no temp files)
                for stray in folder.glob(".*.tmp"):  # temp files of a run killed mid-write
                    stray.unlink(missing_ok=True)
            manifest = _write_merged(folder, identity, key, len(plans))
            done = {e["index"]: e for e in manifest["shards"]}
        except Exception as e:  # noqa: BLE001 -- the other processes must hear of it too
            error = e
    if nproc > 1:
        mask = np.zeros(len(plans) + 1, np.int32)
        mask[-1] = error is None
        for i in done:
            if 0 <= i < len(plans):
                mask[i] = 1
        mask = np.asarray(multihost_utils.broadcast_one_to_all(mask))
        if not mask[-1] and error is None:
            error = ValueError(f"process 0 refused the regeneration into {folder} (its output "
                               "says why)")
        done_indices = {i for i in range(len(plans)) if mask[i]}
        if error is None:  # every process must see process 0's manifest: one shared folder
            error = shared_file_error(folder / corpus_io.MANIFEST)
    else:
        done_indices = set(done)
    if error is not None:
        raise error
    return _generate_shards(target, items, folder, cfg, plans, done_indices, identity,
                            key, stops, max_shards=max_shards, progress=progress, mesh=mesh)


def _generate_shards(target, items, folder, cfg: RegenConfig, plans, done_indices,
                     identity: dict, key: str, stops, *, max_shards, progress, mesh) -> dict:
    pid, nproc = jax.process_index(), jax.process_count()
    todo = [p for p in plans if p.index not in done_indices]
    if max_shards is not None:
        todo = todo[:max(0, max_shards)]
    mine = todo[pid::nproc]  # dealt round-robin: balanced after a resume too
    place = lambda a: jnp.asarray(a)
    if mesh is not None:
        target = dataclasses.replace(target, params=sharding.shard_params(target.params, mesh))
        place = lambda a: jax.device_put(a, sharding.batch_sharding(mesh, np.shape(a)))
    kill_after = int(os.environ.get(_KILL_AFTER_ENV) or 0)

    if nproc == 1:  # the whole corpus, finished shards included
        total = sum(p.end - p.start for p in plans)
        initial = sum(p.end - p.start for p in plans if p.index in done_indices)
    else:  # process 0's share of this run
        total, initial = sum(p.end - p.start for p in mine), 0
    bar = _progress(total=total, initial=initial, enabled=progress and pid == 0)
    t_start, new_tokens = time.perf_counter(), [0]

    def on_batch(n_prompts: int, n_tokens: int) -> None:
        new_tokens[0] += n_tokens
        rate = new_tokens[0] / max(time.perf_counter() - t_start, 1e-9)
        bar.update(n_prompts)
        bar.set_postfix_str(f"{rate:.1f} tok/s" + (f" (process 0 of {nproc})"
                                                   if nproc > 1 else ""))

    manifest = corpus_io.read_manifest(folder) if nproc == 1 else None
    written = 0
    try:
        for plan in mine:
            t0 = time.perf_counter()
            arrays, timing = _run_shard(target, items, plan, cfg, stops, on_batch, place)
            name = corpus_io.shard_name(plan.index)
            digest = corpus_io.write_shard(folder / name, arrays)
            resp = int(arrays["response_mask"].sum())
            entry = {
                "index": plan.index, "file": name, "sha256": digest,
                "gen_temperature": plan.gen_temperature, "prompt_range": [plan.start, plan.end],
                "sequences": int(arrays["offsets"].shape[0] - 1),
                "tokens": int(arrays["tokens"].shape[0]), "response_tokens": resp,
                "seconds": round(time.perf_counter() - t0, 3),
                **{k: round(v, 3) for k, v in timing.items()}}
            atomic_write_json(folder / _done_record(plan.index),
                              {"identity": key, "process": [pid, nproc], "entry": entry})
            if manifest is not None:  # one process: the manifest follows every shard
                manifest["shards"] = sorted(manifest["shards"] + [entry],
                                            key=lambda e: e["index"])
                _finish(manifest, len(plans))
                corpus_io.write_manifest(folder, manifest)
            written += 1
            if kill_after and written >= kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
    finally:
        bar.close()
    barrier("dblast_regenerate_shards")
    if pid == 0:
        manifest = _write_merged(folder, identity, key, len(plans))
        missing = sorted(p.index for p in todo
                         if p.index not in {e["index"] for e in manifest["shards"]})
        if missing:
            print(f"warning: shards {missing} made this run are not in {folder}: with several "
                  "processes the output folder must be one shared folder (NFS, Filestore, "
                  "a gcsfuse bucket) at the same path on every host", flush=True)
    barrier("dblast_regenerate_manifest")
    if pid != 0:
        manifest = corpus_io.read_manifest(folder) or {}
    return manifest


def _finish(manifest: dict, n_plans: int) -> None:
    shards = manifest["shards"]
    manifest["complete"] = len(shards) == n_plans
    manifest["totals"] = {
        "shards": len(shards),
        "sequences": sum(s["sequences"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "response_tokens": sum(s["response_tokens"] for s in shards),
        "generation_seconds": round(sum(s["seconds"] for s in shards), 3),
    }


class _NoBar:
    def update(self, n):
        pass

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass


def _progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm
    return tqdm(total=total, initial=initial, unit="prompt", desc="regenerate",
                dynamic_ncols=True)


def corpus_prompts(folder: Union[str, Path], shards: str) -> list[list[int]]:
    """The chat-templated prompts of corpus shards "A:B" (A .. B-1) as token-id lists.

    Answering them again at another temperature gives a held-out set *sampled at* that
    temperature for the same prompts: the AL estimate is the exact expected acceptance
    only on text drawn from the target at T_v (docs/METHOD.md section 4)."""
    first, stop = corpus_io.parse_shard_range(shards)
    source = corpus_io.Corpus(folder, first_shard=first, max_shards=stop)
    prompts = []
    for i in range(len(source)):
        record = source[i]
        prompts.append([int(t) for t in record["tokens"][:int(record["prompt_length"])]])
    return prompts


def training_work(pools: Optional[Sequence[str]] = None, limit: Optional[int] = None,
                  shuffle_seed: Optional[int] = 0) -> tuple[list[Prompt], list]:
    """The training prompts in a fixed shuffled order (pools mixed), at most `limit`.

    Deduplicated and checked disjoint from every evaluation set. The order depends only
    on `shuffle_seed`, so a partial corpus (see `max_shards`) is a mix of all pools and a
    later run continues it. Returns (prompts, overlaps dropped).
    """
    prompts, dropped = training_prompts(pools)
    if shuffle_seed is not None:
        order = np.random.default_rng(shuffle_seed).permutation(len(prompts))
        prompts = [prompts[i] for i in order]
    if limit is not None:
        prompts = prompts[:limit]
    return prompts, dropped
