"""Issue 18, export and loading: an export never destroys files it did not write, never
writes a half folder or non-finite weights, and loading reads exactly the files it is
meant to (the pretrained manifest's, one checkpoint per folder).

Policy checked here: export writes into an absent or empty folder, or over a previous
export (a drafter config.json and only files an export writes). Any other folder is
refused in one line that names the files export would write and `--force`; with
force, config.json and model.safetensors (the files export writes) are replaced -- a
foreign config.json included -- and every other file is kept byte for byte.
"""

import errno
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from dblast_jax import pretrained
from dblast_jax.config import DrafterConfig, TargetConfig
from dblast_jax.io import atomic, dflash
from dblast_jax.io.safetensors_io import write_safetensors
from dblast_jax.models import drafter as D

QWEN = TargetConfig.tiny_qwen3()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_drafter(seed=0, **kw):
    kw.setdefault("num_layers", 1)
    kw.setdefault("block_size", 4)
    kw.setdefault("mask_token_id", 7)
    dc = DrafterConfig.for_target(QWEN, **kw)
    gen = np.random.default_rng(seed)
    dp = jax.tree.map(lambda a: jnp.asarray(gen.standard_normal(a.shape, np.float32)),
                      D.abstract_drafter_params(dc, QWEN))
    return dc, dp


def snapshot(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def fake_hf_model(folder):
    """A user's Hugging Face model folder: two shards + index, tokenizer, config."""
    folder.mkdir(parents=True)
    save_file({"a": np.ones((3,), np.float32)}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({"b": np.zeros((2,), np.float32)}, str(folder / "model-00002-of-00002.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                        "b": "model-00002-of-00002.safetensors"}}))
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"],
                                                    "hidden_size": 40}))
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    return snapshot(folder)


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "dblast_jax.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})


def error_lines(stderr):
    return [line for line in stderr.splitlines() if "error" in line.lower()]


def assert_clean(parent, expected):
    """No temporary or backup folder left beside the destination."""
    assert sorted(os.listdir(parent)) == sorted(expected)


# ---- destination folder policy ---------------------------------------------------------

def test_export_onto_a_model_folder_is_refused_then_forced(tmp_path):
    dc, dp = tiny_drafter()
    src = tmp_path / "src"
    dflash.export_drafter(dp, dc, str(src))
    hf = tmp_path / "hf"
    before = fake_hf_model(hf)

    proc = run_cli("export", str(src), "--out", str(hf), "--target", "tiny-qwen3")
    assert proc.returncode != 0, proc.stdout
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert str(hf) in lines[0] and "--force" in lines[0]
    assert "config.json, model.safetensors" in lines[0] and "tokenizer.json" in lines[0]
    assert snapshot(hf) == before  # every file byte-identical
    assert_clean(tmp_path, ["src", "hf"])

    with pytest.raises(dflash.ExportError, match="not a previous drafter export") as err:
        dflash.export_drafter(dp, dc, str(hf))
    assert "\n" not in str(err.value)
    assert snapshot(hf) == before

    with pytest.warns(UserWarning, match="kept the folder's other weight files"):
        dflash.export_drafter(dp, dc, str(hf), force=True)
    after = snapshot(hf)
    assert set(after) == set(before) | {"model.safetensors"}
    for name in before:
        if name != "config.json":  # the only file export writes that was there
            assert after[name] == before[name], name
    assert after["config.json"] == (src / "config.json").read_bytes()
    assert after["model.safetensors"] == (src / "model.safetensors").read_bytes()
    assert_clean(tmp_path, ["src", "hf"])
    # the user's index does not list the drafter's weights: loading says so, never mixes
    with pytest.raises(ValueError, match="model.safetensors beside model.safetensors.index.json"):
        dflash.load_dflash(str(hf), QWEN)


def test_export_over_a_previous_export(tmp_path):
    dc, dp = tiny_drafter()
    out = tmp_path / "out"
    dflash.export_drafter(dp, dc, str(out))
    dp2 = jax.tree.map(lambda x: x * 2, dp)
    dflash.export_drafter(dp2, dc, str(out), dtype="bfloat16")  # allowed: it is ours
    _, back = dflash.load_dflash(str(out), QWEN)
    np.testing.assert_array_equal(np.asarray(back["fc"]["kernel"]),
                                  np.asarray(dp2["fc"]["kernel"].astype(jnp.bfloat16)
                                             .astype(jnp.float32)))
    assert_clean(tmp_path, ["out"])
    # an empty folder is fine too (and keeps the umask's folder mode)
    (tmp_path / "empty").mkdir()
    dflash.export_drafter(dp, dc, str(tmp_path / "empty"))
    assert sorted(os.listdir(tmp_path / "empty")) == ["config.json", "model.safetensors"]
    # a previous export with a file of the user's beside it is no longer only ours
    (out / "NOTES.md").write_text("mine")
    before = snapshot(out)
    with pytest.raises(dflash.ExportError, match=r"NOTES\.md.*--force"):
        dflash.export_drafter(dp, dc, str(out))
    assert snapshot(out) == before
    dflash.export_drafter(dp, dc, str(out), force=True)
    assert (out / "NOTES.md").read_text() == "mine"


def test_export_to_a_file_or_unwritable_folder(tmp_path, monkeypatch):
    dc, dp = tiny_drafter()
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"precious")
    with pytest.raises(dflash.ExportError, match="it is a file, not a folder") as err:
        dflash.export_drafter(dp, dc, str(file))
    assert str(file) in str(err.value) and "\n" not in str(err.value)
    assert file.read_bytes() == b"precious"

    if os.geteuid() != 0:  # root ignores permissions
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        try:
            with pytest.raises(dflash.ExportError, match="not writable") as err:
                dflash.export_drafter(dp, dc, str(locked))
            assert str(locked) in str(err.value)
        finally:
            locked.chmod(0o700)

    def denied(parent, name, kind):
        path = os.path.join(parent, f".{name}.{kind}")
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(dflash, "_make_temp_dir", denied)
    dest = tmp_path / "dest"
    with pytest.raises(dflash.ExportError, match="Permission denied") as err:
        dflash.export_drafter(dp, dc, str(dest))
    assert str(dest) in str(err.value) and "\n" not in str(err.value)
    assert err.value.errno == errno.EACCES and not dest.exists()


@pytest.mark.parametrize("previous", [False, True])
def test_full_disk_leaves_the_destination_unchanged(tmp_path, monkeypatch, previous):
    dc, dp = tiny_drafter()
    out = tmp_path / "out"
    if previous:
        dflash.export_drafter(dp, dc, str(out))
    before = snapshot(out) if previous else None
    real = dflash._write_weights

    def full(tensors, path):
        real(tensors, path)
        with open(path, "r+b") as f:  # half a file, then the disk is full
            f.truncate(os.path.getsize(path) // 2)
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(dflash, "_write_weights", full)
    dp2 = jax.tree.map(lambda x: x + 1, dp)
    with pytest.raises(dflash.ExportError, match="No space left on device") as err:
        dflash.export_drafter(dp2, dc, str(out))
    assert isinstance(err.value, ValueError) and err.value.errno == errno.ENOSPC
    assert str(out) in str(err.value) and "\n" not in str(err.value)
    if previous:
        assert snapshot(out) == before
    else:
        assert not out.exists()
    assert_clean(tmp_path, ["out"] if previous else [])


def test_failure_while_moving_in_rolls_back(tmp_path, monkeypatch):
    dc, dp = tiny_drafter()
    out = tmp_path / "out"
    dflash.export_drafter(dp, dc, str(out))
    before = snapshot(out)
    real_replace = os.replace
    calls = []

    def flaky(src, dst, *a, **kw):
        calls.append(dst)
        if len(calls) == 2:  # the second file of the export
            raise OSError(errno.EIO, "Input/output error", dst)
        return real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", flaky)
    with pytest.raises(dflash.ExportError, match="Input/output error"):
        dflash.export_drafter(jax.tree.map(lambda x: x + 1, dp), dc, str(out))
    monkeypatch.undo()
    assert snapshot(out) == before
    assert_clean(tmp_path, ["out"])


def test_non_finite_parameters_are_refused(tmp_path):
    dc, dp = tiny_drafter()
    dp["layers"][0]["mlp"]["down_proj"]["kernel"] = (
        dp["layers"][0]["mlp"]["down_proj"]["kernel"].at[0, 0].set(jnp.inf).at[1, 1].set(jnp.nan))
    with pytest.raises(dflash.ExportError,
                       match=r"tensor layers\.0\.mlp\.down_proj\.weight .*2 non-finite") as err:
        dflash.export_drafter(dp, dc, str(tmp_path / "out"))
    assert "nothing was written" in str(err.value)
    assert_clean(tmp_path, [])


# ---- loading reads exactly the intended files --------------------------------------------

def test_pretrained_folder_refuses_unlisted_tensor_files(tmp_path):
    root = tmp_path / "pretrained"
    shutil.copytree(pretrained.pretrained_root(), root)
    name, entry = sorted(pretrained.available(root=root).items())[0]
    folder = pretrained.pretrained_folder(name, root)  # as shipped: fine
    for extra in ("model-extra.safetensors", "pytorch_model.bin"):
        (folder / extra).write_bytes(b"x")
        with pytest.raises(ValueError, match=rf"{extra} that .*manifest.json does not list"):
            pretrained.pretrained_folder(name, root)
        (folder / extra).unlink()
    (folder / "README.md").write_text("notes are not tensors")
    assert pretrained.pretrained_folder(name, root) == folder


def test_several_safetensors_need_an_index(tmp_path):
    dc, dp = tiny_drafter()
    out = tmp_path / "out"
    dflash.export_drafter(dp, dc, str(out))
    save_file({"fc.weight": np.zeros((40, 80), np.float32)}, str(out / "zz.safetensors"))
    with pytest.raises(ValueError, match=r"several safetensors files \(model.safetensors, "
                                         r"zz.safetensors\) and no \*.safetensors.index.json"):
        dflash.load_dflash(str(out), QWEN)
    # an index ties them together, and a file it does not list is refused
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "model.safetensors" for k in
                        ["fc.weight"]}}))
    with pytest.raises(ValueError, match="zz.safetensors beside model.safetensors.index.json"):
        dflash.load_dflash(str(out), QWEN)


def test_a_weights_file_as_drafter_says_pass_the_folder(tmp_path):
    from dblast_jax.generation import Target, drafter_from_spec
    dc, dp = tiny_drafter()
    dflash.export_drafter(dp, dc, str(tmp_path / "d"))
    target = Target(QWEN, None, None, "a-target")  # loading a drafter reads only the config
    with pytest.raises(ValueError, match="is a file; pass the folder that holds config.json"):
        drafter_from_spec(str(tmp_path / "d" / "model.safetensors"), target)


def test_export_of_a_pretrained_spec(tmp_path, monkeypatch):
    from dblast_jax.generation import Target, drafter_from_spec, load_drafter
    target = Target(QWEN, None, None, "tiny-qwen3")  # the preset's config; no weights needed
    config, params = tiny_drafter(num_categories=2, expander_width=8)
    src = tmp_path / "src"
    dflash.export_drafter(params, config, str(src))
    root = tmp_path / "pretrained"
    pretrained.add_pretrained("tiny-k2", src, target="tiny-qwen3", root=root, info={})
    env = {pretrained.ENV_VAR: str(root)}
    out = tmp_path / "out"
    proc = run_cli("export", "pretrained:tiny-k2", "--out", str(out), "--target", "tiny-qwen3",
                   env=env)
    assert proc.returncode == 0, proc.stderr
    back = load_drafter(out, target)
    monkeypatch.setenv(pretrained.ENV_VAR, str(root))
    shipped = drafter_from_spec("pretrained:tiny-k2", target)
    assert back.config == shipped.config.replace(name=back.config.name)
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(shipped.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- file modes ------------------------------------------------------------------------

@pytest.mark.parametrize("umask,file_mode,dir_mode", [(0o022, 0o644, 0o755),
                                                      (0o027, 0o640, 0o750)])
def test_written_files_get_the_umask_mode(tmp_path, umask, file_mode, dir_mode):
    from dblast_jax.data import corpus
    from dblast_jax.train import checkpoint
    old = os.umask(umask)
    try:
        dc, dp = tiny_drafter()
        out = tmp_path / "out"
        dflash.export_drafter(dp, dc, str(out))
        atomic.atomic_write_bytes(tmp_path / "a.bin", b"1")
        atomic.atomic_write_text(tmp_path / "a.txt", "1")
        atomic.atomic_write_json(tmp_path / "a.json", {"a": 1})
        corpus.atomic_write_bytes(tmp_path / "c.bin", b"1")
        checkpoint._atomic_write_json(str(tmp_path / "k.json"), {"a": 1})
        pretrained.add_pretrained("m", out, target="tiny-qwen3", root=tmp_path / "p", info={})
        (tmp_path / "hf").mkdir()
        names = write_safetensors({"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)},
                                  tmp_path / "hf", max_shard_bytes=16)  # shards + index
    finally:
        os.umask(old)
    assert atomic.default_file_mode() == 0o666 & ~old
    assert (out.stat().st_mode & 0o777) == dir_mode
    files = [out / "config.json", out / "model.safetensors", tmp_path / "a.bin",
             tmp_path / "a.txt", tmp_path / "a.json", tmp_path / "c.bin", tmp_path / "k.json",
             tmp_path / "p" / "manifest.json"] + [tmp_path / "hf" / n for n in names]
    assert {str(f): f.stat().st_mode & 0o777 for f in files} == {str(f): file_mode
                                                                  for f in files}
    assert json.loads((tmp_path / "k.json").read_text()) == {"a": 1}
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temp files left
