"""benchmarks/bench_vs_dflash.py --tiny: our speculative loop and z-lab's dflash 0.1.0 loop
side by side on tiny random models (the real-model run is recorded in BENCHMARKS.md).

Run in-process (a subprocess would import JAX, torch and transformers again): `benchmark`
restores torch's thread count and dflash's timer afterwards; XLA's one-thread flags are
only set when the script runs as __main__."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.torch,  # dflash passes past_key_values= to the target
              pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")]

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("dflash.model", reason="z-lab's dflash package is not installed; install "
                                           "it with `pip install --no-deps dflash==0.1.0`")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_vs_dflash.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_vs_dflash", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_peer_benchmark(tmp_path, capsys):
    import torch

    bench = _bench()
    threads = torch.get_num_threads()
    out = tmp_path / "vs_dflash.json"
    # our loop drafts over a draft-time vocabulary (half the tiny vocabulary); T = 0 output
    # must still equal dflash's full-head loop token for token
    rc = bench.main(["--tiny", "--prompts", "2", "--max-new-tokens", "16", "--out", str(out),
                     "--draft-vocab", "32"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert torch.get_num_threads() == threads  # restored
    res = json.loads(out.read_text())
    assert res["table"] in printed
    assert res["mode"] == "tiny" and res["ok"] is True and res["draft_vocab"] == 32
    assert res["batch"] == 1 and res["prompts"] == 2 and res["max_new_tokens"] == 16
    assert res["mask_token_id"] is not None and res["block_size"] == 6
    assert res["versions"]["dflash"] == "0.1.0"
    assert res["torch_threads"] == 1
    assert [e["temperature"] for e in res["per_temperature"]] == [0.0, 1.0]
    for e in res["per_temperature"]:
        for key in ("ours_tok_s", "theirs_tok_s", "ratio", "ours_tau", "ours_tau_se",
                    "theirs_tau", "theirs_tau_se", "tau_z"):
            assert isinstance(e[key], (int, float)) and math.isfinite(e[key]), (key, e[key])
        assert e["ours_tok_s"] > 0 and e["theirs_tok_s"] > 0
        assert e["ratio"] == pytest.approx(e["ours_tok_s"] / e["theirs_tok_s"])
        assert 1.0 <= e["ours_tau"] <= 6 and 1.0 <= e["theirs_tau"] <= 6
        assert e["ours_steps"] > 0 and e["theirs_full_steps"] > 0
        rows = e["per_prompt"]
        assert len(rows) == 2 and [r["first"] for r in rows] == ["ours", "theirs"]  # interleaved
        for r in rows:
            assert 0 < len(r["ours_tokens"]) <= 16 and 0 < len(r["theirs_tokens"]) <= 16
    greedy = res["per_temperature"][0]
    assert greedy["tokens_identical"] is True
    assert all(r["ours_tokens"] == r["theirs_tokens"] for r in greedy["per_prompt"])
    assert "tokens identical" in res["table"] and "| 1 |" in res["table"]


def test_float32_copy_keeps_a_token_mask_and_relabels_a_learned_one(tmp_path):
    """The real benchmark's drafter: the shipped token-mask K = 1 keeps its mask token;
    an older learned-mask export is relabelled (its mask tensor dropped)."""
    import jax
    from safetensors.numpy import load_file

    from dblast_jax.config import DrafterConfig, TargetConfig
    from dblast_jax.io import dflash
    from dblast_jax.models import drafter as D

    tc = TargetConfig.tiny_qwen3()
    for name, mask in (("token", 5), ("learned", None)):
        dc = DrafterConfig.for_target(tc, num_layers=1, block_size=4, mask_token_id=mask)
        src = dflash.export_drafter(D.init_drafter_params(dc, tc, jax.random.key(0)), dc,
                                    str(tmp_path / name), dtype="bfloat16")
        if mask is not None:  # a ranking beside the weights travels with the copy
            np.save(Path(src) / "token_counts.npy", np.arange(tc.vocab_size, dtype=np.int64))
        out = _bench().float32_dflash_copy(Path(src), tmp_path / f"{name}_f32", 16)
        assert (out / "token_counts.npy").is_file() == (mask is not None)
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["dflash_config"]["mask_token_id"] == (5 if mask is not None else 16)
        assert "dblast_config" not in cfg and cfg["dtype"] == "float32"
        tensors = load_file(str(out / "model.safetensors"))
        assert all(v.dtype.name == "float32" for v in tensors.values())
        assert not any(k.startswith("dblast.") for k in tensors)
