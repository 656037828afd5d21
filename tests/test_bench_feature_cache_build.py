"""benchmarks/bench_feature_cache_build.py on the tiny target: both builds run, agree,
and the report holds their per-record costs (a smoke test of its code path)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "bench_feature_cache_build.py")


def test_both_builds_on_the_tiny_target(tmp_path):
    from conftest import make_corpus
    corpus = make_corpus(tmp_path / "corpus", temps=())
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, BENCH, "--target", "tiny-llama", "--corpus",
                           f"{corpus}:0:3", "--seq_len", "24", "--taps", "1", "--topk", "4",
                           "--rounds", "2", "--out", str(out)], cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["records"] == 37 and result["speedup"] > 0
    assert all(v > 0 for v in result["cpu_s_per_record"].values())
    assert result["max_abs_diff_taps_bf16"] == 0 and result["max_abs_diff_data_logp"] == 0
