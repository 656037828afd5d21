"""The order the suite's test files run in, heaviest first, and how their costs are measured.

Under `pytest -n 2 --dist loadfile` (README's command) each file is a work unit that the
two workers take in turn from a queue. xdist queues files by their number of tests, which
puts the few-test, long files (the tiny demo, the benchmark and launcher smoke tests that
start subprocesses) last, where one of them can keep a worker busy for minutes after the
other has finished. Queueing the longest first (the classic longest-processing-time rule)
leaves only short files for the tail.

The costs come from `seconds_per_file.json`, written by a run with
`--record-file-seconds=tests/seconds_per_file.json` (wall seconds per file, setup and
teardown included, so a session fixture counts in the file that builds it). A file missing
from it (a new one) is costed at the measured mean per test times its number of tests.
"""

from __future__ import annotations

import json
import os
import warnings
from collections import defaultdict
from typing import Iterable, Sequence

FILE_SECONDS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                 "seconds_per_file.json")


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load_file_seconds(path: str = FILE_SECONDS_PATH) -> dict[str, float]:
    """{test file: seconds}; empty (with a warning when the file exists but is unreadable)
    so that a bad table only costs the ordering, never the run."""
    if not os.path.exists(path):
        return {}
    try:
        table = json.loads(open(path).read())
        return {str(f): float(s) for f, s in table["seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.warn(f"{path} is unreadable ({e}); test files keep xdist's order")
        return {}


def heaviest_first(nodeids: Sequence[str], seconds: dict[str, float],
                   groups: Iterable[Sequence[str]] = ()) -> list[int]:
    """Indices into `nodeids` that put whole work units (a file, or a group of files that
    share a session fixture) in decreasing estimated cost, keeping the order of the tests
    within a unit and of units that tie."""
    unit_of = {f: g[0] for g in groups for f in g}
    units: dict[str, list[int]] = {}
    for i, nodeid in enumerate(nodeids):
        f = file_of(nodeid)
        units.setdefault(unit_of.get(f, f), []).append(i)
    tests_in = defaultdict(int)
    for nodeid in nodeids:
        tests_in[file_of(nodeid)] += 1
    known = [f for f in tests_in if f in seconds]
    per_test = (sum(seconds[f] for f in known) / sum(tests_in[f] for f in known)
                if known else 1.0)
    cost = defaultdict(float)
    for f, n in tests_in.items():
        cost[unit_of.get(f, f)] += seconds.get(f, per_test * n)
    order = sorted(units, key=lambda u: -cost[u])  # stable: ties keep collection order
    return [i for u in order for i in units[u]]


class FileSecondsRecorder:
    """Sums the wall seconds of every test phase by file, as the reports arrive (in the
    xdist controller, from both workers), and writes them atomically at the end."""

    def __init__(self, path: str):
        self.path = path
        self.seconds: dict[str, float] = defaultdict(float)

    def add(self, nodeid: str, duration: float) -> None:
        self.seconds[file_of(nodeid)] += float(duration)

    def write(self) -> None:
        table = {"how": "pytest -n 2 --dist loadfile tests --record-file-seconds=PATH: wall "
                        "seconds per test file, setup and teardown included",
                 "seconds": {f: round(s, 2) for f, s in sorted(self.seconds.items())}}
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(table, fh, indent=1)
            fh.write("\n")
        os.replace(tmp, self.path)
