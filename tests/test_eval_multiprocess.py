"""Evaluation and validation across 2 processes on localhost (CPU collectives: gloo) == 1.

Each run is this file as a script (`python tests/test_eval_multiprocess.py OUT [cluster
flags]`, one CPU device per process): `dblast validate` with the cluster flags (the
held-out batches dealt to the processes, the per-batch metrics gathered and summed in
batch order), then `run_evaluation` of two random drafters on tiny-llama with token
prompts (the units dealt round-robin, a rows file per process, process 0 merging them and
writing the tables). The 2-process tables equal the 1-process ones in every column that
is not a timing (tau, its SE, expected tau exactly; speedup / tokens_per_s / seconds
differ), the validation results are identical; a resumed run redoes only the unit whose
row was lost (a cut line in a process's rows file) and changes nothing else.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import check_process_outputs, cpu_process_env, free_port  # tests/ is on sys.path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 300
# the timing fields of a results.json cell (and of a row): all that may differ between runs
TIMING = ("seconds", "tokens_per_s", "speedup")
PROMPTS = {"toy": [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38], [46, 26, 43, 38, 32]]}
TEMPERATURES = (1.0,)
DRAFTERS = ["k1=random", "k2=random-k2"]


def _validate_argv(out):
    return ["validate", "--model", "tiny-llama", "--drafter", DRAFTERS[0], "--drafter",
            DRAFTERS[1], "--data", "synthetic", "--batches", "3", "--batch-size", "2",
            "--seq-len", "32", "--anchors", "2", "--baseline", "k1", "--out", out,
            "--no-progress"]


def _lose_last_rows(src, dst) -> None:
    """dst: src's evaluation as a run killed while writing leaves it: the last two units'
    rows are still in the per-process files, the last one cut."""
    shutil.copytree(src, dst)
    lines = (dst / "rows.jsonl").read_text().splitlines(keepends=True)
    (dst / "rows.jsonl").write_text("".join(lines[:-2]))
    (dst / "rows.process-00000.jsonl").write_text(lines[-2])
    (dst / "rows.process-00001.jsonl").write_text(lines[-1][:-20])


def _script(out: str, cluster: list) -> None:
    """One process's part of a run (its steps reuse what the process compiled):
    `dblast validate` (which starts the multi-process runtime), the
    evaluation into OUT/eval, a resumed evaluation of a copy that lost its last units
    (OUT/resumed), and validation with one batch (fewer batches than processes)."""
    from pathlib import Path

    import jax
    from jax.experimental import multihost_utils

    from dblast_jax import cli
    from dblast_jax import evaluate as ev
    from dblast_jax import generation as gen
    from dblast_jax.train.validation import validate_drafters
    out = Path(out)
    rc = cli.main(_validate_argv(str(out / "validate")) + cluster)
    if rc:
        sys.exit(rc)
    target = gen.load_target("tiny-llama")
    drafters = gen.named_drafters(DRAFTERS, target)
    kw = dict(prompt_sets=PROMPTS, temperatures=TEMPERATURES, max_new_tokens=6,
              baseline="k1", warmup=False, plots=False, tensorboard=False, progress=True)
    ev.run_evaluation(target, drafters, out_dir=out / "eval", **kw)
    if jax.process_index() == 0:
        _lose_last_rows(out / "eval", out / "resumed")
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("test_lost_rows")
    print("resume:", flush=True)
    ev.run_evaluation(target, drafters, out_dir=out / "resumed", **kw)
    one = validate_drafters(drafters, target, "synthetic", num_batches=1, batch_size=2,
                            seq_len=32, anchors_per_sequence=2, progress=False)
    if jax.process_index() == 0:
        (out / "validate_one_batch.json").write_text(json.dumps(one))


def _start(root, out, nproc: int, tag: str) -> list:
    """Start `nproc` processes of a run on OUT: [(process, log file)]."""
    port = free_port()
    started = []
    for i in range(nproc):
        cluster = ([] if nproc == 1 else
                   ["--num-processes", str(nproc), "--process-id", str(i),
                    "--coordinator-address", f"localhost:{port}"])
        log = open(root / f"{tag}_{i}.log", "w+")
        started.append((subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(out), *cluster],
            cwd=REPO, env=cpu_process_env(1, str(root / "jax_cache")), stdout=log,
            stderr=subprocess.STDOUT),
            log))
    return started


def _finish(started, tag: str) -> list:
    """Wait for a run's processes; their logs (skip where gloo is missing)."""
    for p, _ in started:
        try:
            p.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for q, _ in started:
                q.kill()
            raise
    outs = []
    for _, log in started:
        log.seek(0)
        outs.append(log.read())
        log.close()
    return check_process_outputs([p.returncode for p, _ in started], outs, tag)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 1-process run (which fills the compilation cache), then the 2-process run."""
    root = tmp_path_factory.mktemp("eval_mp")
    _finish(_start(root, root / "one", 1, "one"), "1-process run")
    outs = _finish(_start(root, root / "two", 2, "two"), "2-process run")
    return root, root / "one", root / "two", outs


def _results(folder, run="eval"):
    return json.loads((folder / run / "results.json").read_text())


def _without_timing(result):
    cells = [{k: v for k, v in c.items() if k not in TIMING} for c in result["cells"]]
    tables = {m: t for m, t in result["tables"].items() if m != "speedup"}
    return {"meta": result["meta"], "cells": cells, "tables": tables}


def _rows(folder):
    lines = (folder / "eval" / "rows.jsonl").read_text().splitlines()
    rows = [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in lines]
    return sorted(rows, key=lambda r: json.dumps(r, sort_keys=True))


def test_evaluation_tables_equal_one_process(runs):
    _, one, two, outs = runs
    a, b = _results(one), _results(two)
    assert _without_timing(b) == _without_timing(a)  # tau, tau SE, expected tau: exact
    tau = b["tables"]["tau"]
    assert [r["drafter"] for r in tau["rows"]] == ["k1", "k2"]
    assert all(1.0 <= r[f"toy@T{t}"] for r in tau["rows"] for t in TEMPERATURES)
    speed = b["tables"]["speedup"]  # timing: only its shape is compared
    assert speed["columns"] == a["tables"]["speedup"]["columns"]
    assert [r["drafter"] for r in speed["rows"]] == ["k1", "k2"]
    # 3 prompts x 1 temperature x (plain, k1, k2) = 9 units, each once, shared out
    assert _rows(two) == _rows(one) and len(_rows(one)) == 9
    assert "decodes 5 of the 9 unfinished units" in outs[0].split("resume:")[0]
    assert "decodes 4 of the 9 unfinished units" in outs[1].split("resume:")[0]
    assert not list((two / "eval").glob("rows.process-*"))  # merged into rows.jsonl
    assert (two / "eval" / "results.md").read_text().count("| k2 |") == 4


def test_validation_equals_one_process(runs):
    _, one, two, outs = runs
    a = json.loads((one / "validate" / "validation.json").read_text())
    b = json.loads((two / "validate" / "validation.json").read_text())
    assert b["results"] == a["results"]  # bit-exact: per-batch metrics summed in batch order
    assert {k: v for k, v in b["settings"].items() if k != "out"} == \
        {k: v for k, v in a["settings"].items() if k != "out"}
    assert len(a["results"]["k2"]["per_batch"]["al_estimate"]) == 3
    assert (two / "validate" / "validation.md").read_text() == \
        (one / "validate" / "validation.md").read_text()
    assert "| k2 |" in outs[0] and "| k2 |" not in outs[1]  # process 0 reports


def test_resume_redoes_only_the_lost_unit(runs):
    """After a 2-process run killed mid-write (the last two units' rows in the process
    files, one of them cut), a rerun decodes that one unit only, and the results equal
    the uninterrupted run's."""
    _, one, two, outs = runs
    for folder, log in ((one, outs[0]), (two, outs[0])):
        before = (folder / "eval" / "rows.jsonl").read_text().splitlines()
        after = (folder / "resumed" / "rows.jsonl").read_text().splitlines()
        assert len(after) == 9 and not list((folder / "resumed").glob("rows.process-*"))
        # the units finished before were not decoded again (their rows, timings included)
        assert set(before[:-1]) <= set(after)
        assert _without_timing(_results(folder, "resumed")) == _without_timing(_results(one))
    resumed = outs[0].split("resume:")[1]
    assert "decodes 1 of the 1 unfinished units" in resumed
    assert "decodes 0 of the 1 unfinished units" in outs[1].split("resume:")[1]


def test_validation_with_fewer_batches_than_processes(runs):
    """One batch, two processes: process 1 scores none of its own; batch 0's numbers."""
    _, one, two, _ = runs
    three = json.loads((one / "validate" / "validation.json").read_text())["results"]
    for folder in (one, two):
        got = json.loads((folder / "validate_one_batch.json").read_text())
        for name in ("k1", "k2"):
            for key in ("al_estimate", "nll", "top1_mean"):
                assert got[name][key] == three[name]["per_batch"][key][0], (folder, key)


def test_cli_cluster_flags(tmp_path, capsys):
    """`dblast eval` / `dblast validate` take the cluster flags and a --mesh of this
    process's devices; a process count without a coordinator, or a bad mesh, is one line,
    status 2, before any work."""
    from dblast_jax import cli
    ev = ["eval", "--model", "tiny-llama", "--drafter", "k1=random", "--out",
          str(tmp_path / "e"), "--benchmarks", "gsm8k"]
    assert cli.main(ev + ["--num-processes", "2"]) == 2
    assert "coordinator address" in capsys.readouterr().err
    assert cli.main(ev + ["--mesh", "2,2"]) == 2
    assert "mesh '2,2'" in capsys.readouterr().err
    assert cli.main(_validate_argv(str(tmp_path / "v")) + ["--num-processes", "2",
                                                           "--process-id", "0"]) == 2
    assert "coordinator address" in capsys.readouterr().err
    assert not (tmp_path / "e").exists() and not (tmp_path / "v").exists()


if __name__ == "__main__":  # one process of a run: OUT [cluster flags]
    _script(sys.argv[1], sys.argv[2:])
