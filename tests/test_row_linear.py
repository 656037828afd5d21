"""layers.RowLinear: nnx.Linear over rows flattened to 2-D gives the same outputs and
gradients at any rank, and its benchmark runs (benchmarks/bench_row_linear.py)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dblast_jax.models.layers import RowLinear

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("lead", [(), (5,), (2, 3), (2, 3, 4)])
def test_same_outputs_and_gradients_as_nnx_linear(lead):
    x = jnp.asarray(np.random.default_rng(0).normal(size=lead + (6,)), jnp.float32)
    plain = nnx.Linear(6, 4, use_bias=False, rngs=nnx.Rngs(1))
    rows = RowLinear(6, 4, use_bias=False, rngs=nnx.Rngs(1))
    np.testing.assert_array_equal(np.asarray(plain.kernel[...]), np.asarray(rows.kernel[...]))
    out = rows(x)
    assert out.shape == lead + (4,)
    np.testing.assert_allclose(out, plain(x), rtol=1e-6, atol=1e-6)

    def loss(layer, x):
        return jnp.sum(jnp.sin(layer(x)))

    gp = nnx.grad(loss, argnums=(0, 1))(plain, x)
    gr = nnx.grad(loss, argnums=(0, 1))(rows, x)
    for a, b in zip(jax.tree_util.tree_leaves(gp), jax.tree_util.tree_leaves(gr)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_benchmark_runs_and_reports_equal_results(tmp_path):
    out = tmp_path / "row_linear.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_row_linear.py"),
                           "--shape", "2,3,4", "--hidden", "8", "--inner", "16", "--rounds", "2",
                           "--calls-per-round", "2", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    row = json.loads(out.read_text())["rows"][0]
    assert row["shape"] == [2, 3, 4, 8] and row["calls_timed"] == 4
    assert row["max_relative_difference"] < 1e-5 and row["speedup"] > 0
