"""Training-curve plots read metrics.jsonl of real runs."""

import json

import numpy as np
import pytest

from dblast_jax.train import curves


def test_smooth_is_a_trailing_mean():
    np.testing.assert_allclose(curves.smooth([1, 3, 5, 7], 2), [1, 2, 4, 6])
    np.testing.assert_allclose(curves.smooth([1, 3], 1), [1, 3])


def test_plot_curves_from_workdirs(tmp_path):
    for name, slope in (("a", 1.0), ("b", 2.0)):
        d = tmp_path / name
        d.mkdir()
        rows = [{"step": s, "loss": 10 - slope * s / 10, "top1_mean": s / 100,
                 "al_estimate": s / 50} for s in range(1, 31)]
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{cut")
    assert len(curves.read_metrics(tmp_path / "a")) == 30  # the cut last line is skipped
    held = [{"step": s, "loss": 9.0, "top1_mean": 0.1, "al_estimate": s / 100}
            for s in (10, 20, 30)]
    (tmp_path / "a" / "validation.jsonl").write_text("".join(json.dumps(r) + "\n"
                                                            for r in held))
    series = curves.run_series(tmp_path / "a")
    assert [p[0] for p in series["al_estimate"][1]] == [10, 20, 30]
    assert series["al_estimate"][1][-1] == (30, 0.3) and len(series["block_nll"][0]) == 30
    assert curves.run_series(tmp_path / "b")["block_nll"][1] == []  # no validation: no points
    # a run that logs block_nll plots it; older runs fall back to their objective
    assert series["block_nll"][0][0] == (1, 9.9)
    rows = [{"step": 1, "loss": 5.0, "block_nll": 3.0}]
    (tmp_path / "b" / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert curves.run_series(tmp_path / "b")["block_nll"][0] == [(1, 3.0)]
    out = curves.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out",
                       str(tmp_path / "c.png")])
    assert out == 0 and (tmp_path / "c.png").stat().st_size > 1000
    with pytest.raises(FileNotFoundError, match="training workdir"):
        curves.read_metrics(tmp_path)
