"""One rule for every folder a command writes: absent, empty, or a folder of its own kind.

`dblast export` has always refused a folder that is neither empty nor a previous export
(io/dflash.py); the other writers follow the same rule through `check_output_folder`,
called before anything is written (and before the folder's lock, workdir_lock.py):

    corpus            dblast data regenerate --out, dblast data merge --out,
                      launch/make_data.py --out
    feature cache     TrainConfig.feature_cache (--override feature_cache=DIR)
    evaluation        dblast eval --out, launch/evaluate.py --out
    validation        dblast validate --out
    training workdir  dblast train --workdir, launch/train.py --workdir (train())
    demo              dblast demo --workdir

A folder is accepted when it is absent, empty, or of the writer's own kind: it holds the
kind's record (a corpus manifest.json, a workdir's experiment.json, an evaluation's
run_config.json, ...) -- a resume; files of the user's beside the record are left alone --
or it holds nothing but files that writer makes (a first run cut short before its
record). Entries every writer leaves and that are never in the way: the lock file
(`.lock`), the temporary files of atomic writes (`.NAME.XXXXXXXX.tmp`), `.DS_Store` and
`.gitkeep`. Anything else is refused with one line (OutputFolderError, a ValueError)
naming the folder, the files in the way and the flag to pick another folder; nothing is
written. A path that is a file is refused the same way. Object-store folders (gs://) are
listed through io/paths.py.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from typing import Callable, Optional

from dblast_jax.io import paths

__all__ = ["FolderKind", "OutputFolderError", "KINDS", "check_output_folder",
           "entries_in_the_way"]

# never in the way: the lock (workdir_lock.LOCK_FILE), atomic writes' temp files
# (io/atomic.py: ".NAME.XXXXXXXX.tmp"), and two files tools drop into any folder
ALWAYS_ALLOWED = (".lock", ".*.tmp", ".DS_Store", ".gitkeep")


class OutputFolderError(ValueError):
    """An output folder that is not absent, empty or of the writer's kind (one line)."""


@dataclasses.dataclass(frozen=True)
class FolderKind:
    """What one writer leaves in its folder.

    what: what the writer writes, in messages ("corpus"); folder: a folder of this kind
    ("corpus folder"); own: glob patterns of every entry the writer makes; record: the
    entry marking a folder of this kind ("." the folder itself), `is_record(path)`
    telling a real one from a file of the same name."""
    what: str
    folder: str
    own: tuple[str, ...]
    record: str
    is_record: Callable[[str], bool]


def _json_with(path: str, *keys: str, value: Optional[tuple[str, str]] = None) -> bool:
    """True when `path` is a JSON object holding `keys` (and key == value, if given)."""
    try:
        data = json.loads(paths.read_text(path))
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    if not isinstance(data, dict) or not all(k in data for k in keys):
        return False
    return value is None or data.get(value[0]) == value[1]


def _corpus_manifest(path: str) -> bool:
    from dblast_jax.data.corpus import FORMAT  # the corpus module imports this one's package
    return _json_with(path, "shards", value=("format", FORMAT))


def _feature_cache(folder: str) -> bool:
    from dblast_jax.train.feature_cache import FORMAT
    if not paths.isdir(folder):
        return False
    return any(_json_with(paths.join(folder, sub, "meta.json"), value=("format", FORMAT))
               for sub in paths.listdir(folder)
               if fnmatch.fnmatch(sub, _HEX16) and paths.isdir(paths.join(folder, sub)))


_HEX16 = "[0-9a-f]" * 16  # a feature cache's subfolder: its fingerprint's first 16 digits

KINDS = {
    "corpus": FolderKind(
        "corpus", "corpus folder",
        ("manifest.json", "shard-*.npz", ".shard-*.npz.done.json"),
        "manifest.json", _corpus_manifest),
    "feature cache": FolderKind(
        "feature cache", "feature cache folder", (_HEX16,), ".", _feature_cache),
    "self-prompts": FolderKind(
        "self-written prompts", "self-prompts folder", ("prompts.jsonl", "state.json"),
        "state.json", lambda p: _json_with(p, "format", "settings", "kept")),
    "evaluation": FolderKind(
        "evaluation", "evaluation folder",
        ("rows.jsonl", "rows.process-*.jsonl", "run_config.json", "results.json",
         "results.csv", "results.md", "tau_vs_temperature.png", "acceptance_histograms.png",
         "per_position_acceptance.png", "tensorboard"),
        "run_config.json", lambda p: _json_with(p, "max_new_tokens", "verify_mode")),
    "validation": FolderKind(
        "validation tables", "validation folder",
        ("validation.json", "validation.md", "prefix_acceptance.png"),
        "validation.json", lambda p: _json_with(p, "settings", "results")),
    "training workdir": FolderKind(
        "training run", "training workdir",
        ("experiment.json", "train_config.json", "checkpoints", "metrics.jsonl",
         "validation.jsonl", "train_head_tokens.json", "tensorboard", "export"),
        "experiment.json", lambda p: _json_with(p, "drafter_config", "loss")),
    "demo": FolderKind(
        "demo", "demo folder", ("demo_config.json",), "demo_config.json",
        lambda p: _json_with(p, "seed")),
}


def _matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def entries_in_the_way(folder: str, kind: FolderKind) -> list[str]:
    """The entries of existing `folder` that neither `kind`'s writer nor any writer makes
    (sorted; [] for a folder this writer may write into from scratch)."""
    return sorted(n for n in paths.listdir(folder)
                  if not _matches(n, ALWAYS_ALLOWED) and not _matches(n, kind.own))


def _brief(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_output_folder(folder: paths.PathLike, kind: str, flag: str) -> str:
    """Check `folder` before a writer of `kind` (a KINDS key) touches it; `flag` is how the
    user picks another folder ("--out", "--workdir", ...). Returns "absent", "empty" or
    "resume" (a folder of this kind, or holding only files this writer makes); raises
    OutputFolderError otherwise, with nothing written."""
    spec = KINDS[kind]
    text = paths.normalize(folder)
    if paths.isfile(text):
        raise OutputFolderError(f"{text} is a file, not a folder: the {spec.what} needs a "
                                f"folder; pick another path with {flag}")
    if not paths.isdir(text):
        return "absent"
    record = text if spec.record == "." else paths.join(text, spec.record)
    if (spec.record == "." or paths.exists(record)) and spec.is_record(record):
        return "resume"
    in_the_way = entries_in_the_way(text, spec)
    if not in_the_way:
        visible = [n for n in paths.listdir(text) if not _matches(n, ALWAYS_ALLOWED)]
        return "resume" if visible else "empty"
    return _refuse(text, spec, in_the_way, flag)


def _refuse(folder: str, spec: FolderKind, in_the_way: list[str], flag: str):
    article = "an" if spec.folder[0] in "aeiou" else "a"
    raise OutputFolderError(
        f"refusing to write the {spec.what} into {folder}: it is neither empty nor {article} "
        f"{spec.folder} to resume (it holds {_brief(in_the_way)}); nothing was written. "
        f"Pick an absent or empty folder with {flag}, or move those files away")
