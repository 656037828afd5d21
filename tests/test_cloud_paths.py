"""Cloud paths (dblast_jax.io.paths): workdirs, logs, checkpoints and exports on gs://.

No bucket is reached: `etils.epath.testing.mock_epath` (etils' own test double) sends
every epath call for gs://BUCKET/KEY to TMP/gcs/BUCKET/KEY, and orbax's TensorStore
kvstore for a gs:// path (`gcs_utils.get_kvstore_for_gcs`) is pointed at the same local
folder, so orbax still takes its GCS code paths (commit-file atomicity, no rename). The
`gcs` fixture doing this lives in conftest.py (test_cloud_corpus.py uses it too).
"""

import json
import os

import jax
import numpy as np
import pytest

from dblast_jax.io import atomic, paths
from dblast_jax.train import feature_cache as fc
from dblast_jax.train import metric_writers as MW
from dblast_jax.train import trainer as TR
from conftest import TINY, tiny_cfg, tiny_target


# ---- the path layer ----------------------------------------------------------------------

def test_is_local_and_join():
    assert paths.is_local("runs/a") and paths.is_local("/mnt/gcs/run")  # a fuse mount too
    assert not paths.is_local("gs://bucket/run") and not paths.is_local("s3://b/x")
    assert paths.normalize("gs://bucket/run/") == "gs://bucket/run"
    assert paths.join("gs://bucket/run", "checkpoints") == "gs://bucket/run/checkpoints"
    assert paths.normalize("runs/a") == os.path.abspath("runs/a")


def test_atomic_write_local_keeps_protocol(tmp_path, monkeypatch):
    """Local: temp file in the folder, fsync, os.replace, the umask's mode."""
    calls = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append((a, b)),
                                                     real_replace(a, b)))
    target = tmp_path / "sub" / "x.json"
    paths.atomic_write_json(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}
    assert len(calls) == 1 and os.path.dirname(calls[0][0]) == str(tmp_path / "sub")
    assert os.stat(target).st_mode & 0o777 == atomic.default_file_mode()
    assert os.listdir(tmp_path / "sub") == ["x.json"]  # no temp file left


def test_atomic_write_and_append_on_gs(gcs, monkeypatch):
    """gs://: one object write, no rename (not atomic on GCS); logs rewritten whole."""
    monkeypatch.setattr(os, "replace", lambda *a: pytest.fail("rename on an object store"))
    atomic.atomic_write_text("gs://bucket/run/a.txt", "one")  # the old entry point too
    paths.atomic_write_json("gs://bucket/run/b.json", [1, 2])
    assert paths.read_text("gs://bucket/run/a.txt") == "one"
    assert json.loads(open(os.path.join(gcs, "bucket/run/b.json")).read()) == [1, 2]
    for i in range(3):
        paths.append_text("gs://bucket/run/log.jsonl", json.dumps({"step": i}) + "\n")
    assert paths.read_text("gs://bucket/run/log.jsonl").splitlines() == [
        '{"step": 0}', '{"step": 1}', '{"step": 2}']
    assert sorted(paths.listdir("gs://bucket/run")) == ["a.txt", "b.json", "log.jsonl"]
    assert not os.path.exists("gs:")  # nothing went to a local "gs:" folder


# ---- a training run on gs:// -------------------------------------------------------------

def _cfg(*more):
    return tiny_cfg("tiny_dflash", "num_steps=4", "checkpoint_every=2", "log_every=1",
                    "keep_checkpoints=1", "tensorboard=false", *more)


def _run(cfg, wd, logs, stop_at=None):
    trainer = TR.Trainer(cfg, wd, target=tiny_target(), progress=False, log=logs.append)
    try:
        return trainer.run(stop_at=stop_at)
    finally:
        trainer.close()


def test_train_resume_export_on_gs(gcs):
    from dblast_jax.io.dflash import load_dflash
    from dblast_jax.train.curves import read_metrics
    from dblast_jax.train.restore import export_workdir, restore_drafter

    wd = "gs://bucket/run"
    logs = []
    first = _run(_cfg("export=false"), wd, logs, stop_at=2)
    assert first.workdir == wd and first.step == 2
    assert any("no file locks" in s for s in logs)  # the lock is skipped, in one line
    local = os.path.join(gcs, "bucket", "run")
    assert sorted(os.listdir(local)) == ["checkpoints", "experiment.json", "metrics.jsonl",
                                         "train_config.json"]  # no .lock
    step2 = os.path.join(local, "checkpoints", "2")
    assert os.path.isfile(os.path.join(step2, "commit_success.txt"))  # orbax's GCS commit

    logs = []
    result = _run(_cfg("export=true"), wd, logs)  # resumes at 2, exports at the end
    assert any("resumed gs://bucket/run at step 2" in s for s in logs)
    assert result.step == 4 and result.export_path == "gs://bucket/run/export"
    assert [r["step"] for r in read_metrics(wd)] == [1, 2, 3, 4]
    assert sorted(os.listdir(os.path.join(local, "checkpoints"))) == ["4"]  # keep=1

    restored = restore_drafter(wd, log=lambda s: None)
    assert restored.step == 4
    out = export_workdir(wd, "gs://bucket/export", log=lambda s: None)
    assert out == "gs://bucket/export"
    assert sorted(os.listdir(os.path.join(gcs, "bucket", "export"))) == [
        "config.json", "model.safetensors"]
    dc, params = load_dflash("gs://bucket/export", TINY)
    assert dc.block_size == restored.drafter_config.block_size
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 params, jax.device_get(restored.params))
    # the end-of-run export in the workdir is the same drafter
    _, again = load_dflash("gs://bucket/run/export", TINY)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 again, params)
    # a second export over the first is allowed; a foreign folder is refused
    export_workdir(wd, "gs://bucket/export", log=lambda s: None)
    paths.atomic_write_text("gs://bucket/other/notes.txt", "mine")
    from dblast_jax.io.dflash import ExportError
    with pytest.raises(ExportError, match="not empty and not a previous drafter export"):
        export_workdir(wd, "gs://bucket/other", log=lambda s: None)


# ---- what stays local --------------------------------------------------------------------

def test_feature_cache_on_gs_is_refused(gcs):
    with pytest.raises(ValueError, match=r"feature_cache must be a local path .*"
                                         r"memory-mapped.*local disk"):
        fc.check_local("gs://bucket/cache")
    with pytest.raises(ValueError, match="feature_cache must be a local path"):
        fc.FeatureCache("gs://bucket/cache/abc")
    cfg = _cfg("feature_cache=gs://bucket/cache")
    with pytest.raises(ValueError, match="feature_cache must be a local path"):
        TR.Trainer(cfg, "gs://bucket/run2", target=tiny_target(), progress=False,
                   log=lambda s: None)
    assert not os.path.exists(os.path.join(gcs, "bucket", "run2"))  # nothing written
    fc.check_local("/tmp/cache")  # local: fine


def test_tensorboard_on_gs_needs_google_cloud_storage(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("google.cloud")
                        else real(name, *a))
    with pytest.raises(ImportError, match="google-cloud-storage.*tensorboard=false"):
        MW.TensorBoardWriter("gs://bucket/run/tensorboard", primary=True)
    with pytest.raises(ValueError, match="tensorboard=false"):
        MW.TensorBoardWriter("hf://x/y", primary=True)
    MW.TensorBoardWriter("/tmp/local_tb", primary=True)  # local: nothing checked or made
