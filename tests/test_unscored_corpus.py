"""Unscored (tokens-only) corpora: regenerated without log-probs, or a scored corpus's
scores dropped (`dblast data drop-scores`); read, merged and resumed like any other."""

import argparse

import numpy as np
import pytest

from dblast_jax.data import corpus as corpus_io
from dblast_jax.data import merge as merge_lib
from dblast_jax.data import regenerate as regen
from dblast_jax.data.cli_commands import add_data_subcommands
from dblast_jax.data.corpus import Corpus
from dblast_jax.data.drop_scores import drop_scores
from dblast_jax.data.pipeline import CorpusDataSource
from dblast_jax.generation import load_target

STOP = 5
SCORED = regen.RegenConfig(gen_temperatures=(1.0,), verify_temperatures=(0.7, 1.5),
                           max_new_tokens=10, batch_size=4, shard_size=5, pad_multiple=32,
                           seed=3)
UNSCORED = regen.RegenConfig(**{**SCORED.__dict__, "verify_temperatures": ()})


@pytest.fixture(scope="module")
def target():
    return load_target("tiny-llama")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [[int(t) for t in rng.integers(6, 97, int(rng.integers(3, 20)))] for _ in range(11)]


@pytest.fixture(scope="module")
def both(tmp_path_factory, target, prompts):
    root = tmp_path_factory.mktemp("unscored")
    regen.regenerate(target, prompts, root / "scored", SCORED, progress=False,
                     stop_tokens=(STOP,))
    regen.regenerate(target, prompts, root / "unscored", UNSCORED, progress=False,
                     stop_tokens=(STOP,))
    return root / "scored", root / "unscored"


def _shard_files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.glob("shard-*.npz"))}


def test_unscored_run_samples_the_scored_runs_tokens_without_the_scores(both):
    scored, unscored = both
    for name in _shard_files(scored):
        a = corpus_io.read_shard(scored / name)
        b = corpus_io.read_shard(unscored / name)
        assert sorted(b) == sorted(k for k in a if not k.startswith(("logp_", "entropy_")))
        for k in b:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        assert (unscored / name).stat().st_size < 0.6 * (scored / name).stat().st_size
    assert corpus_io.read_manifest(unscored)["settings"]["verify_temperatures"] == []


def test_unscored_records_carry_no_logp(both):
    _, unscored = both
    c = Corpus(unscored, verify_temperature=1.0)  # asking for a T_v is not an error
    assert not c.scored and len(c) == 11
    r = c[3]
    assert "logp" not in r and r["entropy"] == {} and r["loss_mask"].any()
    src = CorpusDataSource(unscored, verify_temperature=1.0)
    assert sorted(src[3]) == ["loss_mask", "tokens"]
    from dblast_jax.data.stats import corpus_stats, format_stats
    s = corpus_stats(unscored)
    assert s["mean_entropy"] == {} and "answers" in format_stats(s)


def test_drop_scores_gives_the_unscored_runs_corpus_and_regenerate_resumes_it(
        both, tmp_path, target, prompts):
    scored, unscored = both
    out = tmp_path / "dropped"
    m = drop_scores(str(scored), str(out), log=None)
    assert m["settings"]["verify_temperatures"] == []
    assert _shard_files(out) == _shard_files(unscored)  # byte for byte
    assert drop_scores(str(scored), str(out), log=None) == m  # rerun: kept, same manifest

    # a scored run stopped after one shard, its scores dropped, then continued unscored
    part, cont = tmp_path / "part", tmp_path / "continued"
    regen.regenerate(target, prompts, part, SCORED, progress=False, stop_tokens=(STOP,),
                     max_shards=1)
    drop_scores(str(part), str(cont), log=None)
    resumed = regen.regenerate(target, prompts, cont, UNSCORED, progress=False,
                               stop_tokens=(STOP,))
    assert resumed["complete"] and _shard_files(cont) == _shard_files(unscored)
    with pytest.raises(ValueError, match=r"different settings \(differs in "
                                         r"\['verify_temperatures'\]\)"):
        regen.regenerate(target, prompts, cont, SCORED, progress=False, stop_tokens=(STOP,))


def test_drop_scores_refusals(both, tmp_path):
    scored, unscored = both
    with pytest.raises(FileNotFoundError, match="no corpus at"):
        drop_scores(str(tmp_path / "nothing"), str(tmp_path / "x"), log=None)
    with pytest.raises(ValueError, match="is its source"):
        drop_scores(str(scored), str(scored), log=None)
    merged = tmp_path / "merged"
    merge_lib.merge_corpora([str(scored)], str(merged), log=None)
    with pytest.raises(ValueError, match="is a merged corpus"):
        drop_scores(str(merged), str(tmp_path / "y"), log=None)
    other = tmp_path / "other"
    drop_scores(str(scored), str(other), log=None)
    manifest = corpus_io.read_manifest(other)
    manifest["settings"]["seed"] = 99
    corpus_io.write_manifest(other, manifest)
    with pytest.raises(ValueError, match="holds another corpus"):
        drop_scores(str(scored), str(other), log=None)
    # a corrupt source shard is refused, and nothing of it is written
    bad = tmp_path / "bad_source"
    bad.mkdir()
    for p in scored.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    data = bytearray((bad / "shard-00001.npz").read_bytes())
    data[-30] ^= 1
    (bad / "shard-00001.npz").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="shard-00001.npz is missing or does not match"):
        drop_scores(str(bad), str(tmp_path / "z"), log=None)
    assert not (tmp_path / "z" / "shard-00001.npz").exists()


def test_merge_with_an_unscored_source_is_unscored(both, tmp_path):
    scored, unscored = both
    out = tmp_path / "merged"
    m = merge_lib.merge_corpora([f"{scored}:0:2", str(unscored)], str(out), log=None)
    assert m["settings"]["verify_temperatures"] == []
    c, s, u = Corpus(out), Corpus(scored), Corpus(unscored)
    assert len(c) == 10 + 11 and not c.scored
    for i, r in enumerate([s[i] for i in range(10)] + [u[i] for i in range(11)]):
        np.testing.assert_array_equal(c[i]["tokens"], r["tokens"])
        assert "logp" not in c[i]
    with pytest.raises(ValueError, match=r"stores log-probs at \[\], not at \['1.5'\]"):
        merge_lib.merge_corpora([str(scored), str(unscored)], str(tmp_path / "m2"),
                                verify_temperatures=(1.5,), log=None)


def test_cli_regenerate_none_and_drop_scores(both, tmp_path, capsys):
    scored, unscored = both
    parser = argparse.ArgumentParser()
    add_data_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["data", "regenerate", "--out", str(tmp_path / "r"),
                              "--verify-temperatures", "none"])
    assert args.verify_temperatures == ()
    args = parser.parse_args(["data", "drop-scores", str(scored), "--out", str(tmp_path / "d")])
    assert args.func(args) == 0
    assert "unscored (tokens only)" in capsys.readouterr().out
    assert _shard_files(tmp_path / "d") == _shard_files(unscored)
