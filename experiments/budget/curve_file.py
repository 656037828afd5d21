"""The budget_curve.jsonl file: its one reader and one writer.

Apart from budget_curve.py so that other scripts (experiments/flagship/finish_leg.py) read
curves without importing budget_curve's absl flags: two scripts' flags in one process
collide (--out is defined by more than one launcher).
"""

from __future__ import annotations

import json
import os

CURVE = "budget_curve.jsonl"
METRICS = "metrics.jsonl"  # the trainer's log: one row per logged step


def read_curve(workdir: str) -> list[dict]:
    """Rows of a curve (a workdir's, or a .jsonl copy of one, e.g. the raw points kept in
    experiments/budget/results/); a torn last line (a kill mid-write) is dropped."""
    path = workdir if workdir.endswith(".jsonl") else os.path.join(workdir, CURVE)
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not JSON") from None
    return rows


def append_row(workdir: str, row: dict) -> None:
    """One row, flushed and fsynced: a kill loses at most the row being written."""
    with open(os.path.join(workdir, CURVE), "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def cpu_at_resume(rows: list[dict], start_step: int, workdir: str) -> float:
    """Training CPU-seconds of a run resuming at `start_step` with curve `rows`: the last
    row's, plus the steps trained after it (a kill between a checkpoint and its row, or a
    run carried to another machine) charged at the run's mean rate so far. Before the first
    segment's row there is no rate (only the step-0 row): those steps are charged at the
    wall time per step the trainer logged (metrics.jsonl `step_time_s`; the step that
    compiled at the others' mean), which is about their CPU time for a run that has a core
    to itself."""
    cpu = rows[-1]["cpu_s"] if rows else 0.0
    last = rows[-1]["step"] if rows else 0
    if start_step <= last:
        return cpu
    if last > 0:
        return cpu + cpu / last * (start_step - last)
    path = os.path.join(workdir, METRICS)
    logged = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a torn last line
                    continue
                if last < row.get("step", -1) <= start_step:
                    logged.append(row)
    logged.sort(key=lambda r: r["step"])
    times = [r["step_time_s"] for r in logged if "step_time_s" in r]
    if not times:
        return cpu
    mean = sum(times) / len(times)
    prev, total = last, 0.0
    for row in logged:
        total += row.get("step_time_s", mean) * (row["step"] - prev)
        prev = row["step"]
    return cpu + total + mean * (start_step - prev)
