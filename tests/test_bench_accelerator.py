"""benchmarks/bench_accelerator.py --tiny: the accelerator benchmark's code paths (plain
decode step, speculative step, train step, overheads) on tiny shapes, as a smoke test."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_accelerator_tiny(tmp_path):
    out = tmp_path / "tiny.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # tiny-qwen3 only (the Qwen3-8B stand-in): plain, speculative and train paths in
    # one model keep the test short; `--tiny` alone also runs the tiny-llama stand-in
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_accelerator.py"), "--tiny",
         "--models", "qwen3-8b", "--repeats", "1", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| stage | model |" in proc.stdout
    rec = json.loads(out.read_text())
    assert set(rec) >= {"device", "settings", "plain_decode", "speculative", "train",
                        "overheads", "skipped", "total_s"}
    assert rec["skipped"] == []
    assert [r["batch"] for r in rec["plain_decode"]] == [1, 2]
    for r in rec["plain_decode"]:
        assert r["model"] == "tiny-qwen3"
        for key in ("step_ms", "tok_s", "compile_s"):
            assert _positive(r[key]), (key, r)
    combos = {(r["K"], r["verify_mode"]) for r in rec["speculative"]}
    assert combos == {(1, "greedy-branch"), (4, "sampled-mixture")}
    for r in rec["speculative"]:
        assert r["block_size"] == 16
        for key in ("spec_step_ms", "plain_step_ms", "spec_over_plain", "compile_s"):
            assert _positive(r[key]), (key, r)
        assert set(r["predicted_speedup"]) == {"2", "4", "6"}
        for tau, speedup in r["predicted_speedup"].items():
            assert _positive(speedup)
            assert math.isclose(speedup, int(tau) / r["spec_over_plain"], rel_tol=1e-6)
    t = rec["train"]
    assert t["experiment"] == "qwen3_dblast_k4_al" and t["full_target"]
    for key in ("step_s", "tokens_per_s", "flops_per_step", "model_flops_per_s", "compile_s"):
        assert _positive(t[key]), (key, t)
    assert math.isfinite(t["loss"])
    assert _positive(t["flops"]["target"]) and _positive(t["flops"]["branch_head"])
    # CPU: no peak table entry (MFU omitted) and no memory_stats (peak omitted)
    assert rec["device"]["platform"] == "cpu" and "mfu" not in t
    assert _positive(rec["overheads"]["init_s"]["tiny-qwen3"])
    assert rec["device"]["peak_hbm_bytes_per_s"] is None
    assert all("pct_of_bandwidth_roofline" not in r for r in rec["plain_decode"])


def test_roofline_tables_and_decode_bytes():
    """The peak tables match device kinds most-specific first, and the decode roofline
    counts every weight once plus the full K/V buffer (bf16: 2 bytes a value)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_accelerator as bench
    finally:
        sys.path.pop(0)
    from dblast_jax.config import TargetConfig
    assert bench.peak_bandwidth("NVIDIA H200") == 4.8e12
    assert bench.peak_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert bench.peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert bench.peak_bandwidth("TPU v5 lite") == 0.819e12
    assert bench.peak_bandwidth("cpu") is None and bench.peak_flops("cpu") is None
    tc = TargetConfig.smollm2_135m()
    kv_values = 8 * 256 * tc.num_layers * 2 * tc.num_kv_heads * tc.head_dim
    assert bench.decode_step_bytes(tc, 8, 256, 1000) == 2 * (1000 + kv_values)


@pytest.mark.slow
def test_the_documented_tiny_dry_run_passes(tmp_path):
    """Exactly BENCHMARKS.md's CPU dry run (`--tiny` alone: both stand-ins, the SmolLM2
    recipe's five taps swapped for the 3-layer stand-in's default tap); ~45 s here."""
    out = tmp_path / "tiny.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_accelerator.py", "--tiny", "--out", str(out)],
        cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["skipped"] == []
    assert {r["model"] for r in rec["plain_decode"]} == {"tiny-llama", "tiny-qwen3"}
