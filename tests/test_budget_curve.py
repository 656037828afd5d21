"""experiments/budget/budget_curve.py: held-out acceptance against training CPU-seconds,
in segments, resumed after an interruption without losing or repeating a point."""

import json
import os
import subprocess
import sys

from conftest import make_corpus as _make_corpus  # tests/ is on sys.path (pytest "prepend" mode)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "experiments", "budget", "budget_curve.py")
FINISH_LEG = os.path.join(ROOT, "experiments", "flagship", "finish_leg.py")


def _run(*args):
    out = subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_curve_in_segments_resumes_and_plots(tmp_path):
    corpus = _make_corpus(tmp_path / "corpus")
    wd = tmp_path / "run"
    common = [f"--workdir={wd}", "--experiment=tiny_dflash", "--segment_steps=2",
              "--max_steps=6", "--validation_batches=1", f"--validation_data={corpus}",
              "--validation_shards=2:3", f"--override=data={corpus}", "--override=data_shards=2",
              "--override=verify_temperature=1.0", "--override=seq_len=24",
              "--override=mesh=1,1,1", "--override=distill_weight=0.5",
              "--override=distill_topk=4"]
    bad = subprocess.run([sys.executable, SCRIPT, *common, "--extra_validation=x/y=c:0:1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "expected NAME=CORPUS:A:B" in bad.stderr
    bad_tv = subprocess.run([sys.executable, SCRIPT, *common,
                             f"--extra_validation=x={corpus}:2:3@hot"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert bad_tv.returncode != 0 and "T_v > 0" in bad_tv.stderr
    assert not wd.exists()  # refused before the trainer's setup wrote anything
    # a second held-out set (here the training shard 1: not held out, so refused) ...
    leak = subprocess.run([sys.executable, SCRIPT, *common, "--budget_cpu_s=0.001",
                           f"--extra_validation=again={corpus}:1:2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert leak.returncode != 0 and "held-out shards must come after" in leak.stderr
    # ... and a held-out one, scored into every row under its name (here the main held-out
    # shard again: the same anchors give the same numbers), and the same shard at T_v = 0.7
    _run(*common, "--budget_cpu_s=0.001", f"--extra_validation=last={corpus}:2:3",
         f"--extra_validation=cool={corpus}:2:3@0.7")
    rows = [json.loads(x) for x in open(wd / "budget_curve.jsonl")]
    assert [r["step"] for r in rows] == [0, 2]
    for r in rows:
        assert r["last/al_estimate"] == r["al_estimate"]
        assert r["last/greedy_accepted"] == r["greedy_accepted"]
        # another T_v: other acceptance, the same drafts (greedy agreement needs no T_v)
        assert r["cool/al_estimate"] != r["al_estimate"]
        assert r["cool/greedy_accepted"] == r["greedy_accepted"]
    # a flagship leg (experiments/flagship/train_k1.sh) is recorded only once it finished
    keep = tmp_path / "keep"
    (wd / "leg.json").write_text(json.dumps({"leg": 1, "init": "random", "steps": 6,
                                             "trunk_legs": 3, "schedule_steps": 50000,
                                             "schedule_offset": 26000}))
    finish = [sys.executable, FINISH_LEG, f"--leg_dir={wd}", f"--keep={keep}", "--leg=1"]
    early = subprocess.run(finish, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert early.returncode == 1 and "trained 2 of 6 steps" in early.stderr
    assert not (keep / "legs.jsonl").exists()
    _run(*common, "--budget_cpu_s=1e9")  # resumes to the schedule's end
    rows = [json.loads(x) for x in open(wd / "budget_curve.jsonl")]
    assert [r["step"] for r in rows] == [0, 2, 4, 6]
    for _ in range(2):  # the second call finds the leg recorded and changes nothing
        done = subprocess.run(finish, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    legs = [json.loads(x) for x in open(keep / "legs.jsonl")]
    assert len(legs) == 1 and legs[0]["steps"] == 6 and legs[0]["init"] == "random"
    assert legs[0]["end"]["al_estimate"] == rows[-1]["al_estimate"]
    # the extra held-out sets' metrics are kept too (scored here by the first segment only)
    assert legs[0]["start"]["last/al_estimate"] == rows[0]["last/al_estimate"]
    assert "last/al_estimate" not in legs[0]["end"] and legs[0]["seq_len"] == 256
    # a leg.json without a depth is a 1-layer leg of a chain that started from nothing
    assert legs[0]["drafter_layers"] == 1 and "prior_cpu_s" not in legs[0]
    assert legs[0]["trunk_legs"] == 3  # the 1-layer legs a grown chain's pass rotation counts
    assert (legs[0]["schedule_steps"], legs[0]["schedule_offset"]) == (50000, 26000)
    assert "already recorded" in done.stdout
    assert (keep / "drafter" / "config.json").is_file()  # the next leg's starting point
    assert (keep / "curve_leg1.jsonl").read_text() == (wd / "budget_curve.jsonl").read_text()
    # the learning curve is drawn with the leg and redrawn on demand
    (keep / "learning_curve.png").unlink()
    plot = subprocess.run([sys.executable, FINISH_LEG, f"--keep={keep}", "--plot_only"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert plot.returncode == 0 and (keep / "learning_curve.png").stat().st_size > 1000
    cpu = [r["cpu_s"] for r in rows]
    assert cpu[0] == 0 and all(b > a for a, b in zip(cpu, cpu[1:]))
    assert all(0 <= r["al_estimate"] <= 7 and "distill_kl" in r for r in rows[1:])
    png = tmp_path / "curve.png"
    _run(f"--plot=tiny={wd}", f"--out={png}")
    assert png.stat().st_size > 1000
    # the raw points kept in the repository (a .jsonl copy of a curve) plot the same way
    kept = tmp_path / "kept.jsonl"
    kept.write_text((wd / "budget_curve.jsonl").read_text())
    _run(f"--plot=tiny={wd},{kept}", f"--out={png}", "--plot_x=step")


def test_compare_at_equal_steps_and_equal_cpu(tmp_path):
    rows = lambda pts: "\n".join(json.dumps({"step": s, "cpu_s": c, "al_estimate": a})
                                 for s, c, a in pts) + "\n"
    base, other = tmp_path / "base.jsonl", tmp_path / "other.jsonl"
    base.write_text(rows([(0, 0, 0.0), (50, 100, 0.10), (100, 200, 0.20)]))
    other.write_text(rows([(0, 0, 0.0), (50, 50, 0.08), (100, 100, 0.15), (150, 150, 0.3),
                           (200, 300, 0.4)]))
    out = _run(f"--compare=b={base},o={other}").stdout.splitlines()
    assert out[0].startswith("| step | cpu_s | o | b at equal steps")
    # step 50: base 0.10 at equal steps (-20%); at 50 CPU-s base is 0.05 (+60%)
    assert out[2] == "| 50 | 50 | 0.080 | 0.100 | -20% | 0.050 | +60% |"
    assert out[3] == "| 100 | 100 | 0.150 | 0.200 | -25% | 0.100 | +50% |"
    assert out[4] == "| 150 | 150 | 0.300 |  |  | 0.150 | +100% |"
    assert out[5] == "| 200 | 300 | 0.400 |  |  |  |  |"  # past base's last point


def test_steps_past_the_last_row_are_charged(tmp_path):
    """A run resumed past its last curve row (killed before the row, or carried to another
    machine) keeps the CPU-seconds of those steps: at the mean rate once a segment has
    one, before that at the trainer's logged time per step."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    from curve_file import cpu_at_resume

    rows = [{"step": 0, "cpu_s": 0.0}, {"step": 100, "cpu_s": 50.0}]
    assert cpu_at_resume(rows, 100, str(tmp_path)) == 50.0
    assert cpu_at_resume(rows, 150, str(tmp_path)) == 75.0
    # only the step-0 row: steps 1-4 from metrics.jsonl (the first one compiled: charged
    # at the mean of the others), logged every step; steps 5-6 at that mean too
    metrics = [{"step": 1, "compile_and_step_s": 30.0}, {"step": 2, "step_time_s": 1.0},
               {"step": 4, "step_time_s": 2.0}, {"step": 9, "step_time_s": 100.0}]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(m) + "\n" for m in metrics) + '{"step": 10, "step_')
    # 1.5 (step 1) + 1.0 (step 2) + 2 * 2.0 (steps 3-4) + 2 * 1.5 (steps 5-6)
    assert cpu_at_resume(rows[:1], 6, str(tmp_path)) == 1.5 + 1.0 + 4.0 + 3.0
    assert cpu_at_resume([], 2, str(tmp_path)) == 2.0  # the mean of the steps up to 2
    assert cpu_at_resume(rows[:1], 6, str(tmp_path / "nothing")) == 0.0
