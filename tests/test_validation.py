"""Held-out validation: config checks (held-out really held out), corpus shard ranges,
validation inside a training run (rows, resume), and `validate_drafters` /
`dblast validate` on exported drafters agreeing with the trainer."""

import json
import os

import numpy as np
import pytest

from dblast_jax import cli
from dblast_jax.data import corpus as corpus_io
from dblast_jax.generation import Target, load_drafter
from dblast_jax.train import config as TC
from dblast_jax.train import trainer as TR
from dblast_jax.train import validation as V
from conftest import make_corpus as _make_corpus, tiny_cfg, tiny_target


def _cfg(**kw):
    return TC.TrainConfig(target="tiny-llama", drafter=TC.DrafterSpec(block_size=4), seq_len=48,
                          **kw)


@pytest.mark.parametrize("kw, message", [
    (dict(data="c", data_shards=4, validation_shards="3:5"), "overlap the training"),
    (dict(data="c", validation_shards="4:6"), "every shard"),
    (dict(data="c", data_shards=4, validation_shards="6:5"), "0 <= A < B"),
    (dict(data="c", data_shards=4, validation_shards="x"), "expected A:B"),
    (dict(data="c", data_shards=4, validate_every=10), "needs held-out data"),
    (dict(data="synthetic", validation_shards="1:2"), "fresh draws"),
    (dict(data="synthetic", validate_every=-1), "validate_every"),
    (dict(data="synthetic", validation_batches=0), "validation_batches"),
])
def test_config_refuses_validation_that_is_not_held_out(kw, message):
    with pytest.raises(ValueError, match=message):
        _cfg(**kw)


def test_config_accepts_held_out_settings():
    _cfg(data="c", data_shards=4, validation_shards="4:6", validate_every=10)
    _cfg(data="c", data_shards=4, validation_data="other", validation_shards="0:2",
         validate_every=10)  # shards of another corpus may be anything
    _cfg(data="c", validation_data="held.jsonl", validate_every=10)
    _cfg(data="synthetic", validate_every=10)


def test_trainer_data_argument_is_checked_for_overlap(tmp_path):
    """validation_data names another corpus in the config, but the data handed to the
    Trainer is that corpus: the overlap with the training shards is still refused."""
    folder = str(_make_corpus(tmp_path / "c"))
    cfg = tiny_cfg("tiny_dflash", "data=elsewhere", "data_shards=2", f"validation_data={folder}",
                   "validation_shards=1:3", "validate_every=2", "verify_temperature=1.0",
                   "seq_len=24")
    with pytest.raises(ValueError, match="overlap the training"):
        TR.Trainer(cfg, str(tmp_path / "w"), target=tiny_target(), data=folder, progress=False)
    assert not os.path.exists(tmp_path / "w" / "checkpoints")


def test_corpus_shard_range(tmp_path):
    folder = _make_corpus(tmp_path)  # shards of 13 / 13 / 11 records; record r starts with r
    tail = corpus_io.Corpus(folder, first_shard=1, max_shards=3)
    assert len(tail) == 24 and int(tail[0]["tokens"][0]) == 13
    assert int(tail[23]["tokens"][0]) == 36
    assert len(corpus_io.Corpus(folder, first_shard=2)) == 11
    with pytest.raises(ValueError, match="finished"):
        corpus_io.Corpus(folder, first_shard=2, max_shards=5)
    with pytest.raises(ValueError, match="empty shard range"):
        corpus_io.Corpus(folder, first_shard=2, max_shards=2)
    with pytest.raises(ValueError, match="no finished shard"):
        corpus_io.Corpus(folder, first_shard=3)
    # the validation source of a training config reads exactly the held-out shards
    cfg = _cfg(data=str(folder), data_shards=1, validation_shards="1:3", validate_every=5,
               verify_temperature=1.0)
    src = V.make_validation_source(cfg, tiny_target()[0])
    assert len(src) == 24 and int(src[0]["tokens"][0]) == 13


@pytest.fixture(scope="module")
def validated_run(tmp_path_factory):
    cfg = tiny_cfg("tiny_dflash", "num_steps=6", "validate_every=3", "validation_batches=2",
                   "checkpoint_every=3")
    wd = str(tmp_path_factory.mktemp("validated"))
    trainer = TR.Trainer(cfg, wd, target=tiny_target(), progress=False, log=lambda s: None)
    result = trainer.run()
    final = trainer.evaluate(V.make_validation_source(cfg, tiny_target()[0]), 2, step=6)
    trainer.close()
    return cfg, wd, result, final


def test_trainer_writes_validation_rows(validated_run):
    cfg, wd, result, final = validated_run
    rows = V.read_validation(wd)
    assert [r["step"] for r in rows] == [3, 6]
    for key in ("nll", "top1_mean", "al_estimate", "al_estimate_mixture", "validation_s"):
        assert all(np.isfinite(r[key]) for r in rows), key
    # the row at the last step is the held-out metric of the final parameters ...
    for key, value in final.items():
        np.testing.assert_allclose(rows[-1][key], value, rtol=1e-6, err_msg=key)
    # ... on records the run never trained on (same language, other seed)
    held = V.make_validation_source(cfg, tiny_target()[0])
    from dblast_jax.train.batches import make_source
    train_src = make_source("synthetic", vocab_size=tiny_target()[0].vocab_size,
                            block_size=cfg.drafter.block_size, seq_len=cfg.seq_len,
                            verify_temperature=cfg.verify_temperature, seed=cfg.seed)
    assert not np.array_equal(held[0]["tokens"], train_src[0]["tokens"])
    np.testing.assert_array_equal(held.phrases, train_src.phrases)  # the same language


def test_resume_drops_validation_rows_after_the_checkpoint(validated_run, tmp_path):
    cfg, _, _, _ = validated_run
    wd = str(tmp_path / "resume")
    first = TR.Trainer(cfg, wd, target=tiny_target(), progress=False, log=lambda s: None)
    first.run(stop_at=3)
    first.close()
    with open(os.path.join(wd, V.VALIDATION_FILE), "a") as f:  # a kill after step 4's row
        f.write(json.dumps({"step": 4, "nll": 0.0}) + "\n")
    second = TR.Trainer(cfg, wd, target=tiny_target(), progress=False, log=lambda s: None)
    second.run()
    second.close()
    assert [r["step"] for r in V.read_validation(wd)] == [3, 6]


def test_validation_of_object_data_needs_held_out_data(tmp_path):
    cfg = tiny_cfg("tiny_dflash", "num_steps=2", "validate_every=1")
    records = [list(range(1, 30))] * 4
    with pytest.raises(ValueError, match="validation_data"):
        TR.Trainer(cfg, str(tmp_path / "w"), target=tiny_target(), data=records,
                   progress=False)
    assert not os.path.exists(tmp_path / "w" / "checkpoints")


def test_validate_drafters_matches_the_trainer(validated_run):
    cfg, wd, result, final = validated_run
    tcfg, tparams, name = tiny_target()
    target = Target(tcfg, tparams, None, name)
    drafter = load_drafter(result.export_path, target)
    got = V.validate_drafters({"run": drafter}, target, "synthetic", num_batches=2,
                              batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                              anchors_per_sequence=cfg.anchors_per_sequence,
                              verify_temperature=cfg.verify_temperature, progress=False)
    for key in ("al_estimate", "al_estimate_mixture", "top1_mean"):
        np.testing.assert_allclose(got["run"][key], final[key], rtol=1e-4, err_msg=key)
    assert len(got["run"]["per_batch"]["al_estimate"]) == 2 and got["run"]["al_estimate_se"] >= 0
    half = dict(got["run"], per_batch={"al_estimate": [v / 2 for v in
                                                        got["run"]["per_batch"]["al_estimate"]]})
    table = V.validation_table({"a": got["run"], "b": half}, "a")
    assert "+0.0% ± 0.0%" in table and "-50.0% ±" in table
    assert "mixture AL gain" not in table  # K = 1: the two estimates are equal
    with pytest.raises(ValueError, match="baseline"):
        V.validation_table(got, "nobody")


def test_validation_table_pairs_the_mixture_estimates_when_k_exceeds_1():
    k1 = {"al_estimate": 1.5, "al_estimate_mixture": 1.5,
          "per_batch": {"al_estimate": [1.0, 2.0], "al_estimate_mixture": [1.0, 2.0]}}
    k4 = {"al_estimate": 1.2, "al_estimate_mixture": 1.8,
          "per_batch": {"al_estimate": [1.0, 1.4], "al_estimate_mixture": [1.2, 2.4]}}
    table = V.validation_table({"k1": k1, "k4": k4}, "k1")
    head, _, k1_row, k4_row = table.splitlines()
    assert head.endswith("| AL gain vs k1 (paired SE) | mixture AL gain vs k1 (paired SE) |")
    assert k1_row.endswith("| +0.0% ± 0.0% | +0.0% ± 0.0% |")
    gain, se = V.paired_gain(k4, k1, "al_estimate_mixture")
    assert gain == pytest.approx(20.0)  # 1.8 / 1.5
    assert se == pytest.approx(100 * np.std([0.2, 0.4], ddof=1) / np.sqrt(2) / 1.5)
    assert k4_row.endswith(f"| -20.0% ± {V.paired_gain(k4, k1)[1]:.1f}% | "
                           f"+{gain:.1f}% ± {se:.1f}% |")


def test_paired_gain_against_numpy():
    a = {"per_batch": {"al_estimate": [1.0, 2.0, 3.0]}}
    b = {"per_batch": {"al_estimate": [1.0, 1.0, 1.0]}}
    gain, se = V.paired_gain(a, b)
    assert gain == pytest.approx(100.0)
    assert se == pytest.approx(100 * np.std([0, 1, 2], ddof=1) / np.sqrt(3))
    with pytest.raises(ValueError, match="same validation set"):
        V.paired_gain(a, {"per_batch": {"al_estimate": [1.0]}})


def test_cli_validate(tmp_path, capsys):
    out = tmp_path / "v"
    argv = ["validate", "--model", "tiny-llama", "--drafter", "k1=random",
            "--drafter", "k2=random-k2", "--data", "synthetic", "--batches", "1",
            "--batch-size", "2", "--seq-len", "32", "--anchors", "2", "--baseline", "k1",
            "--out", str(out)]
    assert cli.main(argv) == 0
    record = json.loads((out / "validation.json").read_text())
    assert set(record["results"]) == {"k1", "k2"}
    assert "| k2 |" in (out / "validation.md").read_text()
    for r in record["results"].values():  # per draft position, summing to the estimates
        assert len(r["accept_prefix"]) == 7  # block size 8 (random drafters)
        assert 0.0 <= r["greedy_accepted"] <= 7.0
        assert sum(r["accept_prefix"]) == pytest.approx(r["al_estimate"], rel=1e-4, abs=1e-7)
        assert sum(r["accept_prefix_mixture"]) == pytest.approx(r["al_estimate_mixture"],
                                                                rel=1e-4, abs=1e-7)
    assert (out / "prefix_acceptance.png").stat().st_size > 1000
    assert cli.main(["validate", "--model", "tiny-llama", "--drafter",
                     "k1=random@mode=mixture", "--data", "synthetic"]) == 2
    assert "do not apply" in capsys.readouterr().err


def test_category_temperature_scales_the_branch_weights():
    """`NAME=DIR@zt=X`: validation scores the drafter with pi' = softmax(prior / Z_T);
    Z_T = 1 changes nothing, a huge Z_T is the uniform prior, other settings are refused."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from dblast_jax.generation import drafter_from_spec
    from dblast_jax.models.drafter import tempered_prior_params
    tcfg, tparams, name = tiny_target()
    target = Target(tcfg, tparams, None, name)
    base = drafter_from_spec("random-k3", target)
    kernel = base.params["prior"]["kernel"]
    prior = {"kernel": 3.0 * jax.random.normal(jax.random.key(1), kernel.shape, kernel.dtype),
             "bias": jnp.asarray([2.0, -1.0, 0.0], kernel.dtype)}
    # branches far apart (a random expander barely separates them) and a skewed prior
    expander = dict(base.params["expander"],
                    out_kernel=30.0 * base.params["expander"]["out_kernel"])
    base = dataclasses.replace(base, params={**base.params, "expander": expander})
    skewed = dataclasses.replace(base, params={**base.params, "prior": prior})
    scaled = tempered_prior_params(skewed.params, 0.5)["prior"]
    np.testing.assert_allclose(scaled["kernel"], 2.0 * prior["kernel"], rtol=1e-6)
    np.testing.assert_allclose(scaled["bias"], [4.0, -2.0, 0.0], rtol=1e-6)
    k1 = drafter_from_spec("random", target)
    assert tempered_prior_params(k1.params, 0.5) is k1.params  # no prior: unchanged
    with pytest.raises(ValueError, match="> 0"):
        tempered_prior_params(skewed.params, 0.0)

    def zt(d, value):
        return dataclasses.replace(d, sampling_overrides={"category_temperature": value})

    uniform = dataclasses.replace(base, params={
        **base.params, "prior": jax.tree.map(jnp.zeros_like, prior)})
    got = V.validate_drafters(
        {"skewed": skewed, "zt1": zt(skewed, 1.0), "zt_huge": zt(skewed, 1e6),
         "uniform": uniform},
        target, "synthetic", num_batches=1, batch_size=2, seq_len=32,
        anchors_per_sequence=2, progress=False)
    for key in ("al_estimate", "al_estimate_mixture"):
        assert got["zt1"][key] == pytest.approx(got["skewed"][key], rel=1e-6), key
        assert got["zt_huge"][key] == pytest.approx(got["uniform"][key], rel=1e-4), key
        assert got["uniform"][key] < 0.8 * got["skewed"][key], key  # the weights matter
    with pytest.raises(ValueError, match="only zt"):
        V.validate_drafters({"m": dataclasses.replace(
            skewed, sampling_overrides={"verify_mode": "mixture"})}, target, "synthetic",
            num_batches=1, progress=False)
