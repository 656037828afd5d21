"""A tokens-only copy of a regenerated corpus: `dblast data drop-scores SRC --out DST`.

Why: a corpus stores three float32 arrays per verification temperature and token
(log-prob, entropy), ~90% of its bytes. Data a trainer scores itself (its feature cache
computes the log-probs at T_v in the pass that writes the taps, train/feature_cache.py) do
not need them, and a tokens-only corpus is small enough to keep in a git repository.

The copy is the corpus `dblast data regenerate --verify-temperatures none` with the same
settings writes (the unscored run samples the same tokens from the same keys), so that
command resumes it: a scored run started earlier is converted and continued unscored.
Each shard is rewritten without its `logp_*` / `entropy_*` arrays and re-checksummed;
shards already copied with the right checksum are kept (a killed copy resumes).
"""

from __future__ import annotations

import copy
import os

from dblast_jax.data import corpus as corpus_io
from dblast_jax.io.output_folder import check_output_folder

__all__ = ["drop_scores"]


def drop_scores(src: str, out: str, *, log=print) -> dict:
    """Write the unscored copy of corpus `src` into `out`; returns its manifest."""
    check_output_folder(out, "corpus", "--out")
    manifest = corpus_io.read_manifest(src)
    if manifest is None:
        raise FileNotFoundError(f"no corpus at {src} (missing {corpus_io.MANIFEST})")
    if "merged_from" in manifest:
        raise ValueError(f"{src} is a merged corpus: drop the scores of its sources, or merge "
                         "with an unscored source (the merge is then unscored)")
    if os.path.abspath(src) == os.path.abspath(out):
        raise ValueError(f"drop-scores output {out} is its source; write to a new folder")
    folder = corpus_io.as_folder(out)
    existing = corpus_io.read_manifest(folder)
    new = copy.deepcopy(manifest)
    new["settings"]["verify_temperatures"] = []
    if existing is not None and any(existing.get(k) != new.get(k)
                                    for k in ("target", "settings", "prompts")):
        raise ValueError(f"{out} holds another corpus (its target, settings or prompts "
                         "differ); write to a new folder")
    folder.mkdir(parents=True, exist_ok=True)
    kept = {int(e["index"]): e for e in (existing or {}).get("shards", [])}
    shards = []
    for e in sorted(manifest["shards"], key=lambda e: e["index"]):
        path = folder / e["file"]
        prev = kept.get(int(e["index"]))
        if prev and path.is_file() and corpus_io.sha256_path(path) == prev["sha256"]:
            shards.append(prev)
            continue
        src_path = corpus_io.as_folder(src) / e["file"]
        if not src_path.is_file() or corpus_io.sha256_path(src_path) != e["sha256"]:
            raise ValueError(f"corpus shard {src_path} is missing or does not match its "
                             "manifest's sha256 (corrupt or replaced)")
        arrays = {k: v for k, v in corpus_io.read_shard(src_path).items()
                  if not k.startswith(("logp_", "entropy_"))}
        shards.append({**e, "sha256": corpus_io.write_shard(path, arrays)})
    new["shards"] = shards
    corpus_io.write_manifest(folder, new)
    if log:
        log(f"{out}: {len(shards)} shards, unscored (tokens only)")
    return new
