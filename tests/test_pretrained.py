"""Drafters shipped in the repository (`pretrained/`): registration, sha256 checks, the
`pretrained:NAME` spec, and the committed manifest itself."""

import json

import numpy as np
import pytest

from dblast_jax import pretrained
import jax

from dblast_jax.config import DrafterConfig
from dblast_jax.generation import (drafter_from_spec, export_drafter, init_drafter,
                                   load_target, named_drafters)


@pytest.fixture(scope="module")
def tiny_target():
    return load_target("tiny-qwen3")


@pytest.fixture
def shipped(tmp_path, tiny_target, monkeypatch):
    """A pretrained tree holding one K = 4 drafter for tiny-qwen3."""
    config = DrafterConfig.for_target(tiny_target.config, num_layers=1, block_size=4,
                                      num_categories=4)
    drafter = init_drafter(tiny_target, config, 0)
    export = export_drafter(drafter, tmp_path / "export")
    root = tmp_path / "pretrained"
    root.mkdir()
    pretrained.add_pretrained("tiny-k4", export, target="tiny-qwen3", root=root,
                              info={"description": "random K = 4", "steps": 0})
    monkeypatch.setenv(pretrained.ENV_VAR, str(root))
    return root, drafter


def test_spec_loads_the_same_weights(shipped, tiny_target):
    root, drafter = shipped
    entry = pretrained.available("tiny-qwen3")["tiny-k4"]
    assert entry["steps"] == 0 and set(entry["files"]) == {"config.json", "model.safetensors"}
    assert pretrained.available("tiny-llama") == {}
    loaded = drafter_from_spec("pretrained:tiny-k4", tiny_target)
    assert loaded.name == "tiny-k4" and loaded.config.num_categories == 4
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(drafter.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # evaluation specs (NAME=pretrained:X@settings) resolve the same way
    named = named_drafters(["k4mix=pretrained:tiny-k4@mode=mixture"], tiny_target)
    assert named["k4mix"].sampling_overrides == {"verify_mode": "mixture"}


def test_corrupt_missing_or_unknown_is_refused(shipped, tiny_target):
    root, _ = shipped
    weights = root / "tiny-qwen3" / "tiny-k4" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256 .*corrupt or replaced"):
        drafter_from_spec("pretrained:tiny-k4", tiny_target)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        pretrained.pretrained_folder("tiny-k4")
    with pytest.raises(ValueError, match="unknown pretrained drafter 'nope'; available: tiny-k4"):
        pretrained.pretrained_folder("nope")
    (root / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        pretrained.available()


def test_wrong_target_is_refused(shipped):
    with pytest.raises(ValueError, match="trained for target 'tiny-qwen3', not 'tiny-llama'"):
        drafter_from_spec("pretrained:tiny-k4", load_target("tiny-llama"))


def test_not_an_export_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a drafter export"):
        pretrained.add_pretrained("x", tmp_path, target="tiny-qwen3", info={},
                                  root=tmp_path / "p")


def test_committed_drafters_match_their_checksums():
    """Every drafter in the repository's manifest is present and intact."""
    root = pretrained.pretrained_root()
    manifest = json.loads((root / pretrained.MANIFEST).read_text())
    assert manifest["drafters"], "the repository ships no pretrained drafter"
    for name, entry in manifest["drafters"].items():
        folder = pretrained.pretrained_folder(name, root)  # raises on any mismatch
        config = json.loads((folder / "config.json").read_text())
        assert config["torch_dtype"] == "bfloat16"
        for key in ("target", "experiment", "steps", "description", "results"):
            assert key in entry, (name, key)


def test_root_is_the_env_var_else_package_data_else_the_repository(tmp_path, monkeypatch):
    """A wheel carries pretrained/ as package data (dblast_jax/pretrained_drafters, see
    setup.py); a clone installed with `pip install -e .` reads the repository's folder."""
    monkeypatch.delenv(pretrained.ENV_VAR, raising=False)
    if not pretrained.PACKAGE_DATA.is_dir():  # running from a checkout
        assert pretrained.pretrained_root() == pretrained.REPOSITORY
    monkeypatch.setattr(pretrained, "PACKAGE_DATA", tmp_path / "data")
    assert pretrained.pretrained_root() == pretrained.REPOSITORY
    (tmp_path / "data").mkdir()
    assert pretrained.pretrained_root() == tmp_path / "data"
    (tmp_path / "data" / pretrained.MANIFEST).write_text(json.dumps({"drafters": {"x": {
        "target": "tiny-qwen3", "folder": "tiny-qwen3/x", "files": {"config.json": "0"}}}}))
    with pytest.raises(FileNotFoundError, match="reinstall dblast_jax"):
        pretrained.pretrained_folder("x")
    monkeypatch.setenv(pretrained.ENV_VAR, str(tmp_path / "elsewhere"))
    assert pretrained.pretrained_root() == tmp_path / "elsewhere"
