"""Issue 15, export and restore on any topology: a workdir trained on a (2, 2, 2) mesh of
8 devices exports on 8 devices, on 1 device (a fresh process with one CPU device) and on
another mesh to byte-identical files -- the same bytes the trainer exported at the end of
its run -- without the training data and without the training's device count. A missing
or corrupt checkpoint and a workdir a training is writing end in one line (exit 2)."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from dblast_jax import cli
from dblast_jax.train import restore as R
from dblast_jax.workdir_lock import FolderLock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = ["--experiment", "tiny_dflash", "--override", "num_steps=2",
         "--override", "checkpoint_every=1", "--override", "mesh=2,2,2",
         "--override", "batch_size=4", "--override", "seq_len=24",
         "--override", "anchors_per_sequence=2", "--override", "track_al=false",
         "--override", "export=true"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny run on 8 devices, mesh data=2, fsdp=2, tensor=2 (checkpoints at steps 1, 2;
    the trainer's own export of step 2 in workdir/export)."""
    assert len(jax.devices()) == 8
    wd = str(tmp_path_factory.mktemp("topology") / "run")
    assert cli.main(["train", "--workdir", wd, *TRAIN]) == 0
    assert sorted(os.listdir(os.path.join(wd, "checkpoints"))) == ["1", "2"]
    return wd


def _files(folder):
    return (open(os.path.join(folder, "model.safetensors"), "rb").read(),
            json.load(open(os.path.join(folder, "config.json"))))


def _cli_one_device(*args):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get(
                   "PYTHONPATH", ""))
    code = ("import jax, sys; assert len(jax.devices()) == 1, jax.devices(); "
            "from dblast_jax import cli; sys.exit(cli.main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_export_on_eight_devices_and_on_one_are_identical(workdir, tmp_path):
    trained = _files(os.path.join(workdir, "export"))  # Trainer.export at the run's end
    # (a) this process, 8 devices: restored onto the training mesh (2, 2, 2), sharded
    restored = R.restore_drafter(workdir, log=lambda s: None)
    assert restored.step == 2 and dict(restored.mesh.shape) == {"data": 2, "fsdp": 2,
                                                                 "tensor": 2}
    fc = restored.params["fc"]["kernel"]
    assert len(fc.sharding.device_set) == 8
    assert fc.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    out8 = str(tmp_path / "out8")
    assert cli.main(["export", workdir, "--out", out8]) == 0
    assert _files(out8) == trained
    # (b) a fresh process with ONE device: the (2, 2, 2) mesh does not fit; no error
    out1 = str(tmp_path / "out1")
    proc = _cli_one_device("export", workdir, "--out", out1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exported drafter to" in proc.stdout
    assert "onto mesh {'data': 1, 'fsdp': 1, 'tensor': 1} (1 device)" in proc.stdout
    one = _files(out1)
    assert one[0] == trained[0]  # model.safetensors byte-identical
    assert one[1] == trained[1]  # config.json equal
    # another mesh on these 8 devices, and --dtype still applies
    assert cli.main(["export", workdir, "--out", str(tmp_path / "fsdp8"),
                     "--mesh", "1,-1,1"]) == 0
    assert _files(str(tmp_path / "fsdp8")) == trained
    assert cli.main(["export", workdir, "--out", str(tmp_path / "bf16"),
                     "--dtype", "bfloat16"]) == 0
    assert json.load(open(tmp_path / "bf16" / "config.json"))["torch_dtype"] == "bfloat16"
    # the workdir is left as it was: no lock, no train_config rewrite, no new step
    assert not os.path.exists(os.path.join(workdir, ".lock"))
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1", "2"]


def test_restore_mesh_fits_the_devices_present():
    assert dict(R.restore_mesh((8, 1, 1)).shape) == {"data": 8, "fsdp": 1, "tensor": 1}
    # 16 devices are not here: every device on the fsdp axis
    assert dict(R.restore_mesh((16, 1, 1)).shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    one = R.restore_mesh((2, 2, 2), devices=jax.devices()[:1])
    assert one.size == 1


def test_workdir_drafter_for_evaluation(workdir):
    """eval / validate take NAME=WORKDIR: its latest checkpoint, on one device."""
    from dblast_jax.generation import drafter_from_spec, load_drafter, load_target
    target = load_target("tiny-llama")
    a = drafter_from_spec(workdir, target)
    b = load_drafter(os.path.join(workdir, "export"), target)
    assert a.config == b.config.replace(name=a.config.name)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# a failed orbax restore can leave tensorstore reads finishing after orbax's event loop
# closed ("Event loop is closed" from their callbacks): noise of the library, not ours
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_export_refusals_are_one_line(workdir, tmp_path, capsys):
    out = str(tmp_path / "out")
    # a mesh these devices cannot hold
    assert cli.main(["export", workdir, "--out", out, "--mesh", "16,1,1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs 16 devices; 8 available" in err and "\n" not in err
    # a workdir a training is writing
    with FolderLock(workdir, "training"):
        assert cli.main(["export", workdir, "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert "in use by another training" in err and "\n" not in err
    assert not os.path.exists(out)
    # a workdir without a checkpoint (a run stopped before its first one)
    empty = tmp_path / "empty"
    empty.mkdir()
    for name in ("train_config.json", "experiment.json"):
        shutil.copy(os.path.join(workdir, name), empty / name)
    assert cli.main(["export", str(empty), "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds no checkpoint" in err and "\n" not in err
    assert not os.path.exists(out) and sorted(os.listdir(empty)) == [
        "experiment.json", "train_config.json"]
    # a corrupt checkpoint: its array data overwritten
    bad = tmp_path / "bad"
    shutil.copytree(workdir, bad, ignore=shutil.ignore_patterns("export"))
    data = bad / "checkpoints" / "2" / "state"
    for root, _, files in os.walk(data):
        for name in files:
            if root.endswith(os.sep + "d"):
                with open(os.path.join(root, name), "wb") as f:
                    f.write(b"\0garbage")
    assert cli.main(["export", str(bad), "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot restore the checkpoint" in err and "incomplete or corrupt" in err, err
    assert "restore step 1" in err and "\n" not in err
    assert not os.path.exists(out)


def test_read_only_workdir_is_read_without_its_lock(workdir, tmp_path, monkeypatch, capsys):
    import errno

    def denied(self):
        raise PermissionError(errno.EACCES, "Permission denied", self.path)

    monkeypatch.setattr(FolderLock, "acquire", denied)
    out = str(tmp_path / "out")
    assert cli.main(["export", workdir, "--out", out]) == 0
    assert "without its lock" in capsys.readouterr().out
    assert _files(out) == _files(os.path.join(workdir, "export"))
