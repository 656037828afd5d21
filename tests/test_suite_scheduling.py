"""The README's test command runs the suite on two xdist workers, one test file per work
unit; the files sharing the tiny demo fixture must form one unit, or both workers would
build the demo (~150 s each)."""

import types

import conftest


def test_the_tiny_demo_files_are_one_work_unit_and_others_stay_per_file():
    import pytest
    pytest.importorskip("xdist")
    from xdist.scheduler import LoadFileScheduling
    config = types.SimpleNamespace(getoption=lambda name: "loadfile")
    config.getvalue = lambda name: ["2*popen"] if name == "tx" else None
    sched = conftest.pytest_xdist_make_scheduler(config, None)
    assert isinstance(sched, LoadFileScheduling)
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
