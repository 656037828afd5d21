"""Training and data under faults: a torn metrics line, a full disk, a non-finite step,
data for another target, two writers on one folder. Nothing is lost, nothing is silent:
every failure is one clear error, and the run that follows resumes bit-exactly."""

import errno
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from dblast_jax.data import corpus as corpus_io
from dblast_jax.data import regenerate as regen
from dblast_jax.train import checkpoint as C
from dblast_jax.train import trainer as TR
from dblast_jax.workdir_lock import FolderLock, FolderLockedError
from conftest import tiny_cfg, tiny_target

STEPS = 6
NAN = float("nan")  # one object: configs holding it compare equal (one compiled step)


def _cfg(*more):
    return tiny_cfg("tiny_dflash", f"num_steps={STEPS}", "checkpoint_every=2",
                    "keep_checkpoints=5", "export=false", *more)


def _trainer(cfg, wd, logs=None, **kw):
    return TR.Trainer(cfg, str(wd), target=kw.pop("target", None) or tiny_target(),
                      progress=False, log=(logs.append if logs is not None else lambda s: None),
                      **kw)


def _run(cfg, wd, stop_at=None, logs=None, **kw):
    trainer = _trainer(cfg, wd, logs, **kw)
    try:
        return trainer.run(stop_at=stop_at)
    finally:
        trainer.close()


def _same_params(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
                 jax.device_get(a), jax.device_get(b))


def _metric_steps(wd):
    return [json.loads(ln)["step"] for ln in open(os.path.join(wd, "metrics.jsonl"))]


def _steps_on_disk(wd):
    d = os.path.join(wd, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """STEPS uninterrupted steps: the params every interrupted run must reproduce."""
    return _run(_cfg(), tmp_path_factory.mktemp("reference")).params


# ---- torn logs, leftover temp checkpoints ----------------------------------------------------

def test_torn_metrics_tail_and_orbax_tmp_then_resume(reference, tmp_path):
    wd = str(tmp_path / "torn")
    _run(_cfg(), wd, stop_at=4)
    with open(os.path.join(wd, "metrics.jsonl"), "a") as f:
        f.write('{"step": 5, "loss": 1.2')  # a write cut short: no newline, not JSON
    leftover = os.path.join(wd, "checkpoints", "6.orbax-checkpoint-tmp")
    os.makedirs(leftover)
    open(os.path.join(leftover, "junk"), "w").write("half a checkpoint")
    logs = []
    result = _run(_cfg(), wd, logs=logs)
    assert result.step == STEPS
    assert any("dropped its incomplete last line" in s for s in logs), logs
    _same_params(result.params, reference)
    assert _metric_steps(wd) == list(range(1, STEPS + 1))
    assert not os.path.exists(leftover) and _steps_on_disk(wd) == [2, 4, 6]

    # a corrupt line in the middle is an error naming file and line; nothing is rewritten
    path = os.path.join(wd, "metrics.jsonl")
    lines = open(path).read().splitlines()
    lines[1] = "garbage"
    open(path, "w").write("\n".join(lines) + "\n")
    config_file = os.path.join(wd, C.CONFIG_FILE)
    before = (os.path.getmtime(config_file), open(config_file).read(), open(path).read())
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: corrupt line.*remove or repair"):
        _trainer(_cfg(), wd)
    assert (os.path.getmtime(config_file), open(config_file).read(),
            open(path).read()) == before
    assert not os.path.exists(os.path.join(wd, ".lock"))  # released on the error


# ---- a full disk -------------------------------------------------------------------------------

def test_enospc_in_checkpoint_save_then_resume_bit_exact(reference, tmp_path, monkeypatch):
    """The disk fills up while orbax writes the checkpoint of step 4 (inside its save, as
    a real ENOSPC would): a half-written temporary checkpoint stays behind."""
    wd = str(tmp_path / "enospc_ckpt")
    real_save = C.DataStateHandler.save

    def full_disk(self, directory, item=None, args=None):
        if ".orbax-checkpoint-tmp" in str(directory) and "/4." in str(directory):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(self, directory, item, args)

    monkeypatch.setattr(C.DataStateHandler, "save", full_disk)
    with pytest.raises(TR.TrainingIOError) as err:
        _run(_cfg(), wd)
    msg = str(err.value)
    assert "\n" not in msg and "checkpoint of step 4" in msg and "disk is full" in msg
    assert "free disk space" in msg and "resumes from step 2" in msg
    assert err.value.errno == errno.ENOSPC
    assert _steps_on_disk(wd) == [2]
    leftovers = [n for n in os.listdir(os.path.join(wd, "checkpoints")) if "tmp" in n]
    monkeypatch.setattr(C.DataStateHandler, "save", real_save)  # space is back
    result = _run(_cfg(), wd)
    _same_params(result.params, reference)
    assert _metric_steps(wd) == list(range(1, STEPS + 1))
    assert _steps_on_disk(wd) == [2, 4, 6] and not [
        n for n in os.listdir(os.path.join(wd, "checkpoints")) if "tmp" in n], leftovers


def test_enospc_in_metrics_write_then_resume_bit_exact(reference, tmp_path, monkeypatch):
    """The disk fills up in the middle of a metrics line: half of it is on disk."""
    wd = str(tmp_path / "enospc_metrics")

    class HalfWrite:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            if '"step": 5,' in text:
                self.f.write(text[:len(text) // 2])
                self.f.flush()
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(text)

    def fake_open(path, mode="r", *a, **kw):
        f = open(path, mode, *a, **kw)
        return HalfWrite(f) if str(path).endswith("metrics.jsonl") and "a" in mode else f

    monkeypatch.setattr(TR, "open", fake_open, raising=False)
    with pytest.raises(TR.TrainingIOError, match=r"could not append step 5 to .*metrics.jsonl: "
                                                 r"the disk is full.*step 4"):
        _run(_cfg(), wd)
    monkeypatch.delattr(TR, "open")
    assert not open(os.path.join(wd, "metrics.jsonl")).read().endswith("\n")  # torn
    logs = []
    result = _run(_cfg(), wd, logs=logs)
    assert any("incomplete last line" in s for s in logs)
    _same_params(result.params, reference)
    assert _metric_steps(wd) == list(range(1, STEPS + 1))


def _tensorstore_full_disk(monkeypatch, step):
    """The disk fills up while orbax's background thread writes the arrays of `step`'s
    checkpoint: TensorStore's error, as a real full disk gives it (a ValueError carrying
    the OS error code), for every array of that step."""
    from orbax.checkpoint._src.serialization import serialization as S
    real = S.async_serialize_from_host

    async def full_disk(rslices, tspec, **kw):
        spec = json.dumps(tspec, default=str)
        if f"/{step}.orbax-checkpoint-tmp" in spec:
            raise ValueError(
                f'RESOURCE_EXHAUSTED: Error writing "params" in OCDBT database at local file '
                f'"{step}.orbax-checkpoint-tmp/state/": Failed writing: "{step}.orbax-'
                'checkpoint-tmp/state/d/1f2e": Failed to write 4096 bytes to file 8: No space '
                "left on device [os_error_code='28']")
        return await real(rslices, tspec, **kw)

    monkeypatch.setattr(S, "async_serialize_from_host", full_disk)


def test_enospc_in_the_background_write_is_one_line_naming_the_finished_step(
        reference, tmp_path, monkeypatch, capfd, caplog):
    """Issue 33, cases 3 and 6: the arrays of step 4's checkpoint fail to write in orbax's
    background thread (TensorStore's RESOURCE_EXHAUSTED). Before: ~30 tracebacks logged
    by orbax's threads and asyncio, then TensorStore's message as the error (or a message
    naming step 4, left as 4.orbax-checkpoint-tmp, as the resume point). Now: no record,
    no traceback, one line -- the failed step, the full disk, and step 2, the checkpoint
    that really finished; the rerun resumes there bit-exactly."""
    from dblast_jax import errors
    wd = str(tmp_path / "enospc_async")
    _tensorstore_full_disk(monkeypatch, 4)
    with pytest.raises(TR.TrainingIOError) as err:
        _run(_cfg(), wd)
    assert errors.report(err.value, "dblast train") == 2
    out = capfd.readouterr()
    assert "Traceback" not in out.err and "never retrieved" not in out.err, out.err
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, out.err
    assert lines[0].startswith("dblast train: error: could not save the checkpoint of step 4")
    assert "the disk is full" in lines[0] and "No space left on device" in lines[0]
    assert "training resumes from step 2, its last finished checkpoint" in lines[0]
    noisy = [r for r in caplog.records if r.levelno >= 40 or r.exc_info]
    assert not noisy, [r.getMessage()[:200] for r in noisy]
    assert _steps_on_disk(wd) == [2]
    monkeypatch.undo()  # space is back
    result = _run(_cfg(), wd)
    _same_params(result.params, reference)
    assert _metric_steps(wd) == list(range(1, STEPS + 1))
    assert _steps_on_disk(wd) == [2, 4, 6]


# ---- non-finite steps --------------------------------------------------------------------------

def test_nan_learning_rate_stops_without_saving_or_exporting(tmp_path):
    wd = str(tmp_path / "nan")
    _run(_cfg(), wd, stop_at=2)  # a good checkpoint at step 2
    first = _trainer(_cfg(), wd)
    good = jax.device_get(first.state.params)
    first.close()
    bad = _cfg("export=true").replace(learning_rate=NAN)
    with pytest.raises(TR.NonFiniteError) as err:
        _run(bad, wd)
    msg = str(err.value)
    assert "\n" not in msg and "non-finite training step 3" in msg
    assert "last good checkpoint (step 2) is kept" in msg and "learning_rate" in msg
    assert _steps_on_disk(wd) == [2] and not os.path.exists(os.path.join(wd, "export"))
    again = _trainer(_cfg(), wd)  # the checkpoint on disk is the finite one
    assert again.start_step == 2
    _same_params(again.state.params, good)
    again.close()


def test_nan_with_skip_policy_counts_then_stops(tmp_path):
    wd = str(tmp_path / "skip")
    cfg = _cfg("nonfinite_policy=skip", "max_skipped_steps=2").replace(
        learning_rate=NAN)
    logs = []
    with pytest.raises(TR.NonFiniteError, match=r"step 3 .*after 2 skipped steps"):
        _run(cfg, wd, logs=logs)
    assert sum("update skipped" in s for s in logs) == 2
    rows = [json.loads(ln) for ln in open(os.path.join(wd, "metrics.jsonl"))]
    assert [r["skipped_steps"] for r in rows] == [1, 2]
    # skipped updates were not applied: the checkpoint of step 2 holds the initial params
    state = _trainer(_cfg(), wd)
    fresh = TR.Trainer._fresh_state(state)
    _same_params(state.state.params, fresh.params)
    state.close()


# ---- data for another target -------------------------------------------------------------------

def _write_corpus(folder, max_id, target=None, n=12, temps=(1.0,)):
    """A one-shard corpus whose records hold ids up to max_id, made by `target`
    (the manifest's target record)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    seqs = [rng.integers(1, 40, 20).astype(np.int32) for _ in range(n)]
    seqs[-1][-1] = max_id
    tokens = np.concatenate(seqs)
    arrays = {"tokens": tokens,
              "response_mask": np.concatenate([np.arange(20) >= 4] * n).astype(np.uint8),
              "offsets": np.arange(0, 20 * n + 1, 20).astype(np.int64),
              "prompt_lengths": np.full(n, 4, np.int32), "stopped": np.ones(n, np.uint8),
              "gen_temperature": np.ones(n, np.float32),
              "ids": np.array([f"t/{i}" for i in range(n)], dtype=np.str_)}
    for t in temps:
        arrays[f"logp_{corpus_io.temperature_key(t)}"] = np.full(tokens.shape, -1.0, np.float32)
        arrays[f"entropy_{corpus_io.temperature_key(t)}"] = np.ones(tokens.shape, np.float32)
    digest = corpus_io.write_shard(folder / corpus_io.shard_name(0), arrays)
    corpus_io.write_manifest(folder, {
        "format": corpus_io.FORMAT, "target": target or {"name": "synthetic"},
        "settings": {"verify_temperatures": list(temps)}, "prompts": {}, "num_shards": 1,
        "shards": [{"index": 0, "file": corpus_io.shard_name(0), "sha256": digest,
                    "sequences": n, "tokens": int(tokens.size), "response_tokens": 0,
                    "seconds": 0.0}], "complete": True})
    return str(folder)


def _data_cfg(folder, *more):
    return tiny_cfg("tiny_dflash", f"data={folder}", "verify_temperature=1.0", "seq_len=24",
                    "num_steps=2", "checkpoint_every=2", "export=false", *more)


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path):
    vocab = tiny_target()[0].vocab_size  # 97
    folder = _write_corpus(tmp_path / "big_ids", max_id=150)
    wd = tmp_path / "w"
    with pytest.raises(ValueError, match=rf"big_ids: token id 150 .*vocab_size {vocab}"):
        _trainer(_data_cfg(folder), wd)
    jsonl = tmp_path / "ids.jsonl"
    jsonl.write_text(json.dumps({"tokens": list(range(90, 110)), "loss_mask": [1] * 20}) + "\n")
    with pytest.raises(ValueError, match=rf"ids.jsonl: token id 109 .*vocab_size {vocab}"):
        _trainer(_data_cfg(str(jsonl)), wd)
    assert not os.path.exists(wd)  # refused before anything was written


def test_corpus_of_another_target_is_refused_when_its_logprobs_are_used(tmp_path):
    tcfg, tparams, name = tiny_target()
    other = jax.tree.map(lambda x: x * 1.5, tparams)
    wd = tmp_path / "w"

    def target_record(params, label, full=True, fingerprint=True):
        rec = {"name": label}
        if full:
            rec["params_sha256"] = regen.params_digest(params)
        if fingerprint:
            rec["params_fingerprint"] = regen.params_fingerprint(params)
        return rec

    foreign = _write_corpus(tmp_path / "foreign", 40, target_record(other, name))
    with pytest.raises(ValueError, match=r"foreign was made by target 'tiny-llama-test', whose "
                                         r"weights differ.*logp_source=target"):
        _trainer(_data_cfg(foreign), wd)
    assert not os.path.exists(wd)
    # the fix the message names: the target computes the log-probs itself
    _trainer(_data_cfg(foreign, "logp_source=target"), wd).close()
    # the same weights pass, whatever the name and the dtype the corpus was made in
    for label, params in (("mine", tparams),
                          ("bf16", jax.tree.map(lambda x: x.astype("bfloat16"), tparams))):
        ok = _write_corpus(tmp_path / label, 40, target_record(params, "x"))
        _trainer(_data_cfg(ok), tmp_path / f"w_{label}").close()
    # older manifests (no fingerprint; their params_sha256 is loader-dependent): the name
    # is compared, a mismatch is reported
    for label, rec in (("old", target_record(other, "other", fingerprint=False)),
                       ("nodigest", None)):
        logs = []
        _trainer(_data_cfg(_write_corpus(tmp_path / label, 40, rec)), tmp_path / f"w{label}",
                 logs).close()
        assert any("warning: corpus" in s and "predates" in s for s in logs), logs
    logs = []
    same = _write_corpus(tmp_path / "same", 40, target_record(other, name, fingerprint=False))
    _trainer(_data_cfg(same), tmp_path / "w_same", logs).close()
    assert any("checked by name" in s for s in logs), logs


def test_new_manifests_record_a_dtype_independent_fingerprint():
    _, tparams, _ = tiny_target()
    fp = regen.params_fingerprint(tparams)
    assert fp == regen.params_fingerprint(jax.tree.map(lambda x: x.astype("bfloat16"), tparams))
    assert fp != regen.params_fingerprint(jax.tree.map(lambda x: x * 1.5, tparams))


# ---- one writer per folder -------------------------------------------------------------------

def test_second_writer_is_refused_and_a_stale_lock_taken_over(tmp_path):
    wd = tmp_path / "locked"
    with FolderLock(str(wd), "training"):
        with pytest.raises(FolderLockedError) as err:
            _trainer(_cfg(), wd)
    msg = str(err.value)
    assert "\n" not in msg and f"pid {os.getpid()}" in msg and "started" in msg
    assert "another training" in msg and "close the earlier one" in msg
    assert not os.path.exists(wd / ".lock")

    # a holder in another process; then that process dies and leaves its lock file
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from dblast_jax.workdir_lock import FolderLock
            lock = FolderLock({str(wd)!r}, "training").acquire()
            print("held", flush=True)
            time.sleep(120)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderLockedError, match=f"pid {holder.pid} on host"):
            _trainer(_cfg(), wd)
        # the command line refuses too, with the holder in its message
        cli = subprocess.run(
            [sys.executable, "-m", "dblast_jax.cli", "train", "--experiment", "tiny_dflash",
             "--workdir", str(wd), "--override", "mesh=1,1,1", "--override", "num_steps=2"],
            capture_output=True, text=True, timeout=300,
            env=dict(os.environ, JAX_PLATFORMS="cpu"))
        assert cli.returncode != 0 and f"pid {holder.pid}" in cli.stdout + cli.stderr
    finally:
        holder.kill()
        holder.wait()
    assert json.loads((wd / ".lock").read_text())["pid"] == holder.pid  # left behind
    logs = []
    trainer = _trainer(_cfg(), wd, logs)
    assert any("took over the stale lock" in s and str(holder.pid) in s for s in logs), logs
    assert json.loads((wd / ".lock").read_text())["pid"] == os.getpid()
    trainer.close()
    assert not (wd / ".lock").exists()


def test_regeneration_and_evaluation_folders_are_locked(tmp_path):
    from dblast_jax import evaluate as ev
    out = tmp_path / "out"
    with FolderLock(str(out), "regeneration"):
        with pytest.raises(FolderLockedError, match="another regeneration"):
            regen.regenerate(None, [[1, 2, 3]], out, progress=False)
    with FolderLock(str(out), "evaluation"):
        with pytest.raises(FolderLockedError, match="another evaluation"):
            ev.run_evaluation(None, {}, out_dir=str(out), progress=False)
    assert not out.exists()  # the locks made the folder, and removed it again


def test_regeneration_refuses_prompt_ids_outside_the_vocabulary(tmp_path):
    from dblast_jax.generation import Target
    tcfg, tparams, _ = tiny_target()
    target = Target(tcfg, tparams, None, "tiny")
    with pytest.raises(ValueError, match=r"prompt tokens/1 holds token id 200.*vocabulary of 97"):
        regen.regenerate(target, [[1, 2], [3, 200]], tmp_path / "c", progress=False,
                         stop_tokens=[0])
    assert not (tmp_path / "c").exists()


def test_regenerated_corpus_records_its_target_and_older_ones_still_resume(tmp_path):
    """A regenerated manifest carries the fingerprint the trainer compares; a corpus
    begun before fingerprints existed resumes (and gains one)."""
    from dblast_jax.generation import Target
    tcfg, tparams, name = tiny_target()
    target = Target(tcfg, tparams, None, name)
    cfg = regen.RegenConfig(max_new_tokens=4, batch_size=2, shard_size=2, pad_multiple=8)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10]]
    out = tmp_path / "c"
    m = regen.regenerate(target, prompts, out, cfg, max_shards=1, progress=False,
                         stop_tokens=[0])
    assert m["target"]["params_fingerprint"] == regen.params_fingerprint(tparams)
    regen.check_corpus_target(m, str(out), name, tparams)  # its own target: accepted
    with pytest.raises(ValueError, match="whose weights differ"):
        regen.check_corpus_target(m, str(out), name, jax.tree.map(lambda x: x + 1, tparams))
    old = json.loads((out / corpus_io.MANIFEST).read_text())
    del old["target"]["params_fingerprint"]
    corpus_io.write_manifest(out, old)
    m = regen.regenerate(target, prompts, out, cfg, progress=False, stop_tokens=[0])
    assert m["complete"] and m["target"]["params_fingerprint"] == regen.params_fingerprint(
        tparams)
    assert not (out / ".lock").exists()


def test_lock_without_flock_uses_an_exclusive_file(tmp_path, monkeypatch):
    """File systems without flock: an O_EXCL lock file; a dead holder's is taken over."""
    import dblast_jax.workdir_lock as WL

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(WL.fcntl, "flock", no_flock)
    folder = tmp_path / "nfs"
    with FolderLock(str(folder), "training"):
        with pytest.raises(FolderLockedError, match=f"pid {os.getpid()}"):
            FolderLock(str(folder), "training").acquire()
    assert not (folder / ".lock").exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    folder.mkdir()
    (folder / ".lock").write_text(json.dumps({"host": __import__("socket").gethostname(),
                                              "pid": int(dead), "start_time": "earlier"}))
    logs = []
    with FolderLock(str(folder), "training", log=logs.append):
        assert json.loads((folder / ".lock").read_text())["pid"] == os.getpid()
    assert len(logs) == 1 and f"pid {dead}" in logs[0] and "stale" in logs[0]
