"""Trained drafters that ship with the repository (`pretrained/`), checked by sha256.

There is no model hub to fetch from, so the drafters of the SmolLM2 reproduction are
committed as bfloat16 exports (the DFlash layout: config.json + model.safetensors) under
`pretrained/<target>/<name>/`, listed in `pretrained/manifest.json` with each file's
sha256 and how the drafter was trained. Anywhere a drafter folder is accepted
(`dblast generate --drafter`, `dblast eval --drafter NAME=...`, `dblast validate`), the
spec `pretrained:NAME` resolves here, after the checksums are verified; `dblast demo`
evaluates the ones made for its target beside the drafters it trains.

The folder is `$DBLAST_PRETRAINED_DIR`, else the package data of an installed wheel
(setup.py maps `pretrained/` to `dblast_jax/pretrained_drafters/`), else the clone's
`pretrained/` beside the package (`pip install -e .`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional

from dblast_jax.io.atomic import atomic_write_json

__all__ = ["PREFIX", "MANIFEST", "pretrained_root", "read_manifest", "available",
           "pretrained_folder", "is_pretrained_spec", "add_pretrained"]

PREFIX = "pretrained:"
MANIFEST = "manifest.json"
ENV_VAR = "DBLAST_PRETRAINED_DIR"
# where a wheel (non-editable install) carries the repository's pretrained/ (setup.py)
PACKAGE_DATA = Path(__file__).resolve().parent / "pretrained_drafters"
REPOSITORY = Path(__file__).resolve().parents[1] / "pretrained"
# files a loader could take weights from; a pretrained folder may hold only those the
# manifest lists (an unlisted one would be read, or shadow a listed one, unchecked)
TENSOR_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".npz", ".h5",
                   ".msgpack", ".index.json")


def is_tensor_file(name: str) -> bool:
    return name.endswith(TENSOR_SUFFIXES)


def pretrained_root(root: Optional[str | os.PathLike] = None) -> Path:
    """`root`, else $DBLAST_PRETRAINED_DIR, else the installed package data, else the
    repository's `pretrained/`."""
    if root is not None:
        return Path(root)
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    return PACKAGE_DATA if PACKAGE_DATA.is_dir() else REPOSITORY


def _restore_hint(base: Path) -> str:
    if base == PACKAGE_DATA:
        return "reinstall dblast_jax"
    return "restore it with `git checkout -- pretrained`"


def read_manifest(root: Optional[str | os.PathLike] = None) -> dict[str, Any]:
    """The manifest ({"drafters": {name: entry}}); an empty one when there is none."""
    path = pretrained_root(root) / MANIFEST
    if not path.exists():
        return {"drafters": {}}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"pretrained manifest {path} is not valid JSON: {e}") from e
    if not isinstance(data.get("drafters"), dict):
        raise ValueError(f"pretrained manifest {path} has no 'drafters' mapping")
    return data


def available(target: Optional[str] = None,
              root: Optional[str | os.PathLike] = None) -> dict[str, dict[str, Any]]:
    """name -> manifest entry, only those made for `target` (a preset name) when given."""
    drafters = read_manifest(root)["drafters"]
    return {name: entry for name, entry in drafters.items()
            if target is None or entry.get("target") == target}


def file_sha256(path: os.PathLike | str) -> str:
    """sha256 hex digest of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pretrained_folder(name: str, root: Optional[str | os.PathLike] = None, *,
                      target: Optional[str] = None) -> Path:
    """The export folder of the pretrained drafter `name`, its files checked against the
    manifest's sha256 (a truncated or altered file is refused, never loaded). `target`
    (a preset name) refuses a drafter made for another target model."""
    base = pretrained_root(root)
    drafters = read_manifest(root)["drafters"]
    if name not in drafters:
        known = ", ".join(sorted(drafters)) or f"none (no {base / MANIFEST})"
        raise ValueError(f"unknown pretrained drafter {name!r}; available: {known}")
    entry = drafters[name]
    if target is not None and entry.get("target") != target:
        raise ValueError(f"pretrained drafter {name!r} was trained for target "
                         f"{entry.get('target')!r}, not {target!r}")
    folder = base / entry["folder"]
    if folder.is_dir():
        unlisted = sorted(p.name for p in folder.iterdir()
                          if is_tensor_file(p.name) and p.name not in entry["files"])
        if unlisted:
            raise ValueError(f"pretrained drafter {name!r}: {folder} holds tensor file(s) "
                             f"{', '.join(unlisted)} that {base / MANIFEST} does not list "
                             "(only the manifest's checked files may be loaded; remove them)")
    for file, want in entry["files"].items():
        path = folder / file
        if not path.exists():
            raise FileNotFoundError(f"pretrained drafter {name!r}: {path} is missing "
                                    f"({_restore_hint(base)})")
        got = file_sha256(path)
        if got != want:
            raise ValueError(f"pretrained drafter {name!r}: sha256 of {path} is {got}, "
                             f"the manifest says {want} (corrupt or replaced file; "
                             f"{_restore_hint(base)})")
    return folder


def is_pretrained_spec(spec: str) -> bool:
    return spec.startswith(PREFIX)


def add_pretrained(name: str, export_folder: str | os.PathLike, *, target: str,
                   info: Mapping[str, Any], root: Optional[str | os.PathLike] = None
                   ) -> Path:
    """Copy an export folder into the pretrained tree and record it (sha256 of every file,
    `info`: how it was trained) in the manifest, written atomically."""
    src = Path(export_folder)
    files = sorted(p.name for p in src.iterdir() if p.is_file())
    if "config.json" not in files or not any(f.endswith(".safetensors") for f in files):
        raise ValueError(f"{src} is not a drafter export (config.json + *.safetensors)")
    base = pretrained_root(root)
    rel = f"{target}/{name}"
    dest = base / rel
    dest.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(src / f, dest / f)
    manifest = read_manifest(root)
    old = manifest["drafters"].get(name, {})
    if old.get("folder") == rel:  # a re-registered drafter: drop its files no longer written
        for f in set(old.get("files", {})) - set(files):
            (dest / f).unlink(missing_ok=True)
    manifest["drafters"][name] = {"target": target, "folder": rel, **dict(info),
                                  "files": {f: file_sha256(dest / f) for f in files}}
    atomic_write_json(base / MANIFEST, manifest, indent=2, sort_keys=True)
    return dest
