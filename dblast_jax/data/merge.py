"""One corpus from shard ranges of several: `dblast data merge`.

Why: a corpus grows in separate folders (more answers to the same prompts with new seeds,
a greedy corpus, a held-out set), and each run of `dblast data regenerate` owns its folder.
Training reads one corpus folder. Merging writes a plain corpus folder whose shards are
the chosen shards of the sources, renumbered in order, so the trainer, the feature cache,
validation and `dblast data stats` read it like any other.

Rules, each checked before anything is written:
- every source was made by the same target (weights digest and config);
- the log-probs kept are those of the temperatures every source stores (or the subset
  `verify_temperatures` asks for); a shard storing more is rewritten without the others,
  a shard storing exactly those is copied byte for byte; an unscored source (tokens only)
  makes the merge unscored;
- a source given as FOLDER:A:B needs all of its shards A .. B-1 finished; a bare FOLDER
  takes the shards finished so far (a corpus still growing: merge again later);
- `exclude_prompts_of` (FOLDER:A:B, e.g. the held-out shards) drops every record whose
  prompt tokens equal one of theirs: pools repeat some prompts under other ids, and an
  answer to a held-out prompt in the training data makes held-out acceptance optimistic.
A merged corpus is not a regeneration: `dblast data regenerate` refuses to write into it.
Rerunning the same merge resumes (shards already written with the right checksum are kept);
a different merge into the same folder is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional, Sequence

import numpy as np

from dblast_jax.data import corpus as corpus_io
from dblast_jax.io import paths
from dblast_jax.io.output_folder import check_output_folder

__all__ = ["MergeSource", "parse_source", "merge_corpora"]


class MergeSource:
    """FOLDER or FOLDER:A:B (shards A .. B-1) of a corpus to merge."""

    def __init__(self, folder: str, first: Optional[int] = None, stop: Optional[int] = None):
        self.folder, self.first, self.stop = str(folder), first, stop

    def __repr__(self) -> str:
        return self.folder + (f":{self.first}:{self.stop}" if self.stop is not None else "")


def parse_source(spec: str) -> MergeSource:
    """"FOLDER" or "FOLDER:A:B" (a gs:// URI keeps its own colon)."""
    parts = str(spec).rsplit(":", 2)
    if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
        first, stop = corpus_io.parse_shard_range(f"{parts[1]}:{parts[2]}")
        return MergeSource(parts[0], first, stop)
    if len(parts) == 3 and (parts[1].isdigit() or parts[2].isdigit()):
        raise ValueError(f"merge source {spec!r}: expected FOLDER or FOLDER:A:B with "
                         "0 <= A < B (shards A .. B-1)")
    return MergeSource(spec)


def _source_shards(src: MergeSource) -> tuple[dict, list[dict]]:
    manifest = corpus_io.read_manifest(src.folder)
    if manifest is None:
        raise FileNotFoundError(f"merge source {src.folder}: no corpus there (missing "
                                f"{corpus_io.MANIFEST})")
    finished = {int(s["index"]): s for s in manifest["shards"]}
    if src.stop is None:
        if not finished:
            raise ValueError(f"merge source {src.folder} has no finished shard yet")
        return manifest, [finished[i] for i in sorted(finished)]
    missing = [i for i in range(src.first, src.stop) if i not in finished]
    if missing:
        raise ValueError(f"merge source {src}: shards {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''} are not finished "
                         f"({len(finished)} of its shards are); run `dblast data regenerate` "
                         "further or choose fewer shards")
    return manifest, [finished[i] for i in range(src.first, src.stop)]


def _target_identity(manifest: dict) -> tuple:
    t = manifest.get("target") or {}
    return t.get("params_sha256"), json.dumps(t.get("config"), sort_keys=True)


def _kept_temperatures(manifests: Sequence[dict], sources: Sequence[MergeSource],
                       wanted: Optional[Sequence[float]]) -> list[float]:
    stored = [{corpus_io.temperature_key(t): float(t)
               for t in m["settings"]["verify_temperatures"]} for m in manifests]
    common = set(stored[0]).intersection(*stored[1:])
    if wanted:
        want = {corpus_io.temperature_key(t): float(t) for t in wanted}
        for src, s in zip(sources, stored):
            lacking = sorted(set(want) - set(s), key=float)
            if lacking:
                raise ValueError(f"merge source {src} stores log-probs at {sorted(s, key=float)}"
                                 f", not at {lacking}")
        return sorted(want.values())
    if not all(stored):  # an unscored source (tokens only): so is the merge
        return []
    if not common:
        raise ValueError("the merge sources share no verification temperature: "
                         + "; ".join(f"{src}: {sorted(s, key=float)}"
                                     for src, s in zip(sources, stored)))
    return sorted(stored[0][k] for k in common)


def _without_sequences(arrays: dict, keep: list[int]) -> dict:
    """The shard's arrays with only sequences `keep` (in order)."""
    off = arrays["offsets"]
    token_idx = (np.concatenate([np.arange(off[s], off[s + 1]) for s in keep])
                 if keep else np.zeros(0, np.int64))
    lengths = np.asarray([off[s + 1] - off[s] for s in keep], np.int64)
    out = {}
    for name, a in arrays.items():
        if name == "offsets":
            out[name] = np.concatenate([[0], np.cumsum(lengths)]).astype(a.dtype)
        elif name in ("tokens", "response_mask") or name.startswith(("logp_", "entropy_")):
            out[name] = a[token_idx]
        else:
            out[name] = a[np.asarray(keep, np.int64)]
    return out


def _copy_shard(src_path, data: bytes, dst_path, keep_keys: set[str], all_keys: set[str],
                excluded: set[bytes]) -> tuple[str, dict]:
    """Write one output shard from the source shard's bytes `data` (checksum verified);
    returns (its sha256, its counts). The bytes are copied when nothing is dropped (same
    file, same checksum), else the shard is rewritten without the log-probs and entropies
    of the temperatures not kept and without the records whose prompt is `excluded`."""
    arrays = corpus_io.read_shard(src_path, data)
    n = len(arrays["prompt_lengths"])
    keep = [s for s in range(n) if corpus_io.prompt_digest(arrays, s) not in excluded]
    if keep_keys == all_keys and len(keep) == n:
        corpus_io.atomic_write_bytes(dst_path, data)
        return hashlib.sha256(data).hexdigest(), {}
    drop = {f"{kind}_{k}" for k in all_keys - keep_keys for kind in ("logp", "entropy")}
    arrays = {k: v for k, v in arrays.items() if k not in drop}
    if len(keep) < n:
        arrays = _without_sequences(arrays, keep)
    counts = {"sequences": len(keep), "tokens": int(arrays["tokens"].shape[0]),
              "response_tokens": int(arrays["response_mask"].sum()),
              "excluded_sequences": n - len(keep)}
    return corpus_io.write_shard(dst_path, arrays), counts


def merge_corpora(sources: Sequence[str | MergeSource], out: str, *,
                  verify_temperatures: Optional[Sequence[float]] = None,
                  exclude_prompts_of: Sequence[str] = (), log=print) -> dict:
    """Write the merged corpus of `sources` (in order) into `out`; returns its manifest."""
    srcs = [s if isinstance(s, MergeSource) else parse_source(s) for s in sources]
    exclusions = [parse_source(x) for x in exclude_prompts_of]
    if not srcs:
        raise ValueError("nothing to merge: give at least one source corpus")
    check_output_folder(out, "corpus", "--out")
    out_abs = os.path.abspath(out) if paths.is_local(out) else out
    for s in srcs:
        if paths.is_local(s.folder) and os.path.abspath(s.folder) == out_abs:
            raise ValueError(f"merge output {out} is also a source; write to a new folder")
    loaded = [_source_shards(s) for s in srcs]
    manifests = [m for m, _ in loaded]
    targets = {_target_identity(m) for m in manifests}
    if len(targets) > 1:
        names = "; ".join(f"{s}: {m['target'].get('name')} "
                          f"{str(m['target'].get('params_sha256'))[:12]}"
                          for s, m in zip(srcs, manifests))
        raise ValueError(f"the merge sources were made by different targets ({names}); a "
                         "drafter learns one target's text and log-probs")
    temps = _kept_temperatures(manifests, srcs, verify_temperatures)
    keep_keys = {corpus_io.temperature_key(t) for t in temps}

    excluded: set[bytes] = set()
    for ex in exclusions:
        excluded |= corpus_io.prompt_digests(corpus_io.Corpus(
            ex.folder, verify=True, first_shard=ex.first or 0, max_shards=ex.stop))

    plan = []  # (source, its manifest, its shard entry) in output order
    for s, (m, entries) in zip(srcs, loaded):
        plan += [(s, m, e) for e in entries]
    spec = {"sources": [{"folder": s.folder, "shards": [e["index"] for e in entries],
                         "shard_sha256": [e["sha256"] for e in entries]}
                        for s, (_, entries) in zip(srcs, loaded)],
            "verify_temperatures": temps,
            "exclude_prompts_of": [str(x) for x in exclude_prompts_of]}

    folder = corpus_io.as_folder(out)
    existing = corpus_io.read_manifest(folder)
    if existing is not None and existing.get("merged_from") != spec:
        what = ("a corpus made by `dblast data regenerate`" if "merged_from" not in existing
                else "a different merge")
        raise ValueError(f"{out} holds {what}; merge into a new folder")
    folder.mkdir(parents=True, exist_ok=True)
    done = {int(e["index"]): e for e in (existing or {}).get("shards", [])}

    shards, copied = [], 0
    for k, (s, m, e) in enumerate(plan):
        name = corpus_io.shard_name(k)
        prev = done.get(k)
        path = folder / name
        if prev and path.is_file() and corpus_io.sha256_path(path) == prev["sha256"]:
            shards.append(prev)
            continue
        src_path = corpus_io.as_folder(s.folder) / e["file"]
        data = src_path.read_bytes() if src_path.is_file() else None
        if data is None or hashlib.sha256(data).hexdigest() != e["sha256"]:
            raise ValueError(f"merge source shard {src_path} is missing or does not match "
                             "its manifest's sha256 (corrupt or replaced)")
        all_keys = {corpus_io.temperature_key(t) for t in m["settings"]["verify_temperatures"]}
        sha, counts = _copy_shard(src_path, data, path, keep_keys, all_keys, excluded)
        entry = {key: e[key] for key in ("sequences", "tokens", "response_tokens",
                                         "gen_temperature") if key in e}
        entry.update(counts, index=k, file=name, sha256=sha, source=f"{s.folder}#{e['index']}")
        shards.append(entry)
        copied += 1
    manifest = {
        "format": corpus_io.FORMAT,
        "target": manifests[0]["target"],
        "settings": {"merged": True, "verify_temperatures": temps,
                     "gen_temperatures": sorted({float(e["gen_temperature"])
                                                 for _, _, e in plan
                                                 if "gen_temperature" in e})},
        "prompts": {"count": sum(e.get("sequences", 0) for e in shards)},
        "merged_from": spec,
        "num_shards": len(shards),
        "shards": shards,
        "complete": True,
        "totals": {"shards": len(shards),
                   "excluded_sequences": sum(e.get("excluded_sequences", 0) for e in shards),
                   "sequences": sum(e.get("sequences", 0) for e in shards),
                   "tokens": sum(e.get("tokens", 0) for e in shards),
                   "response_tokens": sum(e.get("response_tokens", 0) for e in shards)},
    }
    corpus_io.write_manifest(folder, manifest)
    if log:
        t = manifest["totals"]
        log(f"{out}: {t['shards']} shards ({copied} written now), {t['sequences']} sequences, "
            f"{t['response_tokens']} response tokens, "
            + (f"log-probs at {[corpus_io.temperature_key(x) for x in temps]}" if temps
               else "unscored (tokens only)")
            + (f"; {t['excluded_sequences']} record(s) left out for answering a prompt of "
               f"{', '.join(map(str, exclude_prompts_of))}" if exclude_prompts_of else ""))
    return manifest
