"""Evaluation maths against hand-computed examples, and a tiny resumable end-to-end run."""

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest

from dblast_jax import evaluate as ev


def _row(method, bench, temp, pid, steps=0, tau=None, tau_exp=None, hist=(), tokens=0, secs=0.0):
    row = {"method": method, "benchmark": bench, "temperature": temp, "prompt_ids": [pid],
           "new_tokens": tokens, "seconds": secs}
    if steps:
        row.update(steps=steps, tau=tau, tau_expected=tau_exp, histogram=list(hist))
    return row


def test_per_position_from_histogram():
    # block 4: 2 steps accepted 0, 1 accepted 1, 3 accepted 2, 4 accepted 3 (10 steps)
    pp = ev.per_position_from_histogram([2, 1, 3, 4])
    assert pp == pytest.approx([8 / 10, 7 / 8, 4 / 7])
    assert ev.per_position_from_histogram([5, 0, 0]) == [0.0, None]


def test_pool_rows_weights_prompts_by_steps():
    # prompt a: accepted [0, 1] -> 2 steps, tau 1.5 ; prompt b: accepted [3, 3, 1, 2] -> tau 3.25
    a = _row("d", "x", 1.0, "a", 2, 1.5, 1.6, [1, 1, 0, 0], tokens=3, secs=1.0)
    b = _row("d", "x", 1.0, "b", 4, 3.25, 3.0, [0, 1, 1, 2], tokens=13, secs=3.0)
    cell = ev.pool_rows([a, b])
    # pooled: sum(acc + 1) = 1+2+4+4+2+3 = 16 over 6 steps (not the 2.375 mean of means)
    assert cell["tau"] == pytest.approx(16 / 6)
    assert cell["tau_expected"] == pytest.approx((1.6 * 2 + 3.0 * 4) / 6)
    assert cell["histogram"] == [1, 2, 1, 2]
    # the tau implied by the merged histogram agrees with the pooled tau
    h = np.array(cell["histogram"])
    assert (h * (np.arange(4) + 1)).sum() / h.sum() == pytest.approx(cell["tau"])
    assert cell["per_position_acceptance"] == pytest.approx([5 / 6, 3 / 5, 2 / 3])
    assert cell["steps"] == 6 and cell["prompts"] == 2
    assert cell["tokens_per_s"] == pytest.approx(16 / 4.0)
    accepted = np.array([0, 1, 3, 3, 1, 2])  # the six steps of a and b
    assert cell["tau_se"] == pytest.approx(accepted.std(ddof=1) / np.sqrt(6))
    assert ev.histogram_standard_error([5]) == pytest.approx(0.0)
    assert ev.histogram_standard_error([1]) is None


def test_aggregate_speedup_against_plain_of_same_cell():
    rows = [
        _row("plain", "gsm", 0.7, "a", tokens=10, secs=2.0),          # 5 tok/s
        _row("plain", "gsm", 1.5, "a", tokens=10, secs=5.0),          # 2 tok/s
        _row("d1", "gsm", 0.7, "a", 2, 2.0, 2.0, [0, 2], tokens=10, secs=1.0),   # 10 tok/s
        _row("d1", "gsm", 1.5, "a", 2, 1.5, 1.5, [1, 1], tokens=10, secs=2.5),   # 4 tok/s
        _row("d1", "hum", 0.7, "a", 1, 3.0, 3.0, [0, 0, 1], tokens=3, secs=1.0),  # no plain
    ]
    cells = {(c["method"], c["benchmark"], c["temperature"]): c for c in ev.aggregate(rows)}
    assert cells[("d1", "gsm", 0.7)]["speedup"] == pytest.approx(2.0)
    assert cells[("d1", "gsm", 1.5)]["speedup"] == pytest.approx(2.0)
    assert cells[("plain", "gsm", 0.7)]["speedup"] == pytest.approx(1.0)
    assert cells[("plain", "gsm", 0.7)]["tau"] is None
    assert cells[("d1", "hum", 0.7)]["speedup"] is None


def test_macro_gain_and_table_formats(tmp_path):
    # taus: base = (2, 4) on two benchmarks -> macro 3 ; new = (3, 6) -> macro 4.5 (+50%)
    cells = [
        {"method": "base", "benchmark": "b1", "temperature": 1.5, "tau": 2.0},
        {"method": "base", "benchmark": "b2", "temperature": 1.5, "tau": 4.0},
        {"method": "new", "benchmark": "b1", "temperature": 1.5, "tau": 3.0},
        {"method": "new", "benchmark": "b2", "temperature": 1.5, "tau": 6.0},
        {"method": "new", "benchmark": "b1", "temperature": 0.7, "tau": 5.0},  # b2 missing
        {"method": "plain", "benchmark": "b1", "temperature": 1.5, "tau": None},
    ]
    assert ev.macro_average([2.0, 4.0]) == 3.0
    assert ev.macro_average([2.0, None]) is None
    assert ev.relative_gain(4.5, 3.0) == pytest.approx(50.0)
    assert ev.relative_gain(1.0, None) is None
    table = ev.build_table(cells, baseline="base")
    assert [r["drafter"] for r in table["rows"]] == ["base", "new"]
    assert table["columns"] == ["b1@T0.7", "b1@T1.5", "b2@T0.7", "b2@T1.5",
                                "macro@T0.7", "macro@T1.5", "gain@T0.7", "gain@T1.5"]
    new = table["rows"][1]
    assert new["macro@T1.5"] == pytest.approx(4.5)
    assert new["gain@T1.5"] == pytest.approx(50.0)
    assert new["macro@T0.7"] is None and new["gain@T0.7"] is None
    assert table["rows"][0]["gain@T1.5"] == pytest.approx(0.0)
    with pytest.raises(ValueError, match="baseline 'nope'"):
        ev.build_table(cells, baseline="nope")

    md = ev.table_markdown(table).splitlines()
    assert md[0].startswith("| drafter | b1@T0.7") and len(md) == 4
    assert "+50.0%" in md[3] and "4.500" in md[3]
    parsed = list(csv.DictReader(io.StringIO(ev.table_csv(table))))
    assert float(parsed[1]["gain@T1.5"]) == pytest.approx(50.0)
    assert parsed[1]["macro@T0.7"] == ""
    result = ev.write_tables(cells, tmp_path, baseline="base")
    assert json.loads((tmp_path / "results.json").read_text())["tables"]["tau"] == \
        result["tables"]["tau"]


def test_read_rows_drops_a_cut_last_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n{"a": 2')
    assert ev._read_rows(path) == [{"a": 1}]
    assert path.read_text() == '{"a": 1}\n'
    path.write_text('{"a": 1}\nnot json\n{"a": 3}\n')
    with pytest.raises(ValueError, match="line 2"):
        ev._read_rows(path)


def test_run_evaluation_end_to_end_and_resume(tmp_path, monkeypatch):
    import dblast_jax.generation as gen
    from dblast_jax.config import DrafterConfig

    target = gen.load_target("tiny-qwen3")
    drafters = {
        "k1": gen.init_drafter(target, DrafterConfig.for_target(
            target.config, block_size=4, num_categories=1), 1),
        "k2": gen.init_drafter(target, DrafterConfig.for_target(
            target.config, block_size=4, num_categories=2), 2),
    }
    prompt_sets = {"toy": [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38]]}
    calls = {"plain": 0, "spec": 0}
    real_generate, real_spec = gen.generate, gen.speculative_generate

    def counting_generate(*a, **k):
        calls["plain"] += 1
        return real_generate(*a, **k)

    def counting_spec(*a, **k):
        calls["spec"] += 1
        return real_spec(*a, **k)

    monkeypatch.setattr(gen, "generate", counting_generate)
    monkeypatch.setattr(gen, "speculative_generate", counting_spec)
    kwargs = dict(prompt_sets=prompt_sets, temperatures=(0.7, 1.5), prompts_per_benchmark=2,
                  max_new_tokens=6, out_dir=tmp_path, baseline="k1", progress=False,
                  warmup=False)
    first = ev.run_evaluation(target, drafters, **kwargs)
    assert calls == {"plain": 4, "spec": 8}  # 2 temps x 2 prompts x (plain, 2 drafters)

    for name in ("rows.jsonl", "results.json", "results.csv", "results.md",
                 "tau_vs_temperature.png", "acceptance_histograms.png",
                 "per_position_acceptance.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == 12
    table = first["tables"]["tau"]
    assert [r["drafter"] for r in table["rows"]] == ["k1", "k2"]
    assert table["columns"] == ["toy@T0.7", "toy@T1.5", "macro@T0.7", "macro@T1.5",
                                "gain@T0.7", "gain@T1.5"]
    for row in table["rows"]:
        for t in ("0.7", "1.5"):
            assert 1.0 <= row[f"toy@T{t}"] <= 4.0  # block 4: tau in [1, b]
            assert row[f"macro@T{t}"] == pytest.approx(row[f"toy@T{t}"])  # one benchmark
    assert table["rows"][0]["gain@T0.7"] == pytest.approx(0.0)
    cells = [c for c in first["cells"] if c["method"] != "plain"]
    assert len(cells) == 4
    for c in cells:
        assert sum(c["histogram"]) == c["steps"] > 0 and len(c["histogram"]) == 4
        assert c["speedup"] is not None and c["speedup"] > 0
        # every prompt hits max_new_tokens (tiny-qwen3 has no stop token)
        assert c["new_tokens"] == 2 * 6
    csv_rows = list(csv.reader(io.StringIO((tmp_path / "results.csv").read_text())))
    assert csv_rows[0] == ["drafter"] + table["columns"] and len(csv_rows) == 3

    # rerun: nothing is generated again and the results are identical
    again = ev.run_evaluation(target, drafters, **kwargs)
    assert calls == {"plain": 4, "spec": 8}
    assert again == first
    # settings that change the numbers refuse the same out_dir
    with pytest.raises(ValueError, match="max_new_tokens"):
        ev.run_evaluation(target, drafters, **dict(kwargs, max_new_tokens=7))


def test_multi_turn_feeds_the_model_first_answer(monkeypatch):
    """MT-Bench style: turn 2 is sent after the model's own answer to turn 1; stats pool."""
    import types

    import dblast_jax.generation as gen
    from dblast_jax.config import SamplingConfig
    from dblast_jax.data.sources import Prompt

    seen = []

    def fake_spec(target, drafter, prompts, sampling, rng, warmup=False):
        seen.append(prompts)
        turn = len(seen)
        stats = ({"steps": 2, "tau": 1.5, "tau_expected": 1.5, "histogram": [1, 1, 0]}
                 if turn == 1 else
                 {"steps": 1, "tau": 3.0, "tau_expected": 2.0, "histogram": [0, 0, 1]})
        return gen.GenerationResult([[1] * 3], [f"answer {turn}"],
                                    {"seconds": 1.0, "new_tokens": 3}, stats)

    monkeypatch.setattr(gen, "speculative_generate", fake_spec)
    target = types.SimpleNamespace(tokenizer=object(), name="fake")
    prompt = Prompt("81", "mt-bench", ("first question", "second question"))
    row = ev._run_unit(target, object(), [prompt], SamplingConfig(max_new_tokens=3), 0, False)
    assert seen[0] == [[{"role": "user", "content": "first question"}]]
    assert seen[1] == [[{"role": "user", "content": "first question"},
                        {"role": "assistant", "content": "answer 1"},
                        {"role": "user", "content": "second question"}]]
    assert row["turns"] == 2 and row["new_tokens"] == 6 and row["seconds"] == 2.0
    assert row["steps"] == 3 and row["tau"] == pytest.approx((1.5 * 2 + 3.0) / 3)
    assert row["tau_expected"] == pytest.approx((1.5 * 2 + 2.0) / 3)
    assert row["histogram"] == [1, 1, 1]


@pytest.mark.real_model
def test_launcher_on_the_real_benchmarks(tmp_path):
    """launch/evaluate.py end to end: two real benchmarks, one prompt each, SmolLM2's
    tokenizer and chat template on the tiny random model (the real SmolLM2's speculative
    loop is covered by test_generation_api / test_shipped_dflash; here it would only add
    its ~40 s compile)."""
    import subprocess
    import sys

    from dblast_jax.io import fetch
    for name in ("smollm2-135m-instruct", "gsm8k", "mt-bench"):  # runnable on its own
        fetch.fetch(fetch.lookup(name))
    out = tmp_path / "eval"
    cmd = [sys.executable, "launch/evaluate.py", "--model=tiny-smollm2", "--drafter=rand=random",
           "--drafter=rand4=random-k2", "--baseline=rand", "--benchmarks=gsm8k,mt-bench", "--temperatures=1.0",
           "--prompts_per_benchmark=1", "--max_new_tokens=4", f"--out={out}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          cwd=str(Path(__file__).resolve().parents[1]))
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    table = results["tables"]["tau"]
    assert {r["drafter"] for r in table["rows"]} == {"rand", "rand4"}
    assert all(1.0 <= r[c] <= 8.0 for r in table["rows"] for c in table["columns"]
               if c.startswith(("gsm8k@", "mt-bench@")))
    assert (out / "tau_vs_temperature.png").exists() and "rand4" in done.stdout


def test_drafter_spec_settings_parse_and_refuse_bad_input():
    from dblast_jax.generation import parse_drafter_spec
    assert parse_drafter_spec("k4=runs/k4") == ("k4", "runs/k4", {})
    assert parse_drafter_spec("k4_mix=runs/k4@mode=mixture,zt=0.5") == (
        "k4_mix", "runs/k4", {"verify_mode": "mixture", "category_temperature": 0.5})
    assert parse_drafter_spec("d=x@draft_temperature=0.8")[2] == {"draft_temperature": 0.8}
    for bad, match in (("nameless", "NAME=FOLDER"), ("k=dir@speed=2", "setting"),
                       ("k=dir@mode=sideways", "verify_mode"), ("k=dir@zt=0", "> 0"),
                       ("k=dir@zt", "setting")):
        with pytest.raises(ValueError, match=match):
            parse_drafter_spec(bad)


def test_a_shorter_block_setting_drafts_fewer_tokens_and_is_recorded(tmp_path):
    """`NAME=DIR@block=N`: the same parameters draft N - 1 tokens per step (cheaper verify
    passes on a CPU); greedy output stays the target's; a longer block than the trained
    one, or a non-integer, is refused; the evaluation records the setting per name."""
    import dblast_jax as dj
    import dblast_jax.generation as gen
    from dblast_jax.config import DrafterConfig
    from dblast_jax.io.dflash import export_drafter

    assert gen.parse_drafter_spec("k=d@block=2,mode=mixture")[2] == {
        "block_size": 2, "verify_mode": "mixture"}
    for bad in ("k=d@block=1", "k=d@block=x", "k=d@block=2.5"):
        with pytest.raises(ValueError, match="block must be an integer >= 2"):
            gen.parse_drafter_spec(bad)
    target = gen.load_target("tiny-qwen3")
    drafter = gen.init_drafter(target, DrafterConfig.for_target(
        target.config, block_size=4, num_categories=2), 3)
    folder = export_drafter(drafter.params, drafter.config, tmp_path / "k2")
    drafters = gen.named_drafters([f"b4={folder}", f"b2={folder}@block=2"], target)
    assert drafters["b4"].config.block_size == 4 and drafters["b4"].block_override is None
    assert drafters["b2"].config.block_size == 2 and drafters["b2"].block_override == 2
    assert drafters["b2"].params is drafters["b4"].params
    assert drafters["b2"].sampling_overrides == {}
    with pytest.raises(ValueError, match="trained with blocks of 4"):
        gen.named_drafters([f"b8={folder}@block=8"], target)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    greedy = dj.SamplingConfig(temperature=0.0, max_new_tokens=6, stop_tokens=(10**6,))
    spec = gen.speculative_generate(target, drafters["b2"], prompts, greedy)
    assert spec.tokens == dj.generate(target, prompts, greedy).tokens
    assert len(spec.stats["histogram"]) == 2  # 0 or 1 accepted draft per step
    result = ev.run_evaluation(target, drafters, prompt_sets={"toy": [[3, 14, 15, 92, 65]]},
                               temperatures=(1.0,), max_new_tokens=6, out_dir=tmp_path / "eval",
                               baseline="b4", progress=False, warmup=False, plots=False)
    weights = ev.weights_digest(drafter.params)  # the same weights at either block
    assert result["meta"]["method_settings"] == {"b4": {"weights": weights},
                                                 "b2": {"block": 2, "weights": weights}}
    with pytest.raises(ValueError, match="method b2"):  # the same name, another block
        ev.run_evaluation(target, gen.named_drafters([f"b4={folder}", f"b2={folder}@block=3"],
                                                     target),
                          prompt_sets={"toy": [[3, 14, 15, 92, 65]]}, temperatures=(1.0,),
                          max_new_tokens=6, out_dir=tmp_path / "eval", baseline="b4",
                          progress=False, warmup=False, plots=False)


def test_evaluation_variants_share_a_drafter_and_use_their_own_settings(tmp_path, monkeypatch):
    """One trained drafter under two names: greedy-branch and mixture verification (the
    verify-mode ablation) and a category temperature (the Z_T ablation)."""
    import dblast_jax.generation as gen
    from dblast_jax.config import DrafterConfig
    from dblast_jax.io.dflash import export_drafter

    target = gen.load_target("tiny-qwen3")
    drafter = gen.init_drafter(target, DrafterConfig.for_target(
        target.config, block_size=4, num_categories=2), 3)
    folder = export_drafter(drafter.params, drafter.config, tmp_path / "k2")
    specs = [f"k2={folder}", f"k2_mix={folder}@mode=mixture", f"k2_zt={folder}@zt=0.5"]
    drafters = gen.named_drafters(specs, target)
    assert drafters["k2"].params is drafters["k2_mix"].params  # loaded once
    assert drafters["k2_mix"].sampling_overrides == {"verify_mode": "mixture"}
    seen = {}
    real_spec = gen.speculative_generate

    def recording_spec(target, drafter, prompts, sampling, rng, warmup=False):
        seen.setdefault(drafter.name, set()).add((sampling.verify_mode,
                                                  sampling.category_temperature))
        return real_spec(target, drafter, prompts, sampling, rng, warmup=warmup)

    monkeypatch.setattr(gen, "speculative_generate", recording_spec)
    kwargs = dict(prompt_sets={"toy": [[3, 14, 15, 92, 65]]}, temperatures=(1.5,),
                  max_new_tokens=6, out_dir=tmp_path / "eval", baseline="k2", progress=False,
                  warmup=False, plots=False)
    result = ev.run_evaluation(target, drafters, **kwargs)
    assert seen == {"k2": {("greedy-branch", 1.0)}, "k2_mix": {("mixture", 1.0)},
                    "k2_zt": {("greedy-branch", 0.5)}}
    settings = result["meta"]["method_settings"]
    assert settings["k2_zt"] == {"category_temperature": 0.5,
                                 "weights": ev.weights_digest(drafter.params)}
    assert settings["k2"]["weights"] == settings["k2_mix"]["weights"]  # one drafter
    assert {r["drafter"] for r in result["tables"]["tau"]["rows"]} == {"k2", "k2_mix", "k2_zt"}
    # the same name with other settings would mix incomparable rows: refused
    changed = gen.named_drafters([f"k2={folder}", f"k2_mix={folder}@mode=sampled-branch"],
                                 target)
    with pytest.raises(ValueError, match="method k2_mix"):
        ev.run_evaluation(target, changed, **kwargs)
    # other weights under the same name (an export retrained in place): refused, so the
    # rows of the old weights are never reported as the new ones'
    retrained = gen.init_drafter(target, drafter.config, 4)
    other = export_drafter(retrained.params, retrained.config, tmp_path / "k2_retrained")
    renamed = gen.named_drafters([f"k2={other}"], target)
    rows_before = (tmp_path / "eval" / ev.ROWS_FILE).read_text()
    with pytest.raises(ValueError, match="method k2.*weights"):
        ev.run_evaluation(target, renamed, **kwargs)
    assert (tmp_path / "eval" / ev.ROWS_FILE).read_text() == rows_before  # nothing lost


def test_best_block_table_picks_the_fastest_block_per_temperature():
    cells = []
    speeds = {("d", 0.0): 1.2, ("d_block4", 0.0): 1.5, ("d_block2", 0.0): 1.1,
              ("d", 0.7): 0.9, ("d_block4", 0.7): 0.8, ("d_block2", 0.7): 1.0}
    for (method, temp), speed in speeds.items():
        for bench, scale in (("a", 1.0), ("b", 1.2)):  # macro = mean over benchmarks
            cells.append({"method": method, "benchmark": bench, "temperature": temp,
                          "speedup": speed * scale})
    table = ev.best_block_table(cells, {"d": {8: "d", 4: "d_block4", 2: "d_block2"}})
    assert table["columns"] == ["best_block@T0.0", "speedup@T0.0", "best_block@T0.7",
                                "speedup@T0.7"]
    (row,) = table["rows"]
    assert (row["best_block@T0.0"], row["best_block@T0.7"]) == (4, 2)
    assert row["speedup@T0.0"] == pytest.approx(1.5 * 1.1)
    assert "| d | 4 | 1.650 | 2 | 1.100 |" in ev.table_markdown(table)


def test_block_variants_and_the_best_block_report(tmp_path):
    import dblast_jax.generation as gen

    target = gen.load_target("tiny-qwen3")
    drafters = gen.named_drafters(["ng=ngram@k=3", "r=random-k2"], target)
    widened, families = gen.block_variants(drafters, [2, 6, 8])
    # n-gram drafting takes any block; the random drafter (block 8) only shorter ones
    assert families == {"ng": {2: "ng_block2", 4: "ng", 6: "ng_block6", 8: "ng_block8"},
                        "r": {2: "r_block2", 6: "r_block6", 8: "r"}}
    assert widened["r_block6"].config.block_size == 6 and widened["r_block6"].block_override == 6
    with pytest.raises(ValueError, match="must be >= 2"):
        gen.block_variants(drafters, [1])
    result = ev.run_evaluation(target, widened, prompt_sets={"toy": [[3, 14, 15, 92, 65]]},
                               temperatures=(0.0,), max_new_tokens=6, out_dir=tmp_path / "ev",
                               progress=False, warmup=False, plots=False,
                               block_families=families)
    rows = {r["drafter"]: r for r in result["tables"]["best_block"]["rows"]}
    assert rows["ng"]["best_block@T0.0"] in (2, 4, 6, 8)
    assert rows["r"]["best_block@T0.0"] in (2, 6, 8)
    assert "The block with the most tokens/s" in (tmp_path / "ev" / "results.md").read_text()
