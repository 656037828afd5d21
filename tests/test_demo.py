"""`dblast demo` end to end at minimal size: fetch -> regenerate -> train -> evaluate."""

import json

import pytest

from dblast_jax import cli
from dblast_jax.demo import DemoConfig, parse_demo_overrides, run_demo, shipped_drafters


def test_tiny_demo_end_to_end_and_resume(tiny_demo, monkeypatch):
    """The whole pipeline on a tiny random model with SmolLM2's tokenizer and the real
    benchmark / training-pool files (run from scratch by the `tiny_demo` fixture); a rerun
    resumes every stage and changes nothing. A drafter shipped in pretrained/ for the
    demo's target is evaluated beside them."""
    config, work, result, logs = (tiny_demo.config, tiny_demo.workdir, tiny_demo.result,
                                  tiny_demo.logs)
    monkeypatch.setenv("DBLAST_PRETRAINED_DIR", tiny_demo.pretrained)

    manifest = json.loads((work / "corpus" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["totals"]["sequences"] == config.corpus_prompts
    assert result.corpus["response_tokens"] > 0
    for name, _ in config.drafters:
        assert (work / name / "export" / "config.json").exists()
        metrics = (work / name / "metrics.jsonl").read_text().splitlines()
        assert json.loads(metrics[-1])["step"] == config.train_steps
    cells = result.results["cells"]
    methods = {"plain"} | {n for n, _ in config.drafters}
    want = {(m, b, t) for m in methods for b in config.benchmarks for t in config.temperatures}
    assert {(c["method"], c["benchmark"], float(c["temperature"])) for c in cells} == want
    # what ships comes first, in its own folder: plain, the n-gram drafter, the shipped
    # drafter and the two combined, at the shipped temperatures (T = 0 included)
    shipped = json.loads((work / "eval_shipped" / "results.json").read_text())["cells"]
    methods = {"plain", "ngram", "tiny-shipped", "tiny-shipped+ngram"}
    assert {(c["method"], c["benchmark"], float(c["temperature"])) for c in shipped} == {
        (m, b, t) for m in methods for b in config.benchmarks
        for t in config.shipped_temperatures}
    for c in cells + shipped:
        if c["method"] != "plain":  # n-gram drafting: blocks of 8 (its default)
            block = 8 if c["method"] == "ngram" else config.drafter.block_size
            assert 1.0 <= c["tau"] <= block and c["steps"] > 0
    assert len(list((work / "eval").glob("*.png"))) == 3
    assert "SMALL-BUDGET DEMO" in result.summary and "| dblast_k4 |" in result.summary
    assert result.summary.index("WHAT SHIPS") < result.summary.index("SMALL-BUDGET DEMO")
    assert "where speculative decoding wins:" in result.summary
    assert "- tiny-shipped+ngram: macro T0.0 " in result.summary
    assert "tiny-shipped: shipped in pretrained/" in result.summary
    # the shipped drafter (it ships token counts) drafts over a draft-time vocabulary
    recorded = json.loads((work / "eval_shipped" / "run_config.json").read_text())
    assert recorded["method_settings"]["tiny-shipped"]["draft_vocab"] == config.draft_vocab
    assert recorded["method_settings"]["tiny-shipped+ngram"]["draft_vocab"] == config.draft_vocab
    assert (work / "SUMMARY.md").read_text().strip() == result.summary.strip()
    assert any("corpus:" in line for line in logs)

    again = run_demo(config, work, progress=False, log=lambda s: None)
    assert again.results["cells"] == cells  # every stage resumed: nothing regenerated
    # a different corpus size in the same workdir is refused, not silently mixed
    with pytest.raises(ValueError):
        run_demo(config.replace(corpus_new_tokens=12), work, progress=False,
                 log=lambda s: None)


def test_demo_overrides_and_errors(capsys):
    base = DemoConfig()
    cfg = parse_demo_overrides(["train_steps=80", "temperatures=0.7,1.5", "eval_prompts=4",
                                "extra_drafters=old=some/dir"], base)
    assert (cfg.train_steps, cfg.temperatures, cfg.eval_prompts) == (80, (0.7, 1.5), 4)
    assert cfg.extra_drafters == ("old=some/dir",)
    for bad in (["nonsense=1"], ["train_steps"], ["drafters=x"]):
        with pytest.raises(ValueError, match="demo override"):
            parse_demo_overrides(bad, base)
    with pytest.raises(ValueError, match="baseline"):
        run_demo(base.replace(baseline="nobody"), "unused", progress=False)
    assert cli.main(["demo", "--tiny", "--set", "bogus=1"]) == 2
    assert "demo override" in capsys.readouterr().err


def test_demo_says_when_no_drafter_is_shipped(tmp_path, monkeypatch):
    """No shipped drafter for the demo's target (or no manifest at all, e.g. an install
    without its package data) is one line of the demo's output, not a silent drop."""
    said = []
    monkeypatch.delenv("DBLAST_PRETRAINED_DIR", raising=False)
    assert len(shipped_drafters(DemoConfig(), said.append)) == 2 and said == []  # the repository's
    monkeypatch.setenv("DBLAST_PRETRAINED_DIR", str(tmp_path))
    assert shipped_drafters(DemoConfig(), said.append) == {}
    assert said == [f"-- no shipped drafter for smollm2-135m-instruct (found: no "
                    f"{tmp_path / 'manifest.json'}); evaluating only the drafters trained here"]
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"drafters": {"x": {"target": "tiny-llama", "folder": "tiny-llama/x", "files": {}}}}))
    said.clear()
    assert shipped_drafters(DemoConfig.tiny(), said.append) == {}
    assert said == [f"-- no shipped drafter for tiny-smollm2 (in {tmp_path / 'manifest.json'}); "
                    "evaluating only the drafters trained here"]
    said.clear()
    assert shipped_drafters(DemoConfig.tiny(pretrained=False), said.append) == {} and said == []
