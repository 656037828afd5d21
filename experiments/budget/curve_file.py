"""The budget_curve.jsonl file: its one reader and one writer.

Apart from budget_curve.py so that other scripts (experiments/flagship/finish_leg.py) read
curves without importing budget_curve's absl flags: two scripts' flags in one process
collide (--out is defined by more than one launcher).
"""

from __future__ import annotations

import json
import os

CURVE = "budget_curve.jsonl"


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
