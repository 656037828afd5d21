"""experiments/flagship/train_on_grown_corpus.sh picks the next leg's corpus from what is
finished and what earlier legs used: run in a scratch copy of the repository layout with a stand-in `dblast` and a
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


def _legs(repo, datas):
    keep = repo / "experiments" / "flagship" / "k1"
    keep.mkdir(parents=True, exist_ok=True)
    rows = [{"leg": i + 1, **({"data": d} if d else {})} for i, d in enumerate(datas)]
    (keep / "legs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_an_unfinished_greedy_corpus_is_refused_with_what_to_run(tmp_path):
    _corpus(tmp_path / "corpora" / "smollm2_t0", range(7))
    done, calls = _run(tmp_path)
    assert done.returncode == 1 and calls == []
    assert "7 of 68" in done.stderr and "regenerate_greedy_corpus.sh" in done.stderr


# legs 1-3 of the flagship as recorded: the default corpus twice, then the original
# sampled pass merged with the greedy one
_LEGS_1_3 = [None, None, "runs/corpora/smollm2_t1_t0"]


@pytest.mark.parametrize("more, legs, sampled, data", [
    # nothing grown: pass 0 is all there is
    (0, _LEGS_1_3, "corpora/smollm2_t1:0:68", "runs/corpora/smollm2_t0_t1pass0"),
    (67, _LEGS_1_3, "corpora/smollm2_t1:0:68", "runs/corpora/smollm2_t0_t1pass0"),
    # the first grown pass has never been used
    (111, _LEGS_1_3, "corpora/smollm2_t1_more:0:68", "runs/corpora/smollm2_t0_t1pass1"),
    # once used, a newer unused pass comes next; with none, the least used of the rest
    (150, _LEGS_1_3 + ["runs/corpora/smollm2_t0_t1pass1"],
     "corpora/smollm2_t1_more:68:136", "runs/corpora/smollm2_t0_t1pass2"),
    (111, _LEGS_1_3 + ["runs/corpora/smollm2_t0_t1pass1"],
     "corpora/smollm2_t1_more:0:68", "runs/corpora/smollm2_t0_t1pass1"),
    (111, _LEGS_1_3 + ["runs/corpora/smollm2_t0_t1pass1"] * 4,
     "corpora/smollm2_t1:0:68", "runs/corpora/smollm2_t0_t1pass0"),
    # a leg on every pass merged used each of them; passes beyond the third are ignored
    (300, ["runs/corpora/smollm2_t1_t0_more2"], "corpora/smollm2_t1_more:136:204",
     "runs/corpora/smollm2_t0_t1pass3"),
    # no legs yet: the newest complete pass
    (150, [], "corpora/smollm2_t1_more:68:136", "runs/corpora/smollm2_t0_t1pass2"),
])
def test_each_leg_takes_the_greedy_corpus_and_the_least_used_sampled_pass(
        tmp_path, more, legs, sampled, data):
    """A leg's corpus stays one day's cache: greedy + the pass the drafter saw least."""
    _corpus(tmp_path / "corpora" / "smollm2_t0", range(72))
    if more:
        _corpus(tmp_path / "corpora" / "smollm2_t1_more", range(more))
    _legs(tmp_path, legs)
    done, calls = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    merge, train = calls
    assert merge.split() == ["dblast", "data", "merge", "--out", data,
                             "corpora/smollm2_t0:0:68", sampled,
                             "--exclude-prompts-of", "corpora/smollm2_t1:68:72"]
    assert train.startswith(f"train DATA={data} STEPS=8000 SEQ_LEN=384 SHARDS=0 ")
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
