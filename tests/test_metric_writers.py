"""Live metrics (train/metric_writers.py): TensorBoard event files read back without
TensorFlow (the TFRecord framing parsed here, CRCs checked), what a row contributes
(non-numeric and non-finite values skipped), the optional W&B hook with a fake `wandb`,
its clear error when wandb is missing, a short training run with validation and a
resume, and the evaluation's scalar summary."""

import glob
import json
import os
import struct
import sys
import types

import pytest

from dblast_jax import evaluate as ev
from dblast_jax.train import config as TC
from dblast_jax.train import metric_writers as MW
from dblast_jax.train import trainer as TR
from conftest import tiny_cfg, tiny_target  # tests/ is on sys.path (pytest "prepend")

tbx = pytest.importorskip("tensorboardX")
from tensorboardX.proto import event_pb2  # noqa: E402
from tensorboardX.record_writer import masked_crc32c  # noqa: E402


def read_events(logdir):
    """[(file, Event)] of every event file in `logdir` (sorted by name: by start time),
    from the TFRecord framing: uint64 length, masked crc32c of it, payload, its crc."""
    out = []
    for path in sorted(glob.glob(os.path.join(str(logdir), "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            data = f.read()
        pos = 0
        while pos < len(data):
            header = data[pos:pos + 8]
            (n,) = struct.unpack("<Q", header)
            (hcrc,) = struct.unpack("<I", data[pos + 8:pos + 12])
            assert hcrc == masked_crc32c(header), path
            payload = data[pos + 12:pos + 12 + n]
            (pcrc,) = struct.unpack("<I", data[pos + 12 + n:pos + 16 + n])
            assert len(payload) == n and pcrc == masked_crc32c(payload), path
            pos += 16 + n
            event = event_pb2.Event()
            event.ParseFromString(payload)
            out.append((path, event))
    return out


def read_scalars(logdir):
    """{tag: [(step, value), ...]} in file order."""
    out = {}
    for _, e in read_events(logdir):
        for v in e.summary.value:
            out.setdefault(v.tag, []).append((e.step, v.simple_value))
    return out


def test_tensorboard_round_trip_skips_what_is_not_a_finite_number(tmp_path):
    logdir = tmp_path / "tb"
    w = MW.TensorBoardWriter(str(logdir), primary=True)
    assert not logdir.exists()  # nothing written yet: no empty event file
    w.write_scalars(1, {"step": 1, "loss": 2.5, "tokens": 384, "nan": float("nan"),
                        "inf": float("inf"), "name": "x", "flag": True, "none": None,
                        "top1": [0.5, float("nan"), 0.25], "nested": [[1.0]]}, "train")
    w.write_scalars(2, {"loss": 1.25})
    w.close()
    again = MW.TensorBoardWriter(str(logdir), primary=True)  # a restart in the same second
    again.write_scalars(3, {"loss": 1.0})
    again.close()
    assert len(os.listdir(logdir)) == 2  # the first file is not overwritten
    got = read_scalars(logdir)
    assert got == {"train/loss": [(1, 2.5)], "train/tokens": [(1, 384.0)],
                   "train/top1/0": [(1, 0.5)], "train/top1/2": [(1, 0.25)],
                   "loss": [(2, 1.25), (3, 1.0)]}


def test_scalar_items_and_numpy_values():
    np = pytest.importorskip("numpy")
    row = {"a": np.float32(0.5), "b": np.asarray(3), "c": np.zeros(2), "d": -1,
           "e": [np.float64(1.0), "x"]}
    assert dict(MW.scalar_items(row, "p")) == {"p/a": 0.5, "p/b": 3.0, "p/d": -1.0,
                                               "p/e/0": 1.0}


def test_other_processes_write_nothing(tmp_path):
    w = MW.TensorBoardWriter(str(tmp_path / "tb"), primary=False)
    w.write_scalars(1, {"loss": 1.0})
    w.close()
    assert not (tmp_path / "tb").exists()
    cfg = TC.TrainConfig(wandb_project="p")  # not even imported off the primary
    assert isinstance(MW.make_train_writer(cfg, str(tmp_path), primary=False), MW.NullWriter)


class FakeRun:
    def __init__(self, calls, kw):
        self.calls = calls
        calls.append(("init", kw))

    def log(self, data, step=None):
        self.calls.append(("log", dict(data), step))

    def finish(self):
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: FakeRun(calls, kw)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return calls


def test_wandb_writer_with_a_fake_wandb(fake_wandb, tmp_path):
    w = MW.WandbWriter("proj", name="run1", config={"lr": 0.1}, dir=str(tmp_path / "w"),
                       primary=True)
    w.write_scalars(3, {"step": 3, "loss": 0.5, "bad": float("nan")}, "train")
    w.write_scalars(4, {"text": "only text"})  # nothing left: no log call
    w.close()
    w.close()  # idempotent
    assert fake_wandb == [
        ("init", {"project": "proj", "name": "run1", "config": {"lr": 0.1},
                  "dir": str(tmp_path / "w")}),
        ("log", {"train/loss": 0.5}, 3),
        ("finish",)]


def test_missing_wandb_is_one_clear_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ImportError) as info:
        MW.WandbWriter("proj", primary=True)
    text = str(info.value)
    assert "pip install wandb" in text and "\n" not in text and "'proj'" in text
    cfg = TC.get_experiment("tiny_dflash", ["wandb_project=proj"])
    with pytest.raises(ImportError, match="pip install wandb"):
        MW.make_train_writer(cfg, str(tmp_path), primary=True)


def test_fan_out_and_config_fields(tmp_path, fake_wandb):
    cfg = TC.get_experiment("tiny_dflash", ["wandb_project=p", "wandb_run_name=r"])
    assert cfg.tensorboard and TC.TrainConfig().wandb_project == ""  # laptop defaults
    w = MW.make_train_writer(cfg, str(tmp_path), start_step=5, primary=True)
    assert isinstance(w, MW.FanOutWriter)
    w.write_scalars(6, {"loss": 1.0}, "train")
    w.close()
    assert read_scalars(tmp_path / MW.TENSORBOARD_DIR) == {"train/loss": [(6, 1.0)]}
    assert fake_wandb[0][1]["name"] == "r" and fake_wandb[0][1]["config"]["wandb_project"] == "p"
    assert [c[0] for c in fake_wandb] == ["init", "log", "finish"]
    off = TC.apply_overrides(cfg, ["tensorboard=false", "wandb_project="])
    assert isinstance(MW.make_train_writer(off, str(tmp_path), primary=True), MW.NullWriter)
    # logging settings change neither the compiled step nor the run's identity
    assert TR._step_cache_key(off) == TR._step_cache_key(cfg)
    assert TC.TrainConfig.from_dict(off.to_dict()) == off


def test_training_writes_train_and_heldout_scalars_and_resume_purges(tmp_path, fake_wandb):
    cfg = tiny_cfg("tiny_dflash", "num_steps=4", "validate_every=2", "validation_batches=1",
                   "checkpoint_every=2", "export=false", "wandb_project=proj")
    wd = str(tmp_path / "run")
    first = TR.Trainer(cfg, wd, target=tiny_target(), progress=False, log=lambda s: None)
    try:
        first.run(stop_at=2)
    finally:
        first.close()
    assert ("finish",) in fake_wandb
    logged = [c for c in fake_wandb if c[0] == "log"]
    assert [c[2] for c in logged if "train/loss" in c[1]] == [1, 2]
    assert [c[2] for c in logged if "heldout/nll" in c[1]] == [2]

    second = TR.Trainer(cfg, wd, target=tiny_target(), progress=False, log=lambda s: None)
    try:
        second.run()
    finally:
        second.close()
    logdir = os.path.join(wd, MW.TENSORBOARD_DIR)
    events = read_events(logdir)
    files = sorted({p for p, _ in events})
    assert len(files) == 2  # one per start of the run
    # the resumed writer tells TensorBoard to hide earlier events from step 3 on
    starts = [e.step for p, e in events if p == files[1] and e.HasField("session_log")]
    assert starts == [3]
    scalars = read_scalars(logdir)
    for tag in ("train/loss", "train/grad_norm", "train/lr", "train/al_estimate",
                "train/prior_entropy", "train/tokens_per_s", "heldout/nll",
                "heldout/top1_mean", "heldout/al_estimate", "heldout/validation_s"):
        assert tag in scalars, (tag, sorted(scalars))
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4]
    assert [s for s, _ in scalars["heldout/nll"]] == [2, 4]
    with open(os.path.join(wd, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    for row, (step, value) in zip(rows, scalars["train/loss"]):
        assert row["step"] == step and value == pytest.approx(row["loss"], rel=1e-6)


def test_eval_scalar_summary(tmp_path):
    rows = [
        {"method": "plain", "benchmark": "gsm", "temperature": 1.0, "prompt_ids": ["a"],
         "new_tokens": 10, "seconds": 2.0},
        {"method": "d1", "benchmark": "gsm", "temperature": 1.0, "prompt_ids": ["a"],
         "new_tokens": 10, "seconds": 1.0, "steps": 2, "tau": 2.0, "tau_expected": 2.1,
         "histogram": [0, 2]},
    ]
    cells = ev.aggregate(rows)
    result = ev.write_tables(cells, tmp_path)
    for _ in range(2):  # a rerun replaces the summary
        logdir = ev.write_scalar_summary(result, tmp_path)
    assert len(glob.glob(str(logdir / "events.out.tfevents.*"))) == 1
    got = read_scalars(logdir)
    assert got["tau/d1/gsm/T1.0"] == [(0, 2.0)]
    assert got["tau_expected/d1/gsm/T1.0"] == [(0, pytest.approx(2.1))]
    assert got["speedup/d1/gsm/T1.0"] == [(0, 2.0)]
    assert got["tokens_per_s/plain/gsm/T1.0"] == [(0, 5.0)]
    assert got["tau/d1/macro/T1.0"] == [(0, 2.0)]
    assert "tau/plain/gsm/T1.0" not in got  # plain has no tau: skipped, not written as 0
    # the same numbers again (a resumed evaluation with nothing left): the file is kept
    before = sorted(glob.glob(str(logdir / "events.out.tfevents.*")))
    (logdir / "keep-me").write_text("x")
    ev.write_scalar_summary(result, tmp_path)
    assert sorted(glob.glob(str(logdir / "events.out.tfevents.*"))) == before
    # other numbers: replaced
    rows[1]["tau"] = 3.0
    ev.write_scalar_summary(ev.write_tables(ev.aggregate(rows), tmp_path), tmp_path)
    after = glob.glob(str(logdir / "events.out.tfevents.*"))
    assert len(after) == 1 and read_scalars(logdir)["tau/d1/gsm/T1.0"] == [(0, 3.0)]
