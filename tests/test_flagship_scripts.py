"""experiments/flagship/train_on_grown_corpus.sh picks the next leg's corpus from what is
finished: run in a scratch copy of the repository layout with a stand-in `dblast` and a
stand-in train_k1.sh that record what they were given."""

import json
import os
import shlex
import shutil
import stat
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "experiments", "flagship", "train_on_grown_corpus.sh")


def _corpus(folder, finished):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump({"shards": [{"index": i} for i in finished]}, f)


def _run(repo):
    flagship = repo / "experiments" / "flagship"
    flagship.mkdir(parents=True, exist_ok=True)
    shutil.copy(SCRIPT, flagship)
    log = repo / "calls.txt"
    (flagship / "train_k1.sh").write_text(
        f'printf "train DATA=%s STEPS=%s SEQ_LEN=%s SHARDS=%s %s\\n" "${{DATA-}}" '
        f'"${{STEPS-}}" "${{SEQ_LEN-}}" "${{DATA_SHARDS-}}" "$*" >> {shlex.quote(str(log))}\n')
    bin_dir = repo / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "dblast").write_text(f'#!/bin/sh\necho "dblast $*" >> {shlex.quote(str(log))}\n')
    (bin_dir / "dblast").chmod(0o755 | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    for k in ("DATA", "STEPS", "SEQ_LEN", "DATA_SHARDS"):
        env.pop(k, None)
    done = subprocess.run(["bash", str(flagship / "train_on_grown_corpus.sh")], env=env,
                          capture_output=True, text=True)
    calls = log.read_text().splitlines() if log.exists() else []
    return done, calls


def test_nothing_grown_yet_is_refused_with_what_to_run(tmp_path):
    _corpus(tmp_path / "corpora" / "smollm2_t0", range(7))
    done, calls = _run(tmp_path)
    assert done.returncode == 1 and calls == []
    assert "7 of 68" in done.stderr and "regenerate_greedy_corpus.sh" in done.stderr


@pytest.mark.parametrize("more, data, extra, steps", [
    (0, "runs/corpora/smollm2_t1_t0", [], 8000),
    (67, "runs/corpora/smollm2_t1_t0", [], 8000),
    (100, "runs/corpora/smollm2_t1_t0_more1", ["corpora/smollm2_t1_more:0:68"], 8000),
    (150, "runs/corpora/smollm2_t1_t0_more2", ["corpora/smollm2_t1_more:0:136"], 8000),
    (300, "runs/corpora/smollm2_t1_t0_more3", ["corpora/smollm2_t1_more:0:204"], 20000),
])
def test_the_committed_greedy_corpus_then_complete_sampled_passes(tmp_path, more, data, extra,
                                                                  steps):
    """Short legs while sampled passes are still coming, the long one on all three."""
    _corpus(tmp_path / "corpora" / "smollm2_t0", range(72))
    if more:
        _corpus(tmp_path / "corpora" / "smollm2_t1_more", range(more))
    done, calls = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    merge, train = calls
    assert merge.split() == ["dblast", "data", "merge", "--out", data,
                             "corpora/smollm2_t1:0:68", "corpora/smollm2_t0:0:68", *extra,
                             "--exclude-prompts-of", "corpora/smollm2_t1:68:72"]
    assert train.startswith(f"train DATA={data} STEPS={steps} SEQ_LEN=384 SHARDS=0 ")
    assert "--extra_validation=greedy=corpora/smollm2_t0_heldout:0:4" in train


def test_a_started_leg_resumes_on_its_own_corpus_without_merging(tmp_path):
    _corpus(tmp_path / "corpora" / "smollm2_t0", range(72))
    leg = tmp_path / "runs" / "flagship" / "k1_leg1"
    leg.mkdir(parents=True)
    (leg / "leg.json").write_text(json.dumps({"data": "runs/corpora/smollm2_t1_x2"}))
    done, calls = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "resuming leg 1 on runs/corpora/smollm2_t1_x2" in done.stdout
    assert len(calls) == 1 and calls[0].startswith("train DATA= ")
