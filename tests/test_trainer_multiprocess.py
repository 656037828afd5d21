"""launch/train.py across 2 processes on localhost (CPU collectives: gloo) == 1 process.

The 2-process run has one CPU device per process and is stopped after 2 of 4 steps, then
resumed from the workdir alone (both processes restore their share of the orbax
checkpoint and their data state); the 1-process run has 2 local devices and goes
straight through. Same global mesh (data = 2), same global batches, so the exported
drafters and the logged losses must agree. Gradient accumulation (2 micro-batches) is
on, so the scan path runs under a cross-process mesh too.
"""

import json
import os
import subprocess
import sys

import numpy as np
from conftest import check_process_outputs, cpu_process_env, free_port  # tests/ is on sys.path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(REPO, "launch", "train.py")
COMMON = ["--override=num_steps=4", "--override=checkpoint_every=2",
          "--override=grad_accum_steps=2", "--override=track_al=false", "--progress=false"]
TIMEOUT = 420


def _start(args, devices, log, tmp_path):
    return subprocess.Popen([sys.executable, LAUNCH, *args], cwd=REPO,
                            env=cpu_process_env(devices, str(tmp_path / "jax_cache")),
                            stdout=log, stderr=subprocess.STDOUT)


def _run_pair(args, workdir, tmp_path, tag):
    port = free_port()
    logs = [open(tmp_path / f"{tag}_{i}.log", "w+") for i in range(2)]
    procs = [_start([*args, f"--workdir={workdir}", "--num_processes=2", f"--process_id={i}",
                     f"--coordinator_address=localhost:{port}"], 1, logs[i], tmp_path)
             for i in range(2)]
    return procs, logs


def _finish(procs, logs, what):
    for p in procs:
        try:
            p.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    outs = []
    for log in logs:
        log.seek(0)
        outs.append(log.read())
        log.close()
    return check_process_outputs([p.returncode for p in procs], outs, what)


def _losses(workdir):
    return [json.loads(ln)["loss"] for ln in open(os.path.join(workdir, "metrics.jsonl"))]


def test_two_processes_equal_one(tmp_path):
    from safetensors.numpy import load_file

    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    log1 = open(tmp_path / "one.log", "w+")
    single = _start(["--experiment=tiny_dflash", *COMMON, f"--workdir={one}"], 2, log1,
                    tmp_path)
    procs, logs = _run_pair(["--experiment=tiny_dflash", *COMMON, "--stop_at=2"], two,
                            tmp_path, "first")
    _finish(procs, logs, "2-process run (steps 1-2)")
    assert sorted(os.listdir(os.path.join(two, "checkpoints"))) == ["2"]
    data_dir = os.path.join(two, "checkpoints", "2", "data")
    assert sorted(f for f in os.listdir(data_dir) if f.startswith("process_")) == [
        "process_0-of-2.json", "process_1-of-2.json"]
    assert not os.path.exists(os.path.join(two, "export"))
    # resume with the workdir alone (plus the cluster flags)
    procs, logs = _run_pair([*COMMON[-1:]], two, tmp_path, "resume")
    outs = _finish(procs, logs, "2-process resume (steps 3-4)")
    assert "resumed" in outs[0]
    _finish([single], [log1], "1-process run")

    a = load_file(os.path.join(one, "export", "model.safetensors"))
    b = load_file(os.path.join(two, "export", "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-7, err_msg=k)
    np.testing.assert_allclose(_losses(one), _losses(two), rtol=1e-5)
    assert len(_losses(two)) == 4
