"""The README's test command runs the suite on two xdist workers, one test file per work
unit; the files sharing the tiny demo fixture must form one unit, or both workers would
build the demo (~150 s each)."""

import json
import os
import subprocess
import sys
import types

import pytest

import conftest
import suite_order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_tiny_demo_files_are_one_work_unit_and_others_stay_per_file():
    import pytest
    pytest.importorskip("xdist")
    from xdist.scheduler import LoadFileScheduling
    config = types.SimpleNamespace(getoption=lambda name: "loadfile",
                                   option=types.SimpleNamespace(loadscopereorder=True))
    config.getvalue = lambda name: ["2*popen"] if name == "tx" else None
    sched = conftest.pytest_xdist_make_scheduler(config, None)
    assert isinstance(sched, LoadFileScheduling)
    # the collection comes heaviest first; xdist must not re-sort it by number of tests
    assert config.option.loadscopereorder is False
    units = {sched._split_scope(f"{f}::test_x") for group in
             conftest.SHARED_SESSION_FIXTURE_FILES for f in group}
    assert units == {g[0] for g in conftest.SHARED_SESSION_FIXTURE_FILES}
    assert sched._split_scope("tests/test_losses.py::test_a") == "tests/test_losses.py"
    assert sched._split_scope("tests/test_demo.py::TestX::test_y") == "tests/test_demo.py"


def test_other_distribution_modes_keep_xdists_scheduler():
    config = types.SimpleNamespace(getoption=lambda name: "load")
    assert conftest.pytest_xdist_make_scheduler(config, None) is None


def test_the_grouped_files_exist_and_use_the_shared_fixture():
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for group in conftest.SHARED_SESSION_FIXTURE_FILES:
        for f in group:
            assert "tiny_demo" in open(os.path.join(root, f)).read(), f


def test_work_units_are_queued_heaviest_first_and_stay_whole():
    ids = ["tests/a.py::t1", "tests/a.py::t2", "tests/demo.py::t", "tests/b.py::t1",
           "tests/nb.py::t", "tests/new.py::t1", "tests/new.py::t2", "tests/new.py::t3",
           "tests/c.py::t"]
    seconds = {"tests/a.py": 10.0, "tests/demo.py": 100.0, "tests/b.py": 30.0,
               "tests/nb.py": 50.0, "tests/c.py": 10.0}
    order = suite_order.heaviest_first(ids, seconds, [("tests/demo.py", "tests/nb.py")])
    assert sorted(order) == list(range(len(ids)))
    # demo + nb (150 s) as one unit; new.py unmeasured: 3 tests x the mean 200 / 6 s = 100 s;
    # b 30; a and c tie at 10 s and keep their collection order
    assert [ids[i] for i in order] == [
        "tests/demo.py::t", "tests/nb.py::t", "tests/new.py::t1", "tests/new.py::t2",
        "tests/new.py::t3", "tests/b.py::t1", "tests/a.py::t1", "tests/a.py::t2",
        "tests/c.py::t"]
    # with no table every file is costed alike per test: most tests first, ties in order
    assert [ids[i] for i in suite_order.heaviest_first(ids, {})][:3] == [
        "tests/new.py::t1", "tests/new.py::t2", "tests/new.py::t3"]


def test_a_missing_or_corrupt_table_costs_only_the_order(tmp_path):
    assert suite_order.load_file_seconds(str(tmp_path / "none.json")) == {}
    bad = tmp_path / "bad.json"
    bad.write_text('{"seconds": [1, 2')
    with pytest.warns(UserWarning, match="unreadable"):
        assert suite_order.load_file_seconds(str(bad)) == {}


def test_the_committed_table_names_only_existing_test_files():
    if not os.path.exists(suite_order.FILE_SECONDS_PATH):
        pytest.skip("no tests/seconds_per_file.json: files are queued by number of tests")
    seconds = suite_order.load_file_seconds()
    assert seconds, f"{suite_order.FILE_SECONDS_PATH} is unreadable or empty"
    for f in seconds:
        assert os.path.exists(os.path.join(ROOT, f)), f"{f} in seconds_per_file.json is gone"


def test_a_two_worker_run_records_the_seconds_of_each_file(tmp_path):
    pytest.importorskip("xdist")
    out = tmp_path / "seconds.json"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile",
         "-p", "no:cacheprovider", "tests/test_suite_scheduling.py", "-k",
         "heaviest_first or corrupt_table", f"--record-file-seconds={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    table = json.loads(out.read_text())
    assert list(table["seconds"]) == ["tests/test_suite_scheduling.py"]
    assert 0 <= table["seconds"]["tests/test_suite_scheduling.py"] < 60
    assert suite_order.load_file_seconds(str(out)) == table["seconds"]


def test_the_recorder_sums_every_phase_by_file(tmp_path):
    rec = suite_order.FileSecondsRecorder(str(tmp_path / "s.json"))
    for nodeid, d in [("tests/a.py::t1", 1.25), ("tests/a.py::t1", 0.5),
                      ("tests/a.py::C::t2", 2.0), ("tests/b.py::t", 3.0)]:
        rec.add(nodeid, d)
    rec.write()
    assert suite_order.load_file_seconds(str(tmp_path / "s.json")) == {
        "tests/a.py": 3.75, "tests/b.py": 3.0}
    assert not (tmp_path / "s.json.tmp").exists()
