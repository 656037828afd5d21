"""benchmarks/bench_train_step.py on the tiny target: the seq-len pair builds a cache per
window and times both Trainers, as a smoke test of its code path; a bad pair is refused."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "bench_train_step.py")


def _bench(*args, timeout=600):
    return subprocess.run([sys.executable, BENCH, "--target", "tiny-llama", *args], cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                          text=True, timeout=timeout)


def test_seq_len_pair_on_the_tiny_target(corpus, tmp_path):
    out = tmp_path / "bench.json"
    proc = _bench("--data", str(corpus), "--data-shards", "0", "--experiments", "tiny_dflash",
                  "--pair", "seq-len:16:24", "--verify-temperature", "1.0", "--batch-size", "2", "--anchors", "2",
                  "--head-tokens", "32", "--head-sampled", "8", "--rounds", "2",
                  "--steps-per-round", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| experiment | seq16 s/step | seq24 s/step |" in proc.stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert row["seq16_s_per_step"] > 0 and row["seq24_s_per_step"] > 0
    assert row["steps_timed"] >= 2 and row["cache_build_s"] > 0 and row["cache_mb"] > 0


def test_a_bad_pair_is_refused():
    proc = _bench("--pair", "seq-len:256", timeout=120)
    assert proc.returncode == 2 and "expected live-vs-cached" in proc.stderr
