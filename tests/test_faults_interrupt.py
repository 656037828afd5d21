"""Issue 33, case 7: Ctrl-C. SIGINT sent to a running `dblast data regenerate` and a running
`dblast eval` ends each with one line ("interrupted; rerun the same command to resume"),
status 130 and no traceback (before: a KeyboardInterrupt traceback, for regeneration
then a segmentation fault, status 139); rerunning the same command finishes the work
exactly as an uninterrupted run does."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dblast_jax import cli
from conftest import REPO_ROOT, make_corpus

LINE = "interrupted; rerun the same command to resume"


def _interrupt(argv, ready, timeout=240):
    """Run `dblast ARGV` as a program, send SIGINT once `ready()` holds; -> (status,
    stderr). Fails when the command ends before it could be interrupted."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_DEFAULT_MATMUL_PRECISION="highest")
    env.pop("DBLAST_DEBUG", None)
    # a test run started in the background by a shell (`pytest ... &`, nohup) inherits
    # SIGINT ignored, and Python then keeps ignoring it: give the program the default
    # handling a terminal's Ctrl-C meets
    proc = subprocess.Popen([sys.executable, "-m", "dblast_jax.cli", *argv], cwd=REPO_ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert proc.poll() is None, f"ended before the interrupt: {proc.communicate()}"
            assert time.monotonic() < deadline, "never got ready"
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def _one_line(err, prog):
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines == [f"{prog}: {LINE}"], err


def test_sigint_during_regeneration_then_the_same_command_resumes_exactly(tmp_path):
    src = make_corpus(tmp_path / "src")  # 37 prompts: 13 shards of 3
    common = ["--model", "tiny-llama", "--prompts-from", f"{src}:0:3", "--max-new-tokens",
              "8", "--batch-size", "2", "--shard-size", "3", "--no-progress"]
    out, ref = tmp_path / "out", tmp_path / "ref"
    argv = ["data", "regenerate", "--out", str(out), *common]
    status, err = _interrupt(argv, lambda: (out / ".shard-00000.npz.done.json").exists())
    assert status == 130, err
    _one_line(err, "dblast data regenerate")
    manifest = json.loads((out / "manifest.json").read_text())
    assert not manifest["complete"] and not (out / ".lock").exists()
    assert cli.main(argv) == 0  # the same command: resumes
    assert cli.main(["data", "regenerate", "--out", str(ref), *common]) == 0
    shards = sorted(p.name for p in ref.glob("shard-*.npz"))
    assert len(shards) == 13 and sorted(p.name for p in out.glob("shard-*.npz")) == shards
    for name in shards:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    assert json.loads((out / "manifest.json").read_text())["complete"]


def _rows(folder):
    """rows.jsonl without the timings (wall-clock), in unit order."""
    rows = [json.loads(line) for line in (folder / "rows.jsonl").read_text().splitlines()]
    drop = ("seconds", "tokens_per_s", "time")
    clean = [{k: v for k, v in r.items() if not any(d in k for d in drop)} for r in rows]
    return sorted(clean, key=lambda r: (r["method"], r["prompt_ids"]))


def test_sigint_during_evaluation_then_the_same_command_resumes_exactly(tmp_path):
    common = ["--model", "tiny-smollm2", "--drafter", "n=ngram", "--benchmarks", "gsm8k",
              "--temperatures", "0", "--prompts-per-benchmark", "4", "--max-new-tokens", "8",
              "--no-progress"]
    out, ref = tmp_path / "out", tmp_path / "ref"
    argv = ["eval", "--out", str(out), *common]
    rows = out / "rows.jsonl"
    status, err = _interrupt(argv, lambda: rows.exists() and rows.stat().st_size > 0)
    assert status == 130, err
    _one_line(err, "dblast eval")
    before = rows.read_text().splitlines()
    assert 1 <= len(before) < 8 and not (out / ".lock").exists()
    assert cli.main(argv) == 0  # the same command: the finished rows are kept, not redone
    assert rows.read_text().splitlines()[:len(before)] == before
    assert cli.main(["eval", "--out", str(ref), *common]) == 0
    assert len(_rows(out)) == 8 and _rows(out) == _rows(ref)


@pytest.mark.parametrize("debug", [False, True])
def test_interrupted_is_one_line_and_status_130_in_process(monkeypatch, capsys, debug):
    """cli.main called as a function returns 130 (it ends the process only when it is
    the program); --debug adds the traceback."""
    from dblast_jax.data import cli_commands

    def ctrl_c(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_commands, "cmd_data_stats", ctrl_c)
    monkeypatch.delenv("DBLAST_DEBUG", raising=False)
    argv = (["--debug"] if debug else []) + ["data", "stats", "x"]
    assert cli.main(argv) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"dblast data stats: {LINE}"
    assert ("Traceback" in err) == debug
