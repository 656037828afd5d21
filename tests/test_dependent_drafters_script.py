"""experiments/claims/dependent_drafters.sh and dependent_table.py, run in a scratch copy of
the repository layout with recording stand-ins for budget_curve.py and `dblast`: every
variant trains from the same pinned trunk with the same recipe and only its own
mechanism's flags, is validated alone and committed to KEEP, and the table pairs the
committed per-batch numbers against the K = 1 control, across calls (machines)."""

import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import time
import zlib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLAIMS = os.path.join(ROOT, "experiments", "claims")
VARIANTS = ["k1_control", "dblast_k4", "correction", "block_causal", "k4_correction"]

# `python experiments/budget/budget_curve.py ...` is recorded (and leaves the curve the
# script reads); any other python call runs the real interpreter
PYTHON = """#!{py}
import os, sys, json
if len(sys.argv) > 1 and sys.argv[1] == "experiments/budget/budget_curve.py":
    with open({log!r}, "a") as f:
        f.write(" ".join(["budget_curve.py"] + sys.argv[2:]) + "\\n")
    arg = lambda k: next(a.split("=", 1)[1] for a in sys.argv if a.startswith(k + "="))
    os.makedirs(arg("--workdir"), exist_ok=True)
    with open(os.path.join(arg("--workdir"), "budget_curve.jsonl"), "w") as f:
        f.write(json.dumps({{"step": int(arg("--max_steps")), "cpu_s": 12.5,
                            "setup_cpu_s": 3.0}}) + "\\n")
    sys.exit(0)
os.execv({py!r}, [{py!r}] + sys.argv[1:])
"""

# `dblast validate`: per-batch AL of a drafter is a fixed function of its name and T_v,
# so the expected paired gains are known
DBLAST = """#!{py}
import json, os, sys, zlib
with open({log!r}, "a") as f:
    f.write(" ".join(["dblast"] + sys.argv[1:]) + "\\n")
if sys.argv[1] == "carry":  # a stand-in of pack / unpack: copies the folder whole
    import shutil
    src, dest = sys.argv[3:5]
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src, dest)
    if sys.argv[2] == "pack":
        open(os.path.join(dest, "carried_run.json"), "w").write("{{}}")
if sys.argv[1] == "validate":
    a = sys.argv
    val = lambda k: a[a.index(k) + 1]
    name = val("--drafter").split("=")[0]
    t = float(val("--verify-temperature"))
    n = int(val("--batches"))
    level = 0.4 + (zlib.crc32(name.encode()) % 100) / 1000 + t / 10
    per = [level + 0.01 * i for i in range(n)]
    out = val("--out")
    os.makedirs(out, exist_ok=True)
    settings = {{"command": "validate", "model": "smollm2-135m-instruct",
                "drafter": [val("--drafter")], "data": val("--data"),
                "shards": val("--shards"), "batches": n, "batch_size": 8,
                "seq_len": int(val("--seq-len")), "anchors": 24, "verify_temperature": t,
                "baseline": None, "seed": int(os.environ.get("FAKE_SEED", "1234")),
                "out": out, "debug": False}}
    results = {{name: {{"al_estimate": sum(per) / n, "al_estimate_se": 0.001,
                       "per_batch": {{"al_estimate": per}}}}}}
    json.dump({{"settings": settings, "results": results}}, open(out + "/validation.json", "w"))
if sys.argv[1] == "eval":  # macro tau of a drafter: a fixed function of its name and T
    a = sys.argv
    val = lambda k: a[a.index(k) + 1]
    name, _, mode = val("--drafter").partition("@mode=")
    name = name.split("=")[0]
    t = float(val("--temperatures"))
    n = int(val("--prompts-per-benchmark"))
    tokens = int(val("--max-new-tokens"))
    tau = 1.2 + (zlib.crc32(name.encode()) % 100) / 1000 + t / 10
    benchmarks = ["humaneval", "mt-bench", "gsm8k", "creative-writing"]
    cells = []
    for b in benchmarks:
        cells.append({{"benchmark": b, "method": "plain", "prompts": n, "seconds": 4.0,
                      "new_tokens": tokens * n, "steps": 0, "temperature": t}})
        cells.append({{"benchmark": b, "method": name, "prompts": n, "seconds": 6.0,
                      "new_tokens": tokens * n, "steps": 60, "temperature": t}})
    column = f"macro@T{{t}}"
    tables = {{m: {{"rows": [{{"drafter": name, column: x}}]}}
              for m, x in (("tau", tau), ("tau_se", 0.02), ("speedup", 4.0 / 6.0))}}
    meta = {{"batch_size": int(val("--batch-size")), "benchmarks": benchmarks,
            "drafters": [name], "max_new_tokens": tokens,
            "method_settings": {{name: {{"verify_mode": mode}}}},
            "seed": int(os.environ.get("FAKE_EVAL_SEED", "0")),
            "target": "smollm2-135m-instruct", "temperatures": [t],
            "verify_mode": "greedy-branch"}}
    out = val("--out")
    os.makedirs(out, exist_ok=True)
    json.dump({{"baseline": None, "meta": meta, "cells": cells, "tables": tables}},
              open(out + "/results.json", "w"))
"""


def _layout(repo):
    claims = repo / "experiments" / "claims"
    claims.mkdir(parents=True, exist_ok=True)
    for f in ("dependent_drafters.sh", "dependent_table.py"):
        shutil.copy(os.path.join(CLAIMS, f), claims)
    bin_dir = repo / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = repo / "calls.txt"
    for name, text in (("python", PYTHON), ("dblast", DBLAST)):
        (bin_dir / name).write_text(text.format(py=sys.executable, log=str(log)))
        (bin_dir / name).chmod(0o755 | stat.S_IEXEC)
    return bin_dir, log


def _trunk(folder, weights=b"trunk weights"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def _run(repo, **env):
    bin_dir, log = _layout(repo)
    start = len(log.read_text().splitlines()) if log.exists() else 0
    full = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(repo / "out"),
                KEEP=str(repo / "keep"), DATA="some/corpus",
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    for k in ("STEPS", "VARIANTS", "TRUNK", "TRUNK_AT"):
        if k not in env:
            full.pop(k, None)
    done = subprocess.run(["bash", str(repo / "experiments" / "claims" /
                                       "dependent_drafters.sh")],
                          env=full, capture_output=True, text=True, timeout=300)
    lines = log.read_text().splitlines()[start:] if log.exists() else []
    return done, [shlex.split(line) for line in lines]


def _expected_gain(name, base, t, n=16):
    import zlib
    level = lambda v: 0.4 + (zlib.crc32(v.encode()) % 100) / 1000 + t / 10
    mean = lambda v: level(v) + 0.01 * (n - 1) / 2
    return 100 * (mean(name) / mean(base) - 1)


def test_variants_share_the_recipe_and_land_in_keep_with_a_paired_table(tmp_path):
    trunk = _trunk(tmp_path / "trunk")
    done, calls = _run(tmp_path, STEPS="7", TRUNK=str(trunk))
    assert done.returncode == 0, done.stderr
    trains = [c for c in calls if c[0] == "budget_curve.py"]
    validates = [c for c in calls if c[:2] == ["dblast", "validate"]]
    evals = [c for c in calls if c[:2] == ["dblast", "eval"]]
    assert len(trains) == 5 and len(validates) == 15 and len(evals) == 10
    modes = {(e[e.index("--drafter") + 1], e[e.index("--temperatures") + 1]) for e in evals}
    out = tmp_path / "out"
    assert modes == {
        *((f"{v}={out}/{v}@mode=greedy-branch", "0.7") for v in
          ("k1_control", "correction", "block_causal")),
        *((f"{v}={out}/{v}@mode=sampled-branch", "1.5") for v in
          ("k1_control", "correction", "block_causal")),
        *((f"{v}={out}/{v}@mode=mixture", "0.7") for v in ("dblast_k4", "k4_correction")),
        *((f"{v}={out}/{v}@mode=sampled-mixture", "1.5") for v in
          ("dblast_k4", "k4_correction"))}
    for e in evals:  # each alone, batch 1, plain decoding beside it
        assert e[e.index("--batch-size") + 1] == "1" and "--baseline" not in e
    mechanism, shared = {}, None
    for c in trains:
        name = os.path.basename(next(a for a in c if a.startswith("--workdir="))
                                .split("=", 1)[1])
        flags = [a for a in c if a.startswith(("--experiment=", "--override=correction",
                                               "--override=drafter.block_attention"))]
        mechanism[name] = flags
        rest = sorted(a for a in c if a not in flags and not a.startswith("--workdir="))
        assert shared is None or rest == shared  # the same recipe for every variant
        shared = rest
    assert mechanism == {
        "k1_control": ["--experiment=smollm2_k1_al"],
        "dblast_k4": ["--experiment=smollm2_dblast_k4_al"],
        "correction": ["--experiment=smollm2_k1_al", "--override=correction=previous-token"],
        "block_causal": ["--experiment=smollm2_k1_al",
                         "--override=drafter.block_attention=causal"],
        "k4_correction": ["--experiment=smollm2_dblast_k4_al",
                          "--override=correction=previous-token"]}
    assert {f"--override=drafter_init=drafter:{trunk}", "--max_steps=7",
            "--override=data=some/corpus", "--override=seq_len=384",
            # the flagship's cache (keyed by corpus digest) is reused, never rebuilt
            "--override=feature_cache=runs/flagship/features"} <= set(shared)
    for v in validates:  # each variant alone, never against a baseline in the same call
        assert "--baseline" not in v and len([a for a in v if a == "--drafter"]) == 1
    assert sorted({v[v.index("--verify-temperature") + 1] for v in validates}) == [
        "0.7", "1.0", "1.5"]
    keep = tmp_path / "keep"
    for name in VARIANTS:
        record = json.loads((keep / name / "training.json").read_text())
        assert record["steps"] == 7 and record["cpu_s"] == 12.5
        assert record["trunk"] == str(trunk) and len(record["trunk_sha256"]) == 64
    table = (keep / "table.md").read_text()
    assert table in done.stdout
    assert "AL gain vs k1_control (paired SE)" in table and "T_v = 1.5" in table
    row = next(line for line in table.splitlines()[table.splitlines().index("T_v = 1.5 "
               "(corpora/smollm2_heldout_t15 shards 0:4, 16 batches):"):]
               if line.startswith("| dblast_k4 |"))
    # per-batch differences are constant in the stand-in: the paired SE is 0
    assert f"{_expected_gain('dblast_k4', 'k1_control', 1.5):+.1f}% ± 0.0%" in row
    bench = table[table.index("Benchmarks ("):]
    assert "2 prompts each, 96 new tokens, batch 1" in bench
    row = next(line for line in bench.splitlines() if line.startswith("| dblast_k4 |"))
    tau = lambda v, t: 1.2 + (zlib.crc32(v.encode()) % 100) / 1000 + t / 10
    r = tau("dblast_k4", 1.5) / tau("k1_control", 1.5)
    se = 100 * r * ((0.02 / tau("dblast_k4", 1.5)) ** 2
                    + (0.02 / tau("k1_control", 1.5)) ** 2) ** 0.5
    # | variant | tau, speed, ms / step, gain at 0.7 | the same at 1.5 |
    assert row.strip("| ").split(" | ")[5:9] == [f"{tau('dblast_k4', 1.5):.3f} ± 0.020", "0.67x",
                                      "100 (21)", f"{100 * (r - 1):+.1f}% ± {se:.1f}%"]

    # another machine: the finished variants are not trained again, the table is redrawn
    shutil.rmtree(tmp_path / "out")
    done, calls = _run(tmp_path, STEPS="7", TRUNK=str(trunk))
    assert done.returncode == 0, done.stderr
    assert calls == [] and "k1_control: finished" in done.stdout
    assert (keep / "table.md").read_text() == table


def test_results_of_another_trunk_or_other_batches_are_refused(tmp_path):
    trunk = _trunk(tmp_path / "trunk")
    done, _ = _run(tmp_path, STEPS="3", TRUNK=str(trunk), VARIANTS="k1_control")
    assert done.returncode == 0, done.stderr
    other = _trunk(tmp_path / "other", weights=b"another trunk")
    done, calls = _run(tmp_path, STEPS="3", TRUNK=str(other), VARIANTS="dblast_k4")
    assert done.returncode == 1 and calls == []
    assert "trained from another trunk" in done.stderr
    # a variant validated on other batches (another anchor seed) cannot be paired
    done, _ = _run(tmp_path, STEPS="3", TRUNK=str(trunk), VARIANTS="k1_control dblast_k4",
                   FAKE_SEED="99")
    assert done.returncode != 0 and "settings differ: ['seed']" in done.stderr


def test_a_subset_without_the_control_and_an_unknown_variant(tmp_path):
    trunk = _trunk(tmp_path / "trunk")
    done, calls = _run(tmp_path, VARIANTS="correction block_causal", STEPS="3",
                       TRUNK=str(trunk))
    assert done.returncode == 0, done.stderr
    assert "gain vs" not in (tmp_path / "keep" / "table.md").read_text()
    again = tmp_path / "again"
    again.mkdir()
    done, calls = _run(again, VARIANTS="correction k8_magic", TRUNK=str(trunk))
    assert done.returncode == 1 and "unknown variant k8_magic" in done.stderr
    assert calls == []  # refused before any variant trains


def test_a_variant_being_trained_elsewhere_is_refused(tmp_path):
    """Variants run side by side as one invocation each; a second invocation of a variant
    that is training (its lock held) stops before touching its run, and the lock goes
    with the process that held it."""
    trunk = _trunk(tmp_path / "trunk")
    (tmp_path / "out").mkdir()
    holder = subprocess.Popen(["flock", str(tmp_path / "out" / "dblast_k4.lock"),
                               "sleep", "60"], start_new_session=True)
    try:
        for _ in range(100):  # until the holder has the lock
            if subprocess.run(["flock", "-n", str(tmp_path / "out" / "dblast_k4.lock"),
                               "true"]).returncode:
                break
            time.sleep(0.05)
        done, calls = _run(tmp_path, VARIANTS="dblast_k4", STEPS="3", TRUNK=str(trunk))
        assert done.returncode == 1
        assert "variant dblast_k4 is being trained by another invocation" in done.stderr
        assert calls == []
        done, calls = _run(tmp_path, VARIANTS="correction", STEPS="3", TRUNK=str(trunk))
        assert done.returncode == 0, done.stderr  # another variant runs beside it
    finally:
        os.killpg(holder.pid, 9)  # flock and its sleep (which holds the lock too)
        holder.wait()
    done, calls = _run(tmp_path, VARIANTS="dblast_k4", STEPS="3", TRUNK=str(trunk))
    assert done.returncode == 0, done.stderr
    assert [c[0] for c in calls].count("budget_curve.py") == 1


def test_the_trunk_is_pinned_by_commit(tmp_path):
    """Without TRUNK the flagship export as committed at TRUNK_AT is the trunk, whatever
    the flagship folder holds now."""
    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t",
                                     *a], cwd=tmp_path, check=True, capture_output=True,
                                    text=True).stdout.strip()
    git("init", "-q")
    drafter = _trunk(tmp_path / "experiments" / "flagship" / "k1" / "drafter", b"leg 3")
    git("add", "-A")
    git("commit", "-qm", "leg 3")
    pinned = git("rev-parse", "--short", "HEAD")
    (drafter / "model.safetensors").write_bytes(b"leg 4")  # a later leg
    done, calls = _run(tmp_path, STEPS="2", VARIANTS="k1_control", TRUNK_AT=pinned)
    assert done.returncode == 0, done.stderr
    materialised = tmp_path / "out" / f"trunk_{pinned}"
    assert (materialised / "model.safetensors").read_bytes() == b"leg 3"
    assert f"--override=drafter_init=drafter:{materialised}" in calls[0]
    record = json.loads((tmp_path / "keep" / "k1_control" / "training.json").read_text())
    assert record["trunk"] == pinned
    import hashlib
    assert record["trunk_sha256"] == hashlib.sha256(b"leg 3").hexdigest()
    done, _ = _run(tmp_path, VARIANTS="k1_control", TRUNK_AT="0000000")
    assert done.returncode == 1 and "no experiments/flagship/k1/drafter at commit" in done.stderr


def _bench_record(name, t, tau, prompts=2):
    """What `dblast eval` of `name` alone at T = t writes (the fields the table reads)."""
    cells = [{"benchmark": b, "method": m, "prompts": prompts, "seconds": 4.0,
              "new_tokens": 96 * prompts, "steps": 0 if m == "plain" else 60,
              "temperature": float(t)}
             for b in ("humaneval", "gsm8k") for m in ("plain", name)]
    column = f"macro@T{float(t)}"
    return {"meta": {"batch_size": 1, "benchmarks": ["humaneval", "gsm8k"],
                     "drafters": [name], "max_new_tokens": 96, "seed": 0,
                     "temperatures": [float(t)]},
            "cells": cells,
            "tables": {m: {"rows": [{"drafter": name, column: x}]}
                       for m, x in (("tau", tau), ("tau_se", 0.05), ("speedup", 1.0))}}


def test_the_paired_gain_matches_numpy(tmp_path):
    """The table's paired SE is the SE of the per-batch differences, relative to the
    control's mean (checked with noisy per-batch values)."""
    keep = tmp_path / "keep"
    rng = np.random.default_rng(0)
    base = rng.uniform(0.3, 0.5, 16)
    other = base + rng.normal(0.02, 0.01, 16)
    for name, per in (("k1_control", base), ("dblast_k4", other)):
        (keep / name).mkdir(parents=True)
        (keep / name / "training.json").write_text(json.dumps(
            {"steps": 10, "cpu_s": 1.0, "trunk": "abc", "trunk_sha256": "0" * 64}))
        for t in ("0.7", "1.0", "1.5"):
            (keep / name / f"validate_t{t}.json").write_text(json.dumps(
                {"settings": {"data": "d", "shards": "0:4", "batches": 16, "out": name},
                 "results": {name: {"al_estimate": float(per.mean()),
                                    "per_batch": {"al_estimate": per.tolist()}}}}))
        for t in ("0.7", "1.5"):
            (keep / name / f"bench_t{t}.json").write_text(json.dumps(
                _bench_record(name, t, 1.5 if name == "k1_control" else 1.8)))
    done = subprocess.run([sys.executable, os.path.join(CLAIMS, "dependent_table.py"),
                           f"--keep={keep}"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr
    gain = 100 * (other.mean() / base.mean() - 1)
    se = 100 * (other - base).std(ddof=1) / np.sqrt(16) / base.mean()
    assert f"{gain:+.1f}% ± {se:.1f}%" in done.stdout
    # benchmark tau gains are unpaired (separate runs): SEs combined by the delta method
    se = 100 * 1.2 * ((0.05 / 1.8) ** 2 + (0.05 / 1.5) ** 2) ** 0.5
    assert f"| 1.800 ± 0.050 | 1.00x | 67 (21) | +20.0% ± {se:.1f}% |" in done.stdout

    # a benchmark run on other prompts is refused, not compared
    (keep / "dblast_k4" / "bench_t1.5.json").write_text(json.dumps(
        _bench_record("dblast_k4", "1.5", 1.8, prompts=8)))
    done = subprocess.run([sys.executable, os.path.join(CLAIMS, "dependent_table.py"),
                           f"--keep={keep}"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert ("dblast_k4/bench_t1.5.json: benchmarked on other prompts or settings than "
            "dblast_k4 (differ: ['prompts_per_benchmark'])") in done.stderr


def test_a_corrupt_result_is_one_line_naming_its_file(tmp_path):
    keep = tmp_path / "keep" / "k1_control"
    keep.mkdir(parents=True)
    (keep / "training.json").write_text("{not json")
    for t in ("0.7", "1.0", "1.5"):
        (keep / f"validate_t{t}.json").write_text("{}")
    for t in ("0.7", "1.5"):
        (keep / f"bench_t{t}.json").write_text("{}")
    done = subprocess.run([sys.executable, os.path.join(CLAIMS, "dependent_table.py"),
                           f"--keep={tmp_path / 'keep'}"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "training.json: unreadable" in done.stderr.strip().splitlines()[-1]


def test_unfinished_runs_are_carried_to_the_next_machine(tmp_path):
    """PACK=1 carries each unfinished variant's run into KEEP/NAME/unfinished (nothing is
    trained); the next machine's invocation unpacks it before training resumes, and the
    carried copy goes once the variant has finished."""
    trunk = _trunk(tmp_path / "trunk")
    out, keep = tmp_path / "out", tmp_path / "keep"
    done, _ = _run(tmp_path, STEPS="3", TRUNK=str(trunk), VARIANTS="k1_control")
    assert done.returncode == 0, done.stderr  # finished: never carried
    (out / "correction" / "checkpoints" / "250").mkdir(parents=True)
    (out / "correction" / "checkpoints" / "250" / "state").write_text("step 250")
    done, calls = _run(tmp_path, STEPS="3", TRUNK=str(trunk), PACK="1",
                       VARIANTS="k1_control correction block_causal")
    assert done.returncode == 0, done.stderr
    assert calls == [["dblast", "carry", "pack", str(out / "correction"),
                      str(keep / "correction" / "unfinished")]]
    assert "block_causal: no checkpoint" in done.stdout
    assert (keep / "correction" / "unfinished" / "carried_run.json").exists()

    shutil.rmtree(out)  # the next machine
    done, calls = _run(tmp_path, STEPS="3", TRUNK=str(trunk), VARIANTS="correction")
    assert done.returncode == 0, done.stderr
    assert calls[0] == ["dblast", "carry", "unpack", str(keep / "correction" / "unfinished"),
                        str(out / "correction")]
    assert calls[1][0] == "budget_curve.py"
    assert (out / "correction" / "checkpoints" / "250" / "state").read_text() == "step 250"
    assert not (keep / "correction" / "unfinished").exists()
    assert (keep / "correction" / "training.json").exists()
