"""An unfinished run carried to another machine (dblast carry pack / unpack) resumes there
bit-exactly; a carried run that was altered, or belongs to another experiment, is refused
before anything is written."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from dblast_jax import cli
from dblast_jax.train import carry
from dblast_jax.train import trainer as TR
from conftest import tiny_cfg, tiny_target

STEPS = 6


def _cfg(*more):
    return tiny_cfg("tiny_dflash", f"num_steps={STEPS}", "checkpoint_every=2",
                    "keep_checkpoints=5", "export=false", *more)


def _run(cfg, wd, stop_at=None):
    trainer = TR.Trainer(cfg, str(wd), target=tiny_target(), progress=False,
                         log=lambda s: None)
    try:
        return trainer.run(stop_at=stop_at)
    finally:
        trainer.close()


def _same_params(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
                 jax.device_get(a), jax.device_get(b))


@pytest.fixture(scope="module")
def carried(tmp_path_factory):
    """A run stopped at step 4 on 'machine A' and packed; the reference ran through."""
    root = tmp_path_factory.mktemp("carry")
    reference = _run(_cfg(), root / "reference").params
    _run(_cfg(), root / "a", stop_at=4)
    step = carry.pack_run(root / "a", root / "carried", log=lambda s: None)
    return root, reference, step


def test_carried_run_resumes_bit_exactly_on_another_workdir(carried, tmp_path):
    root, reference, step = carried
    assert step == 4 and carry.carried_step(root / "carried") == 4
    manifest = json.loads((root / "carried" / carry.MANIFEST).read_text())
    ckpts = {rel.split("/")[1] for rel in manifest["files"] if rel.startswith("checkpoints/")}
    assert ckpts == {"4"}  # the newest checkpoint only, not 2
    assert "experiment.json" in manifest["files"] and "metrics.jsonl" in manifest["files"]
    assert not any(rel.startswith(".lock") for rel in manifest["files"])

    wd = tmp_path / "b"  # "machine B": the workdir does not exist
    assert carry.unpack_run(root / "carried", wd, log=lambda s: None) == 4
    result = _run(_cfg(), wd)
    assert result.step == STEPS
    _same_params(result.params, reference)
    steps = [json.loads(line)["step"] for line in open(wd / "metrics.jsonl")]
    assert steps == list(range(1, STEPS + 1))

    # unpacking again into a workdir already past the carried step changes nothing
    before = sorted(os.listdir(wd / "checkpoints"))
    assert carry.unpack_run(root / "carried", wd, log=lambda s: None) is None
    assert sorted(os.listdir(wd / "checkpoints")) == before


def test_repacking_replaces_the_carried_run_whole(carried, tmp_path):
    root, _, _ = carried
    dest = tmp_path / "carried"
    shutil.copytree(root / "carried", dest)
    (dest / "stale_file").write_text("from an older pack")
    assert carry.pack_run(root / "a", dest, log=lambda s: None) == 4
    assert not (dest / "stale_file").exists()
    assert not (tmp_path / "carried.tmp").exists() and not (tmp_path / "carried.old").exists()


def test_altered_or_missing_files_are_refused_and_nothing_is_written(carried, tmp_path):
    root, _, _ = carried
    src = tmp_path / "carried"
    shutil.copytree(root / "carried", src)
    manifest = json.loads((src / carry.MANIFEST).read_text())
    victim = next(rel for rel in manifest["files"] if rel.startswith("checkpoints/")
                  and manifest["files"][rel]["bytes"] > 0)
    path = src / carry.FILES / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    wd = tmp_path / "b"
    with pytest.raises(carry.CarryError, match="does not match its sha256"):
        carry.unpack_run(src, wd, log=lambda s: None)
    assert not wd.exists()
    path.unlink()
    with pytest.raises(carry.CarryError, match="is missing"):
        carry.unpack_run(src, wd, log=lambda s: None)
    (src / carry.MANIFEST).write_text("{not json")
    with pytest.raises(carry.CarryError, match="corrupt"):
        carry.unpack_run(src, wd, log=lambda s: None)
    assert not wd.exists()


def test_another_experiments_workdir_is_refused(carried, tmp_path):
    root, _, _ = carried
    other = tmp_path / "other"
    _run(_cfg("learning_rate=0.5", "loss=nll"), other, stop_at=2)
    with pytest.raises(carry.CarryError, match="another experiment"):
        carry.unpack_run(root / "carried", other, log=lambda s: None)


def test_packing_never_overwrites_what_is_not_a_carried_run(carried, tmp_path):
    root, _, _ = carried
    for dest, make in (("afile", lambda p: p.write_text("mine")),
                       ("afolder", lambda p: (p.mkdir(), (p / "notes.txt").write_text("mine")))):
        make(tmp_path / dest)
        with pytest.raises(carry.CarryError, match="holds no carried run"):
            carry.pack_run(root / "a", tmp_path / dest, log=lambda s: None)
    assert (tmp_path / "afile").read_text() == "mine"
    assert (tmp_path / "afolder" / "notes.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    assert carry.pack_run(root / "a", tmp_path / "empty", log=lambda s: None) == 4


def test_packing_needs_a_workdir_with_a_finished_checkpoint(tmp_path):
    with pytest.raises(carry.CarryError, match="not a training workdir"):
        carry.pack_run(tmp_path, tmp_path / "dest", log=lambda s: None)
    (tmp_path / "experiment.json").write_text("{}")
    with pytest.raises(carry.CarryError, match="no finished checkpoint"):
        carry.pack_run(tmp_path, tmp_path.parent / "dest", log=lambda s: None)
    with pytest.raises(carry.CarryError, match="outside the workdir"):
        carry.pack_run(tmp_path, tmp_path / "dest", log=lambda s: None)


def test_cli_reports_a_missing_carried_run_in_one_line(tmp_path, capsys):
    assert cli.main(["carry", "unpack", str(tmp_path / "nothing"), str(tmp_path / "wd")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no carried run" in err[0]
