"""Regenerated corpora on gs:// (no bucket is reached: the `gcs` fixture of conftest.py
sends gs://BUCKET/KEY to TMP/gcs/BUCKET/KEY through etils' `mock_epath`).

A corpus regenerated into gs://bucket/corpus is written without temp files or renames,
resumed (finished shards skipped), byte-identical to a local regeneration, read back by
`Corpus` / `dblast data stats` / `--prompts-from`, and trained from (training and
validation shards). Nothing may land in a local "gs:" folder on the way.
"""

import os

import numpy as np
import pytest

from conftest import tiny_cfg, tiny_target
from dblast_jax.data import corpus as corpus_io
from dblast_jax.data import regenerate as regen
from dblast_jax.data.corpus import Corpus

CFG = regen.RegenConfig(verify_temperatures=(1.0,), max_new_tokens=8, batch_size=2,
                        shard_size=3, pad_multiple=8, seed=3)
PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16], [17, 18],
           [19, 20, 21], [22, 23]]  # 3 shards: 3, 3, 2 prompts
URI = "gs://bucket/corpus"


def _target():
    from dblast_jax.generation import Target
    tcfg, tparams, name = tiny_target()
    return Target(tcfg, tparams, None, name)


def _regen(out, **kw):
    return regen.regenerate(_target(), PROMPTS, out, CFG, progress=False, stop_tokens=[0],
                            **kw)


def _no_local_gs_folder(*roots):
    for root in roots:
        for here, dirs, _ in os.walk(root):
            assert not any(d.startswith("gs:") for d in dirs), (here, dirs)


def _strip(manifest):
    return [{k: v for k, v in s.items() if not k.endswith("seconds")}
            for s in manifest["shards"]]


def test_regenerate_resume_read_and_train_on_gs(gcs, tmp_path, monkeypatch):
    from dblast_jax.data.stats import corpus_stats
    from dblast_jax.train import trainer as TR

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # a pathlib.Path("gs://...") would make cwd/gs:/bucket/...
    local = tmp_path / "local"
    m_local = _regen(local)
    assert m_local["complete"]

    # object-store writes are whole objects: no temp file, no rename
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda *a: pytest.fail(f"a rename on gs://: {a}"))
    m1 = _regen(URI, max_shards=1)
    assert not m1["complete"] and [s["index"] for s in m1["shards"]] == [0]
    mirror = os.path.join(gcs, "bucket", "corpus")
    assert sorted(os.listdir(mirror)) == ["manifest.json", "shard-00000.npz"]  # records merged

    calls = []
    real_run = regen._run_shard
    monkeypatch.setattr(regen, "_run_shard", lambda *a, **k: calls.append(a[2].index)
                        or real_run(*a, **k))
    m2 = _regen(URI)
    assert calls == [1, 2]  # resumed: the finished shard was skipped
    assert m2["complete"] and _strip(m2) == _strip(m_local)
    assert sorted(os.listdir(mirror)) == ["manifest.json", "shard-00000.npz",
                                          "shard-00001.npz", "shard-00002.npz"]
    for s in m2["shards"]:  # byte for byte a local regeneration's shards
        with open(os.path.join(mirror, s["file"]), "rb") as a, open(local / s["file"], "rb") as b:
            assert a.read() == b.read()
    calls.clear()
    assert _regen(URI)["complete"] and calls == []  # nothing left to do
    monkeypatch.setattr(os, "replace", real_replace)

    # read back: Corpus, stats, --prompts-from, the trainer's folder check
    assert corpus_io.is_corpus_folder(URI) and not corpus_io.is_corpus_folder("gs://bucket/x")
    remote, mine = Corpus(URI, verify_temperature=1.0), Corpus(local, verify_temperature=1.0)
    assert remote.name == URI and len(remote) == len(mine) == len(PROMPTS)
    for i in range(len(mine)):
        a, b = remote[i], mine[i]
        assert a["id"] == b["id"]
        for k in ("tokens", "loss_mask", "logp"):
            np.testing.assert_array_equal(a[k], b[k])
    assert corpus_stats(URI)["mean_entropy"] == corpus_stats(local)["mean_entropy"]
    assert regen.corpus_prompts(URI, "1:3") == regen.corpus_prompts(local, "1:3")

    # train 2 steps on shards 0..1, validating on shard 2 of the same gs:// corpus
    cfg = tiny_cfg("tiny_dflash", f"data={URI}", "data_shards=2", "validation_shards=2:3",
                   "validate_every=2", "validation_batches=1", "verify_temperature=1.0",
                   "seq_len=24", "num_steps=2", "checkpoint_every=2", "export=false",
                   "tensorboard=false")
    logs = []
    trainer = TR.Trainer(cfg, str(tmp_path / "wd"), target=tiny_target(), progress=False,
                         log=logs.append)
    try:
        assert trainer.batcher.source.name == URI
        result = trainer.run()
    finally:
        trainer.close()
    assert result.step == 2
    assert os.path.isfile(tmp_path / "wd" / "validation.jsonl")

    # a corrupt object is refused by its sha256, like a local shard
    path = os.path.join(mirror, "shard-00001.npz")
    data = bytearray(open(path, "rb").read())
    data[-30] ^= 1
    open(path, "wb").write(bytes(data))
    with pytest.raises(ValueError, match="gs://bucket/corpus/shard-00001.npz: sha256"):
        Corpus(URI)[4]
    _no_local_gs_folder(tmp_path, cwd)
    assert not os.path.exists("gs:")


def test_evaluation_output_on_gs_is_refused(tmp_path, monkeypatch):
    from dblast_jax import evaluate as EV
    from dblast_jax.cli import build_parser
    monkeypatch.chdir(tmp_path)
    msg = "evaluation output must be a local or fuse-mounted folder"
    with pytest.raises(ValueError, match=msg):
        EV.run_evaluation(None, {}, out_dir="gs://bucket/eval")
    with pytest.raises(ValueError, match=msg):
        EV.write_tables([], "gs://bucket/eval")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--drafter", "a=x", "--out", "gs://bucket/eval"])
    assert not os.path.exists("gs:")
