"""benchmarks/bench_speculative.py --parts mechanism-cost on the tiny target: every
dependent mechanism's draft and whole speculative step are timed beside K = 1 and a plain
decode step (a smoke test of its code path, not of the timings)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "bench_speculative.py")


def test_mechanism_cost_on_the_tiny_target(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, BENCH, "--parts", "mechanism-cost", "--model",
                           "tiny-llama", "--block", "4", "--batch", "1", "--repeats", "1",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["mechanism"] for r in rows] == ["k1", "dblast_k4", "correction",
                                              "block_causal", "k4_correction"]
    assert all(r["draft_ms"] > 0 and r["step_ms"] > 0 and r["plain_step_ms"] > 0
               for r in rows)
    k1 = rows[0]
    assert k1["draft_over_k1"] == 1.0 and k1["step_over_k1"] == 1.0
    assert {r["verify_mode"] for r in rows} == {"sampled-branch", "sampled-mixture"}
