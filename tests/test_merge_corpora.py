"""`dblast data merge`: shard ranges of several corpora as one corpus folder."""

import argparse
import json

import numpy as np
import pytest

from dblast_jax.data import merge as merge_lib
from dblast_jax.data import regenerate as regen
from dblast_jax.data.cli_commands import add_data_subcommands
from dblast_jax.data.corpus import Corpus
from dblast_jax.generation import load_target

STOP = 5
CFG = regen.RegenConfig(gen_temperatures=(1.0,), verify_temperatures=(0.7, 1.5),
                        max_new_tokens=6, batch_size=4, shard_size=4, pad_multiple=32, seed=3,
                        logprob_rows=16)


@pytest.fixture(scope="module")
def target():
    return load_target("tiny-llama")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, target):
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(6, 97, int(rng.integers(3, 12)))]
               for _ in range(10)]
    root = tmp_path_factory.mktemp("sources")
    a, b = root / "a", root / "b"  # b: the same prompts, new seed, one more temperature
    regen.regenerate(target, prompts, a, CFG, progress=False, stop_tokens=(STOP,))
    cfg_b = regen.RegenConfig(**{**CFG.__dict__, "seed": 4, "gen_temperatures": (1.0, 0.0),
                                 "verify_temperatures": (0.7, 1.0, 1.5)})
    regen.regenerate(target, prompts, b, cfg_b, progress=False, stop_tokens=(STOP,))
    return a, b


def _records(corpus):
    return [corpus[i] for i in range(len(corpus))]


def test_merged_records_are_the_sources_records_in_order(corpora, tmp_path):
    a, b = corpora
    out = tmp_path / "merged"
    m = merge_lib.merge_corpora([f"{a}:1:3", str(b)], str(out), log=None)
    assert m["complete"] and m["merged_from"]["verify_temperatures"] == [0.7, 1.5]
    merged = Corpus(out, verify=True)
    want = _records(Corpus(a, first_shard=1, max_shards=3)) + _records(Corpus(b))
    got = _records(merged)
    assert len(got) == len(want) == m["totals"]["sequences"]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g["tokens"], w["tokens"])
        np.testing.assert_array_equal(g["loss_mask"], w["loss_mask"])
        assert g["id"] == w["id"] and g["gen_temperature"] == w["gen_temperature"]
        assert set(g["logp"]) == {"0.7", "1.5"}
        for key in ("0.7", "1.5"):
            np.testing.assert_array_equal(g["logp"][key], w["logp"][key])
    # a's shards hold exactly the kept temperatures: copied byte for byte
    a_entries = {e["index"]: e for e in json.loads((a / "manifest.json").read_text())["shards"]}
    assert m["shards"][0]["sha256"] == a_entries[1]["sha256"]
    assert m["shards"][0]["source"] == f"{a}#1"
    # b's shards lose their T = 1.0 arrays
    from dblast_jax.data.corpus import read_shard
    last = read_shard(out / m["shards"][-1]["file"])
    assert {k for k in last if k.startswith(("logp_", "entropy_"))} == {
        "logp_0.7", "logp_1.5", "entropy_0.7", "entropy_1.5"}
    assert "1" not in Corpus(out).temperatures
    assert set(m["settings"]["gen_temperatures"]) == {0.0, 1.0}


def test_rerun_resumes_and_a_different_merge_is_refused(corpora, tmp_path):
    a, b = corpora
    out = tmp_path / "merged"
    first = merge_lib.merge_corpora([str(a), str(b)], str(out), log=None)
    (out / "shard-00001.npz").write_bytes(b"damaged")  # a shard broken after the merge
    again = merge_lib.merge_corpora([str(a), str(b)], str(out), log=None)
    assert again["shards"] == first["shards"]
    assert len(Corpus(out, verify=True)) == first["totals"]["sequences"]
    with pytest.raises(ValueError, match="a different merge"):
        merge_lib.merge_corpora([str(a)], str(out), log=None)
    with pytest.raises(ValueError, match="made by `dblast data regenerate`"):
        merge_lib.merge_corpora([str(b)], str(a), log=None)


def test_bad_sources_are_refused_before_anything_is_written(corpora, tmp_path, target):
    a, b = corpora
    out = tmp_path / "never"
    with pytest.raises(ValueError, match="are not finished"):
        merge_lib.merge_corpora([f"{a}:0:9"], str(out), log=None)
    with pytest.raises(FileNotFoundError, match="no corpus there"):
        merge_lib.merge_corpora([str(tmp_path / "missing")], str(out), log=None)
    with pytest.raises(ValueError, match="not at"):
        merge_lib.merge_corpora([str(a), str(b)], str(out), verify_temperatures=[1.0],
                                log=None)
    with pytest.raises(ValueError, match="FOLDER:A:B"):
        merge_lib.parse_source(f"{a}:x:2")
    with pytest.raises(ValueError, match="is also a source"):
        merge_lib.merge_corpora([str(a)], str(a), log=None)
    # another target's corpus
    other = tmp_path / "other"
    regen.regenerate(load_target("tiny-llama", seed=1), [[7, 8, 9]], other, CFG,
                     progress=False, stop_tokens=(STOP,))
    with pytest.raises(ValueError, match="different targets"):
        merge_lib.merge_corpora([str(a), str(other)], str(out), log=None)
    # a source shard replaced after its manifest was written
    broken = tmp_path / "broken"
    regen.regenerate(target, [[7, 8, 9]], broken, CFG, progress=False, stop_tokens=(STOP,))
    (broken / "shard-00000.npz").write_bytes(b"replaced")
    with pytest.raises(ValueError, match="does not match"):
        merge_lib.merge_corpora([str(broken)], str(tmp_path / "x"), log=None)
    assert not out.exists()


def test_regenerate_refuses_to_write_into_a_merged_corpus(corpora, tmp_path, target):
    a, _ = corpora
    out = tmp_path / "merged"
    merge_lib.merge_corpora([str(a)], str(out), log=None)
    with pytest.raises(ValueError, match="is a merged corpus"):
        regen.regenerate(target, [[7, 8, 9]], out, CFG, progress=False, stop_tokens=(STOP,))


def test_cli_merge(corpora, tmp_path, capsys):
    a, b = corpora
    parser = argparse.ArgumentParser()
    add_data_subcommands(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "cli"
    args = parser.parse_args(["data", "merge", "--out", str(out), f"{a}:0:2", str(b),
                              "--verify-temperatures", "1.5"])
    assert args.func(args) == 0
    assert "log-probs at ['1.5']" in capsys.readouterr().out
    assert Corpus(out).temperatures == [1.5]


def test_held_out_corpus_sharing_training_prompts_is_refused(corpora, tmp_path):
    """Training on a merged / grown corpus and validating on another folder: answers to a
    training prompt are not held out, whatever seed or temperature sampled them."""
    from dblast_jax.train import config as TC
    from dblast_jax.train import validation as V
    a, b = corpora  # b answers a's prompts again
    train = tmp_path / "train"
    merge_lib.merge_corpora([f"{a}:0:2"], str(train), log=None)  # a's first 8 prompts
    cfg = TC.get_experiment("tiny_dflash", [f"data={train}", "seq_len=32"])
    target_config = load_target("tiny-llama").config
    with pytest.raises(ValueError, match=r"answer 8 prompt\(s\) that the training data"):
        V.make_validation_source(cfg, target_config, data=str(b), shards="0:2")
    # a's last shard holds the other 2 prompts: disjoint, accepted
    held = V.make_validation_source(cfg, target_config, data=str(a), shards="2:3")
    assert len(held) == 2
    V.check_prompts_held_out(str(a), 2, str(b), 2, 3)  # b's shard 2: a's last 2 prompts
    with pytest.raises(ValueError, match="first 3 shards"):
        V.check_prompts_held_out(str(a), 3, str(b), 2, 3)


def test_excluding_the_prompts_of_held_out_shards(corpora, tmp_path):
    """b answers a's prompts again: excluding a's shard 2 (prompts 8-9) leaves b's other
    records, with their arrays cut consistently, and the held-out check then passes."""
    from dblast_jax.train import validation as V
    a, b = corpora
    out = tmp_path / "train"
    m = merge_lib.merge_corpora([str(b)], str(out), exclude_prompts_of=[f"{a}:2:3"], log=None)
    src, merged = Corpus(b), Corpus(out, verify=True)
    assert m["totals"]["excluded_sequences"] == 4  # prompts 8 and 9, at T = 1.0 and 0.0
    assert len(merged) == len(src) - 4 == m["totals"]["sequences"]
    held = {tuple(r["tokens"][:r["prompt_length"]]) for r in _records(Corpus(a, first_shard=2))}
    kept = [r for r in _records(src) if tuple(r["tokens"][:r["prompt_length"]]) not in held]
    for g, w in zip(_records(merged), kept):
        np.testing.assert_array_equal(g["tokens"], w["tokens"])
        np.testing.assert_array_equal(g["loss_mask"], w["loss_mask"])
        for key in ("0.7", "1", "1.5"):
            np.testing.assert_array_equal(g["logp"][key], w["logp"][key])
            np.testing.assert_array_equal(g["entropy"][key], w["entropy"][key])
        assert g["id"] == w["id"] and g["stopped"] == w["stopped"]
    assert sum(e["response_tokens"] for e in m["shards"]) == sum(
        int(r["loss_mask"].sum()) for r in kept)
    V.check_prompts_held_out(str(out), 0, str(a), 2, 3)
    with pytest.raises(ValueError, match="answer 2 prompt"):
        V.check_prompts_held_out(str(b), 0, str(a), 2, 3)

