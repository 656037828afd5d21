"""benchmarks/bench_regenerate.py on the tiny target: it times every batch size on the same
prompts and counts the answers' tokens, as a smoke test of its code path."""

import json
import os
import subprocess
import sys

import numpy as np

from dblast_jax.data import regenerate as regen
from dblast_jax.generation import load_target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_regenerate_tiny(tmp_path):
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(6, 97, int(rng.integers(3, 12)))]
               for _ in range(8)]
    corpus = tmp_path / "corpus"
    regen.regenerate(load_target("tiny-llama"), prompts, corpus,
                     regen.RegenConfig(max_new_tokens=4, batch_size=4, shard_size=4,
                                       pad_multiple=32),
                     progress=False)
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_regenerate.py"),
         "--model", "tiny-llama", "--prompts-from", f"{corpus}:0:2", "--batch", "2", "4",
         "--new-tokens", "6", "--verify-temperatures", "1.0", "--scoring", "in-loop",
         "teacher-forced", "--out", str(out)],
        cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| batch | scoring | response tokens |" in proc.stdout
    rec = json.loads(out.read_text())
    assert rec["prompts"] == 8 and [r["batch"] for r in rec["rows"]] == [2, 2, 4, 4]
    assert [r["scoring"] for r in rec["rows"]] == ["in-loop", "teacher-forced"] * 2
    # the same keys and batches: both ways of scoring generate the same answers
    assert rec["rows"][0]["response_tokens"] == rec["rows"][1]["response_tokens"]
    for r in rec["rows"]:
        assert 0 < r["response_tokens"] <= 8 * 6
        assert r["cpu_s"] > 0 and r["tokens_per_cpu_s"] > 0
    assert rec["best_batch"] in (2, 4)
    too_big = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_regenerate.py"),
         "--model", "tiny-llama", "--prompts-from", f"{corpus}:0:2", "--batch", "16"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert too_big.returncode == 2 and "needs at least that many" in too_big.stderr
