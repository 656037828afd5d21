"""experiments/flagship/train_on_grown_corpus.sh picks the next leg's corpus from what is
finished and what earlier legs used: run in a scratch copy of the repository layout with a stand-in `dblast` and a
stand-in train_k1.sh that record what they were given."""

import functools
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "experiments", "flagship", "train_on_grown_corpus.sh")
TRAIN = os.path.join(ROOT, "experiments", "flagship", "train_k1.sh")
CHAIN = os.path.join(ROOT, "experiments", "flagship", "chain.sh")


def _corpus(folder, finished):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump({"shards": [{"index": i} for i in finished]}, f)


def _run_with_stand_ins(script, bin_dir, log, env_vars):
    """Run a flagship script with the stand-ins of bin_dir first on PATH and no leg
    settings inherited; (the finished process, the calls the stand-ins recorded)."""
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    for k in ("DATA", "STEPS", "SEQ_LEN", "DATA_SHARDS", "LAYERS", "K", "LR", "CHAIN_STEPS",
              "USE_PASS"):
        env.pop(k, None)
    env.update(env_vars)
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    return done, (log.read_text().splitlines() if log.exists() else [])


def _run(repo, **env_vars):
    flagship = repo / "experiments" / "flagship"
    flagship.mkdir(parents=True, exist_ok=True)
    shutil.copy(SCRIPT, flagship)
    shutil.copy(CHAIN, flagship)
    log = repo / "calls.txt"
    (flagship / "train_k1.sh").write_text(
        f'printf "train DATA=%s STEPS=%s SEQ_LEN=%s SHARDS=%s LAYERS=%s %s\\n" "${{DATA-}}" '
        f'"${{STEPS-}}" "${{SEQ_LEN-}}" "${{DATA_SHARDS-}}" "${{LAYERS-}}" "$*" '
        f'>> {shlex.quote(str(log))}\n')
    bin_dir = repo / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "dblast").write_text(f'#!/bin/sh\necho "dblast $*" >> {shlex.quote(str(log))}\n')
    (bin_dir / "dblast").chmod(0o755 | stat.S_IEXEC)
    return _run_with_stand_ins(flagship / "train_on_grown_corpus.sh", bin_dir, log,
                               env_vars)


def _legs(repo, datas, chain="k1"):
    keep = repo / "experiments" / "flagship" / chain
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
    assert train.startswith(f"train DATA={data} STEPS=8000 SEQ_LEN=384 SHARDS=0 LAYERS=1 ")
    assert "--extra_validation=greedy=corpora/smollm2_t0_heldout:0:4" in train


_LEGS_1_7 = _LEGS_1_3 + [f"runs/corpora/smollm2_t0_t1pass{p}" for p in (1, 1, 2, 3)]


@pytest.mark.parametrize("seed2, legs, sampled, data", [
    # a second sampling seed's folder adds passes 4-6 as its 68-shard passes finish
    # (passes 2 and 3 once each: pass 2, used longer ago)
    (67, _LEGS_1_7, "corpora/smollm2_t1_more:68:136", "runs/corpora/smollm2_t0_t1pass2"),
    (68, _LEGS_1_7, "corpora/smollm2_t1_more_seed2:0:68", "runs/corpora/smollm2_t0_t1pass4"),
    (204, _LEGS_1_7, "corpora/smollm2_t1_more_seed2:136:204",
     "runs/corpora/smollm2_t0_t1pass6"),
    (204, _LEGS_1_7 + ["runs/corpora/smollm2_t0_t1pass6"],
     "corpora/smollm2_t1_more_seed2:68:136", "runs/corpora/smollm2_t0_t1pass5"),
    # passes 2-4 once each: the one used longest ago, not the newest (just trained on)
    (68, _LEGS_1_7 + ["runs/corpora/smollm2_t0_t1pass4"],
     "corpora/smollm2_t1_more:68:136", "runs/corpora/smollm2_t0_t1pass2"),
    (68, _LEGS_1_7 + ["runs/corpora/smollm2_t0_t1pass4", "runs/corpora/smollm2_t0_t1pass2"],
     "corpora/smollm2_t1_more:136:204", "runs/corpora/smollm2_t0_t1pass3"),
])
def test_a_second_sampling_seed_adds_passes_four_to_six(tmp_path, seed2, legs, sampled, data):
    _corpus(tmp_path / "corpora" / "smollm2_t0", range(72))
    _corpus(tmp_path / "corpora" / "smollm2_t1_more", range(204))
    _corpus(tmp_path / "corpora" / "smollm2_t1_more_seed2", range(seed2))
    _legs(tmp_path, legs)
    done, calls = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert calls[0].split()[5:7] == ["corpora/smollm2_t0:0:68", sampled]
    assert calls[0].split()[4] == data


_LEGS_1_10 = _LEGS_1_7 + [f"runs/corpora/smollm2_t0_t1pass{p}" for p in (4, 2, 3)]


@pytest.mark.parametrize("self_r0, legs, use, sampled, data", [
    # an unfinished self-prompt round is not a pass yet
    (67, _LEGS_1_10, None, "corpora/smollm2_t1_more_seed2:68:136",
     "runs/corpora/smollm2_t0_t1pass5"),
    # never used, and newer than every sampled pass: it comes first
    (68, _LEGS_1_10, None, "corpora/smollm2_self_t1_r0:0:68",
     "runs/corpora/smollm2_t0_t1passs0"),
    # once used, the unused sampled pass 5 comes next
    (68, _LEGS_1_10 + ["runs/corpora/smollm2_t0_t1passs0"], None,
     "corpora/smollm2_t1_more_seed2:68:136", "runs/corpora/smollm2_t0_t1pass5"),
    # picked by hand
    (68, _LEGS_1_10, "5", "corpora/smollm2_t1_more_seed2:68:136",
     "runs/corpora/smollm2_t0_t1pass5"),
    (68, _LEGS_1_10, "2", "corpora/smollm2_t1_more:68:136", "runs/corpora/smollm2_t0_t1pass2"),
])
def test_self_prompt_passes_join_the_rotation(tmp_path, self_r0, legs, use, sampled, data):
    _corpus(tmp_path / "corpora" / "smollm2_t0", range(72))
    _corpus(tmp_path / "corpora" / "smollm2_t1_more", range(204))
    _corpus(tmp_path / "corpora" / "smollm2_t1_more_seed2", range(136))
    _corpus(tmp_path / "corpora" / "smollm2_self_t1_r0", range(self_r0))
    _legs(tmp_path, legs)
    done, calls = _run(tmp_path, **({"USE_PASS": use} if use else {}))
    assert done.returncode == 0, done.stderr
    assert calls[0].split()[4:7] == [data, "corpora/smollm2_t0:0:68", sampled]


@pytest.mark.parametrize("legs, use, sources, data", [
    # several passes by hand, in the order given
    (_LEGS_1_10, "4,5", ["corpora/smollm2_t1_more_seed2:0:68",
                         "corpora/smollm2_t1_more_seed2:68:136"],
     "runs/corpora/smollm2_t0_t1pass4_5"),
    (_LEGS_1_10, "s0,0", ["corpora/smollm2_self_t1_r0:0:68", "corpora/smollm2_t1:0:68"],
     "runs/corpora/smollm2_t0_t1passs0_0"),
    # every complete pass: sampled 0-5, then the self-prompt round
    (_LEGS_1_10, "all", ["corpora/smollm2_t1:0:68", "corpora/smollm2_t1_more:0:68",
                         "corpora/smollm2_t1_more:68:136", "corpora/smollm2_t1_more:136:204",
                         "corpora/smollm2_t1_more_seed2:0:68",
                         "corpora/smollm2_t1_more_seed2:68:136",
                         "corpora/smollm2_self_t1_r0:0:68"],
     "runs/corpora/smollm2_t0_t1pass0_1_2_3_4_5_s0"),
    # a leg on several passes counts for each: after 4+5 and s0, pass 5 and s0 are used
    # once like 4, and the passes of legs 1-10 more
    (_LEGS_1_10 + ["runs/corpora/smollm2_t0_t1pass4_5", "runs/corpora/smollm2_t0_t1passs0"],
     None, ["corpora/smollm2_t1_more_seed2:68:136"], "runs/corpora/smollm2_t0_t1pass5"),
])
def test_a_leg_may_take_several_passes(tmp_path, legs, use, sources, data):
    _corpus(tmp_path / "corpora" / "smollm2_t0", range(72))
    _corpus(tmp_path / "corpora" / "smollm2_t1_more", range(204))
    _corpus(tmp_path / "corpora" / "smollm2_t1_more_seed2", range(136))
    _corpus(tmp_path / "corpora" / "smollm2_self_t1_r0", range(68))
    _legs(tmp_path, legs)
    done, calls = _run(tmp_path, **({"USE_PASS": use} if use else {}))
    assert done.returncode == 0, done.stderr
    assert calls[0].split()[4:] == [data, "corpora/smollm2_t0:0:68", *sources,
                                    "--exclude-prompts-of", "corpora/smollm2_t1:68:72"]


@pytest.mark.parametrize("use, message", [
    ("4,9", "USE_PASS=4,9: 9 not a complete pass; complete: 0 1 2 3 4"),
    ("4,4", "USE_PASS=4,4: a pass named twice")])
def test_passes_picked_by_hand_are_checked(tmp_path, use, message):
    _corpus(tmp_path / "corpora" / "smollm2_t0", range(72))
    _corpus(tmp_path / "corpora" / "smollm2_t1_more", range(204))
    _corpus(tmp_path / "corpora" / "smollm2_t1_more_seed2", range(68))
    done, calls = _run(tmp_path, USE_PASS=use)
    assert done.returncode != 0 and calls == []
    assert message in done.stderr


def test_a_pass_picked_by_hand_must_be_complete(tmp_path):
    _corpus(tmp_path / "corpora" / "smollm2_t0", range(72))
    _corpus(tmp_path / "corpora" / "smollm2_self_t1_r0", range(67))
    done, calls = _run(tmp_path, USE_PASS="s0")
    assert done.returncode != 0 and calls == []
    assert "USE_PASS=s0: s0 not a complete pass; complete: 0" in done.stderr


def test_a_started_leg_resumes_on_its_own_corpus_without_merging(tmp_path):
    _corpus(tmp_path / "corpora" / "smollm2_t0", range(72))
    leg = tmp_path / "runs" / "flagship" / "k1_leg1"
    leg.mkdir(parents=True)
    (leg / "leg.json").write_text(json.dumps({"data": "runs/corpora/smollm2_t1_x2"}))
    done, calls = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "resuming leg 1 of experiments/flagship/k1 on runs/corpora/smollm2_t1_x2" in done.stdout
    assert len(calls) == 1 and calls[0].startswith("train DATA= ")


def test_the_depth_chain_is_its_own_chain_and_pairs_with_the_one_layer_leg(tmp_path):
    """LAYERS=2 is its own chain: its first leg takes the pass the next 1-layer leg takes
    (the one-layer legs' least used, then the one used longest ago), so the two are paired
    on the same answers; later legs count its own legs (and the 1-layer legs its first leg
    recorded: none here)."""
    _corpus(tmp_path / "corpora" / "smollm2_t0", range(72))
    _corpus(tmp_path / "corpora" / "smollm2_t1_more", range(136))
    _legs(tmp_path, _LEGS_1_3 + ["runs/corpora/smollm2_t0_t1pass1",
                                 "runs/corpora/smollm2_t0_t1pass2"])
    done, calls = _run(tmp_path)
    assert "runs/corpora/smollm2_t0_t1pass1" in calls[0].split()  # the next 1-layer leg's
    (tmp_path / "calls.txt").unlink()
    done, calls = _run(tmp_path, LAYERS="2")
    assert done.returncode == 0, done.stderr
    assert "leg 1 of experiments/flagship/k1_depth2" in done.stdout
    merge, train = calls
    assert "runs/corpora/smollm2_t0_t1pass1" in merge.split()
    assert " LAYERS=2 " in train
    # its second leg: pass 2 used once by it, pass 1 never: pass 1
    _legs(tmp_path, ["runs/corpora/smollm2_t0_t1pass2"], chain="k1_depth2")
    (tmp_path / "calls.txt").unlink()
    done, calls = _run(tmp_path, LAYERS="2")
    assert "leg 2 of experiments/flagship/k1_depth2" in done.stdout
    assert "runs/corpora/smollm2_t0_t1pass1" in calls[0].split()


def test_a_grown_chain_counts_the_one_layer_legs_its_weights_hold(tmp_path):
    """The depth chain's second leg as it happened: it grew from 1-layer legs 1-5 (pass 0
    three times, pass 1 twice) and trained leg 1 on pass 2. Its own legs alone would send
    it to pass 1, which its weights had seen twice (it lost 3.3% there); counting the
    five trunk legs it holds, pass 2 is the least used. The 1-layer legs after its branch
    point are not in its weights and do not count."""
    _corpus(tmp_path / "corpora" / "smollm2_t0", range(72))
    _corpus(tmp_path / "corpora" / "smollm2_t1_more", range(136))
    one_layer = _LEGS_1_3 + ["runs/corpora/smollm2_t0_t1pass1"] * 2
    _legs(tmp_path, one_layer + ["runs/corpora/smollm2_t0_t1pass2"] * 3)
    keep = tmp_path / "experiments" / "flagship" / "k1_depth2"
    keep.mkdir(parents=True)
    (keep / "legs.jsonl").write_text(json.dumps(
        {"leg": 1, "data": "runs/corpora/smollm2_t0_t1pass2", "trunk_legs": 5}) + "\n")
    done, calls = _run(tmp_path, LAYERS="2")
    assert done.returncode == 0, done.stderr
    assert "leg 2 of experiments/flagship/k1_depth2" in done.stdout
    assert "runs/corpora/smollm2_t0_t1pass2" in calls[0].split()
    # before its first leg, every finished 1-layer leg is in the weights it starts from
    _legs(tmp_path, [f"runs/corpora/smollm2_t0_t1pass{p}" for p in (0, 1, 2, 2)])
    (tmp_path / "calls.txt").unlink()
    done, calls = _run(tmp_path, K="4")
    assert "leg 1 of experiments/flagship/k4" in done.stdout
    assert "runs/corpora/smollm2_t0_t1pass0" in calls[0].split()  # once, longest ago


def test_an_unknown_depth_is_refused(tmp_path):
    _corpus(tmp_path / "corpora" / "smollm2_t0", range(72))
    done, calls = _run(tmp_path, LAYERS="two")
    assert done.returncode == 2 and calls == []
    assert "LAYERS must be a drafter depth" in done.stderr


def test_an_unknown_mixture_size_is_refused(tmp_path):
    _corpus(tmp_path / "corpora" / "smollm2_t0", range(72))
    done, calls = _run(tmp_path, K="3")
    assert done.returncode == 2 and calls == []
    assert "K must be the mixture's size: 1, 2, 4 or 8, not '3'" in done.stderr


def test_the_mixture_chain_pairs_with_the_one_layer_leg_on_the_newest_pass(tmp_path):
    """K=4 is its own chain (experiments/flagship/k4): its first leg takes the pass the
    next K = 1 leg takes (here the newest, never used), like the depth run."""
    _corpus(tmp_path / "corpora" / "smollm2_t0", range(72))
    _corpus(tmp_path / "corpora" / "smollm2_t1_more", range(204))
    _legs(tmp_path, _LEGS_1_3 + ["runs/corpora/smollm2_t0_t1pass1",
                                 "runs/corpora/smollm2_t0_t1pass2"])
    done, calls = _run(tmp_path, K="4", STEPS="3000")
    assert done.returncode == 0, done.stderr
    assert "leg 1 of experiments/flagship/k4:" in done.stdout
    merge, train = calls
    assert "runs/corpora/smollm2_t0_t1pass3" in merge.split()
    assert train.startswith("train DATA=runs/corpora/smollm2_t0_t1pass3 STEPS=3000 ")


def _run_train(repo, **env_vars):
    """train_k1.sh with a stand-in `python` that runs `python -c` for real and records
    the trainer and finish_leg calls."""
    flagship = repo / "experiments" / "flagship"
    flagship.mkdir(parents=True, exist_ok=True)
    shutil.copy(TRAIN, flagship)
    shutil.copy(CHAIN, flagship)
    log = repo / "calls.txt"
    bin_dir = repo / "bin"
    bin_dir.mkdir(exist_ok=True)
    real = shlex.quote(shutil.which("python") or "python3")
    (bin_dir / "python").write_text(
        f'#!/bin/sh\nif [ "$1" = -c ]; then exec {real} "$@"; fi\n'
        f'echo "python $*" >> {shlex.quote(str(log))}\n')
    (bin_dir / "python").chmod(0o755)
    return _run_with_stand_ins(flagship / "train_k1.sh", bin_dir, log, env_vars)


def _drafter(folder, tag):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"tag": tag}))


def test_the_first_depth_leg_grows_a_pinned_copy_of_the_one_layer_export(tmp_path):
    _drafter(tmp_path / "experiments" / "flagship" / "k1" / "drafter", "leg5")
    (tmp_path / "experiments" / "flagship" / "k1" / "legs.jsonl").write_text(
        "".join(json.dumps({"leg": i, "training_cpu_s": 1000.0, "steps": 1500 * i}) + "\n"
                for i in (1, 2)))
    done, calls = _run_train(tmp_path, LAYERS="2", STEPS="4000", DATA="runs/corpora/x",
                             DATA_SHARDS="0", SEQ_LEN="384")
    assert done.returncode == 0, done.stderr
    work = tmp_path / "runs" / "flagship" / "k1_depth2_leg1"
    leg = json.loads((work / "leg.json").read_text())
    assert leg == {"leg": 1, "init": "experiments/flagship/k1/drafter",
                   "init_copy": "runs/flagship/k1_depth2_leg1/init", "steps": 4000,
                   "data": "runs/corpora/x", "data_shards": 0, "seq_len": 384,
                   "drafter_layers": 2, "k": 1, "prior_cpu_s": 4100, "trunk_legs": 2,
                   # the chain's one cosine, at the shipped 2,000 + the trunk's 4,500 steps
                   "schedule_steps": 50000, "schedule_offset": 6500,
                   "learning_rate": 0.0005}
    assert json.loads((work / "init" / "config.json").read_text()) == {"tag": "leg5"}
    train, finish = calls
    assert "--override=drafter_layers=2" in train.split()
    assert "--experiment=smollm2_k1_al" in train.split()
    assert "--override=drafter_init=drafter:runs/flagship/k1_depth2_leg1/init" in train.split()
    assert "--workdir=runs/flagship/k1_depth2_leg1" in train.split()
    assert {"--override=schedule_steps=50000", "--override=schedule_offset=6500"} <= set(
        train.split())
    assert "--keep=experiments/flagship/k1_depth2" in finish.split()
    # the 1-layer chain finishes a leg meanwhile; the resumed depth leg keeps its copy
    _drafter(tmp_path / "experiments" / "flagship" / "k1" / "drafter", "leg6")
    done, calls = _run_train(tmp_path, LAYERS="2", STEPS="9")
    assert json.loads((work / "init" / "config.json").read_text()) == {"tag": "leg5"}
    assert "--max_steps=4000" in calls[-2].split()
    # the chain's second leg carries the first leg's base, not the shipped drafter's
    (tmp_path / "experiments" / "flagship" / "k1_depth2" / "legs.jsonl").write_text(
        json.dumps({"leg": 1, "prior_cpu_s": 4100, "trunk_legs": 2, "steps": 4000}) + "\n")
    _drafter(tmp_path / "experiments" / "flagship" / "k1_depth2" / "drafter", "depth1")
    done, calls = _run_train(tmp_path, LAYERS="2", STEPS="9")
    assert done.returncode == 0, done.stderr
    leg2 = json.loads((tmp_path / "runs" / "flagship" / "k1_depth2_leg2" / "leg.json")
                      .read_text())
    assert leg2["prior_cpu_s"] == 4100 and leg2["init"] == "experiments/flagship/k1_depth2/drafter"
    assert leg2["trunk_legs"] == 2
    # ... and goes on along the cosine: the trunk's legs it holds + its own leg 1
    assert leg2["schedule_offset"] == 2000 + 4500 + 4000


def test_the_first_mixture_leg_starts_from_the_one_layer_export_with_the_dblast_recipe(
        tmp_path):
    _drafter(tmp_path / "experiments" / "flagship" / "k1" / "drafter", "leg6")
    (tmp_path / "experiments" / "flagship" / "k1" / "legs.jsonl").write_text(
        "".join(json.dumps({"leg": i, "training_cpu_s": 1000.0, "steps": 3000}) + "\n"
                for i in (1, 2, 3)))
    done, calls = _run_train(tmp_path, K="4", STEPS="3000", DATA="runs/corpora/p3",
                             DATA_SHARDS="0", SEQ_LEN="384")
    assert done.returncode == 0, done.stderr
    work = tmp_path / "runs" / "flagship" / "k4_leg1"
    leg = json.loads((work / "leg.json").read_text())
    assert leg["init"] == "experiments/flagship/k1/drafter" and leg["k"] == 4
    assert leg["drafter_layers"] == 1 and leg["prior_cpu_s"] == 5100
    assert json.loads((work / "init" / "config.json").read_text()) == {"tag": "leg6"}
    train, finish = calls
    assert "--experiment=smollm2_dblast_k4_al" in train.split()
    assert "--override=drafter_init=drafter:runs/flagship/k4_leg1/init" in train.split()
    assert "--override=drafter_layers=1" in train.split()
    assert "--keep=experiments/flagship/k4" in finish.split()
    assert "--reference=experiments/flagship/k1" in finish.split()
    # its second leg continues its own export
    (tmp_path / "experiments" / "flagship" / "k4" / "legs.jsonl").write_text(
        json.dumps({"leg": 1, "prior_cpu_s": 5100, "trunk_legs": 3, "steps": 1000}) + "\n")
    _drafter(tmp_path / "experiments" / "flagship" / "k4" / "drafter", "k4leg1")
    done, calls = _run_train(tmp_path, K="4", STEPS="9")
    leg2 = json.loads((tmp_path / "runs" / "flagship" / "k4_leg2" / "leg.json").read_text())
    assert leg2["init"] == "experiments/flagship/k4/drafter" and leg2["prior_cpu_s"] == 5100
    assert leg2["schedule_offset"] == 2000 + 9000 + 1000


def test_the_one_layer_chain_keeps_its_names_and_starts_from_its_own_export(tmp_path):
    _drafter(tmp_path / "experiments" / "flagship" / "k1" / "drafter", "leg5")
    (tmp_path / "experiments" / "flagship" / "k1" / "legs.jsonl").write_text(
        "".join(json.dumps({"leg": i, "steps": 1000}) + "\n" for i in range(1, 6)))
    done, calls = _run_train(tmp_path)
    assert done.returncode == 0, done.stderr
    leg = json.loads((tmp_path / "runs" / "flagship" / "k1_leg6" / "leg.json").read_text())
    assert leg["init"] == "experiments/flagship/k1/drafter" and leg["drafter_layers"] == 1
    assert leg["prior_cpu_s"] == 2100 and leg["k"] == 1
    assert (leg["schedule_steps"], leg["schedule_offset"]) == (50000, 7000)
    train, finish = calls
    assert "--override=drafter_layers=1" in train.split()
    assert "--experiment=smollm2_k1_al" in train.split()
    assert "--keep=experiments/flagship/k1" in finish.split()
    assert not any(a.startswith("--reference") for a in finish.split())


def test_a_leg_started_before_the_chain_schedule_resumes_on_its_own_restart(tmp_path):
    """A leg.json without the schedule fields (written before them) keeps the warm restart
    it began with: a resumed leg never changes its learning rate mid-way."""
    _drafter(tmp_path / "experiments" / "flagship" / "k1" / "drafter", "leg7")
    work = tmp_path / "runs" / "flagship" / "k1_leg1"
    work.mkdir(parents=True)
    (work / "leg.json").write_text(json.dumps({"leg": 1, "init": "x", "steps": 3000}))
    done, calls = _run_train(tmp_path)
    assert done.returncode == 0, done.stderr
    assert {"--override=schedule_steps=0", "--override=schedule_offset=0",
            "--max_steps=3000"} <= set(calls[0].split())


def test_a_leg_keeps_the_peak_rate_it_began_with(tmp_path):
    _drafter(tmp_path / "experiments" / "flagship" / "k1" / "drafter", "leg8")
    done, calls = _run_train(tmp_path, LR="1e-3")
    assert done.returncode == 0, done.stderr
    work = tmp_path / "runs" / "flagship" / "k1_leg1"
    assert json.loads((work / "leg.json").read_text())["learning_rate"] == 0.001
    assert "--override=learning_rate=0.001" in calls[0].split()
    # resumed without LR (the usual command) or with the same rate: the leg's own rate
    for same in ({}, {"LR": "0.001"}):
        done, calls = _run_train(tmp_path, **same)
        assert done.returncode == 0, done.stderr
        assert "--override=learning_rate=0.001" in calls[-2].split()
    # ... another rate would change the schedule mid-leg: refused, nothing runs
    before = len(calls)
    done, calls = _run_train(tmp_path, LR="5e-4")
    assert done.returncode == 1 and "began with LR=0.001" in done.stderr
    assert len(calls) == before
    # a rate that is not a positive number is refused before anything is written
    done, calls = _run_train(tmp_path / "other", LR="fast")
    assert done.returncode == 1 and "LR=fast is not a positive learning rate" in done.stderr
    assert not (tmp_path / "other" / "runs" / "flagship" / "k1_leg1").exists()


def test_a_leg_past_the_chain_schedule_is_refused_with_nothing_written(tmp_path):
    _drafter(tmp_path / "experiments" / "flagship" / "k1" / "drafter", "leg7")
    (tmp_path / "experiments" / "flagship" / "k1" / "legs.jsonl").write_text(
        json.dumps({"leg": 1, "steps": 47000}) + "\n")
    done, calls = _run_train(tmp_path, STEPS="3000")
    assert done.returncode == 1 and calls == []
    assert "steps 49000 .. 52000" in done.stderr and "CHAIN_STEPS=50000" in done.stderr
    assert not (tmp_path / "runs" / "flagship" / "k1_leg2").exists()
    done, calls = _run_train(tmp_path, STEPS="3000", CHAIN_STEPS="80000")
    assert done.returncode == 0, done.stderr
    assert "--override=schedule_steps=80000" in calls[0].split()


def test_a_corrupt_legs_file_is_named_with_its_line_and_nothing_starts(tmp_path):
    _drafter(tmp_path / "experiments" / "flagship" / "k1" / "drafter", "leg7")
    _drafter(tmp_path / "experiments" / "flagship" / "k4" / "drafter", "k4leg1")
    (tmp_path / "experiments" / "flagship" / "k4" / "legs.jsonl").write_text(
        json.dumps({"leg": 1, "prior_cpu_s": 5100, "steps": 1000}) + "\n{\"leg\": 2, \"st\n")
    done, calls = _run_train(tmp_path, K="4")
    assert done.returncode == 1 and calls == []
    assert "experiments/flagship/k4/legs.jsonl line 2 is not a JSON row" in done.stderr
    assert "git checkout" in done.stderr
    assert not (tmp_path / "runs" / "flagship" / "k4_leg3").exists()


@functools.lru_cache(maxsize=None)
def _finish_leg_module():
    """finish_leg.py loaded once per test process (its absl flags can be defined once)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "finish_leg", os.path.join(ROOT, "experiments", "flagship", "finish_leg.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _chain(keep, legs):
    """A committed chain folder: legs [(leg row, [(step, cpu_s, al), ...])]."""
    keep.mkdir(parents=True, exist_ok=True)
    (keep / "legs.jsonl").write_text("".join(json.dumps(row) + "\n" for row, _ in legs))
    for row, points in legs:
        (keep / f"curve_leg{row['leg']}.jsonl").write_text("".join(
            json.dumps({"step": s, "cpu_s": c, "al_estimate": a}) + "\n"
            for s, c, a in points))


def test_the_depth_run_shares_the_one_layer_runs_cpu_axis(tmp_path):
    """The depth chain's curve starts where the 1-layer legs it grew from ended, and its
    learning curve draws the 1-layer run beside it."""
    finish_leg = _finish_leg_module()
    one, two = tmp_path / "k1", tmp_path / "k1_depth2"
    _chain(one, [({"leg": 1, "steps": 10, "training_cpu_s": 1800.0},
                  [(0, 0.0, 0.30), (10, 1800.0, 0.40)]),
                 ({"leg": 2, "steps": 10, "training_cpu_s": 3600.0},
                  [(0, 0.0, 0.40), (10, 3600.0, 0.45)])])
    _chain(two, [({"leg": 1, "steps": 10, "training_cpu_s": 3600.0, "drafter_layers": 2,
                   "prior_cpu_s": 2100 + 1800 + 3600},
                  [(0, 0.0, 0.45), (10, 3600.0, 0.50)])])
    ref = finish_leg.chain_points(str(one), 2100.0)
    assert [x for _, x, _ in ref] == [[2100 / 3600, 3900 / 3600], [3900 / 3600, 7500 / 3600]]
    (_, x, y), = finish_leg.chain_points(str(two), 2100.0)
    assert x == [7500 / 3600, 11100 / 3600] and y == [0.45, 0.50]
    done = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "flagship",
                                                        "finish_leg.py"),
                           f"--keep={two}", "--plot_only", f"--reference={one}"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (two / "learning_curve.png").stat().st_size > 1000


def test_the_mixture_chain_is_drawn_by_the_mixtures_acceptance(tmp_path):
    """A K > 1 leg's curve points carry both the branch's and the mixture's acceptance; the
    chain is drawn (and compared with the K = 1 run) by the mixture's, DBlast's verifier."""
    finish_leg = _finish_leg_module()
    keep = tmp_path / "k4"
    keep.mkdir()
    (keep / "legs.jsonl").write_text(json.dumps({"leg": 1, "steps": 10, "k": 4,
                                                 "training_cpu_s": 100.0}) + "\n")
    (keep / "curve_leg1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 0, "cpu_s": 0.0, "al_estimate": 0.40, "al_estimate_mixture": 0.42},
        {"step": 10, "cpu_s": 100.0, "al_estimate": 0.41, "al_estimate_mixture": 0.45}]))
    (_, _, y), = finish_leg.chain_points(str(keep), 0.0)
    assert y == [0.42, 0.45]
    assert finish_leg.held_out_al({"al_estimate": 0.3}) == 0.3


def test_a_depth_leg_without_a_one_layer_export_is_refused_with_nothing_written(tmp_path):
    done, calls = _run_train(tmp_path, LAYERS="2")
    assert done.returncode == 1 and calls == []
    assert "experiments/flagship/k1/drafter/config.json is missing" in done.stderr
    assert not (tmp_path / "runs" / "flagship" / "k1_depth2_leg1" / "leg.json").exists()


def test_finish_leg_brings_no_other_scripts_flags(tmp_path):
    """finish_leg.py reads curves through experiments/budget/curve_file.py, not budget_curve.py:
    importing the latter defined its absl flags (--out, ...) in the test process, and the next
    script loaded in-process that defines --out (ngram_speed_ceiling.py) failed."""
    import importlib.util

    from absl import flags
    before = set(flags.FLAGS)
    spec = importlib.util.spec_from_file_location(
        "finish_leg_flags", os.path.join(ROOT, "experiments", "flagship", "finish_leg.py"))
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except flags.DuplicateFlagError:
        pass  # finish_leg.py was loaded earlier in this process: its flags are already there
    new = set(flags.FLAGS) - before
    assert not new & {"out", "workdir", "experiment", "validation_shards", "plot"}, new
    assert "budget_curve" not in {getattr(m, "__name__", m) for m in
                                  flags.FLAGS.flags_by_module_dict()}


def _run_eval_export(repo, **env_vars):
    flagship = repo / "experiments" / "flagship"
    flagship.mkdir(parents=True, exist_ok=True)
    shutil.copy(os.path.join(ROOT, "experiments", "flagship", "eval_export.sh"), flagship)
    shutil.copy(CHAIN, flagship)
    log = repo / "calls.txt"
    bin_dir = repo / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "dblast").write_text(f'#!/bin/sh\necho "dblast $*" >> {shlex.quote(str(log))}\n')
    (bin_dir / "dblast").chmod(0o755 | stat.S_IEXEC)
    return _run_with_stand_ins(flagship / "eval_export.sh", bin_dir, log, env_vars)


def test_eval_export_refuses_a_chain_without_an_export(tmp_path):
    done, calls = _run_eval_export(tmp_path, LAYERS="2")
    assert done.returncode == 1 and calls == []
    assert "experiments/flagship/k1_depth2/drafter/config.json" in done.stderr


@pytest.mark.parametrize("layers, keep, label", [("1", "k1", "flagship"),
                                                 ("2", "k1_depth2", "flagship_depth2")])
def test_eval_export_sets_the_chains_export_beside_the_shipped_drafter(tmp_path, layers,
                                                                       keep, label):
    drafter = tmp_path / "experiments" / "flagship" / keep / "drafter"
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text("{}")
    done, calls = _run_eval_export(tmp_path, LAYERS=layers, PROMPTS="3")
    assert done.returncode == 0, done.stderr
    argmax, sampled, blocks = calls
    export = f"experiments/flagship/{keep}/drafter"
    for call, mode, temps, sub in [(argmax, "", "0 0.7", "argmax"),
                                   (sampled, "@mode=sampled-branch", "1.0 1.5", "sampled")]:
        assert f"--drafter shipped=pretrained:smollm2-dflash-k1{mode} " in call
        assert f"--drafter {label}={export}{mode} " in call
        assert f"--drafter {label}+ngram={export}+ngram{mode} " in call
        assert "--drafter ngram=ngram " in call and "--baseline shipped " in call
        assert f"--temperatures {temps} " in call and "--prompts-per-benchmark 3 " in call
        assert call.endswith(f"--out experiments/flagship/{keep}/benchmarks/{sub}")
    # the export at shorter blocks, against itself at its trained block
    assert f"--drafter {label}={export} --blocks 4 3 2 --baseline {label} " in blocks
    assert "--temperatures 0 0.7 " in blocks and blocks.endswith(f"/{keep}/benchmarks/blocks")


def test_shipped_on_benchmarks_runs_both_shipped_drafters_at_every_batch(tmp_path):
    done, calls = _run_growth(tmp_path, "shipped_on_benchmarks.sh",
                              {"BATCHES": "1 8", "PROMPTS": "3"})
    assert done.returncode == 0, done.stderr
    assert len(calls) == 4
    for call, batch, sub, temps, k1_mode, k4_mode in [
            (calls[0], 1, "argmax", "0 0.7", "", "@mode=mixture"),
            (calls[1], 1, "sampled", "1.0 1.5", "@mode=sampled-branch", "@mode=sampled-mixture"),
            (calls[2], 8, "argmax", "0 0.7", "", "@mode=mixture"),
            (calls[3], 8, "sampled", "1.0 1.5", "@mode=sampled-branch",
             "@mode=sampled-mixture")]:
        assert f"--drafter k1=pretrained:smollm2-dflash-k1{k1_mode} " in call
        assert f"--drafter k4=pretrained:smollm2-dblast-k4{k4_mode} " in call
        assert f"--drafter k1+ngram=pretrained:smollm2-dflash-k1+ngram{k1_mode} " in call
        assert "--drafter ngram=ngram " in call and "--baseline k1 " in call
        assert f"--temperatures {temps} " in call and "--prompts-per-benchmark 3 " in call
        assert f"--batch-size {batch} " in call
        assert call.endswith(f"--out experiments/flagship/shipped_on_benchmarks/b{batch}_{sub}")


def _run_growth(tmp_path, script, env_vars):
    """A corpus growth script in a scratch layout, with a stand-in `dblast` that records
    its calls."""
    flagship = tmp_path / "experiments" / "flagship"
    flagship.mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "experiments", "flagship", script), flagship)
    log, bin_dir = tmp_path / "calls.txt", tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dblast").write_text(f'#!/bin/sh\necho "dblast $*" >> {shlex.quote(str(log))}\n')
    (bin_dir / "dblast").chmod(0o755)
    return _run_with_stand_ins(flagship / script, bin_dir, log, env_vars)


@pytest.mark.parametrize("seed, out", [(None, "corpora/smollm2_t1_more"),
                                       ("2", "corpora/smollm2_t1_more_seed2")])
def test_each_sampling_seed_grows_its_own_folder(tmp_path, seed, out):
    done, calls = _run_growth(tmp_path, "grow_sampled_corpus.sh",
                              {"SEED": seed} if seed else {})
    assert done.returncode == 0, done.stderr
    args = calls[0].split()
    assert args[:5] == ["dblast", "data", "regenerate", "--out", out]
    assert args[args.index("--seed") + 1] == (seed or "1")
    assert args[args.index("--prompts-from") + 1] == "corpora/smollm2_t1:0:68"


def test_a_bad_sampling_seed_is_refused(tmp_path):
    done = subprocess.run(["bash", os.path.join(ROOT, "experiments", "flagship",
                                                "grow_sampled_corpus.sh")],
                          env=dict(os.environ, SEED="0"), capture_output=True, text=True)
    assert done.returncode == 2 and "seed 0 made corpora/smollm2_t1" in done.stderr


@pytest.mark.parametrize("round_", [None, "3"])
def test_each_self_prompt_round_writes_its_prompts_then_answers_them(tmp_path, round_):
    done, calls = _run_growth(tmp_path, "grow_self_prompt_corpus.sh",
                              {"ROUND": round_} if round_ else {})
    assert done.returncode == 0, done.stderr
    r = round_ or "0"
    prompts, answers = (c.split() for c in calls)
    assert prompts[:5] == ["dblast", "data", "self-prompts", "--out",
                           f"corpora/smollm2_self_prompts_r{r}"]
    assert prompts[prompts.index("--seed") + 1] == r
    assert prompts[prompts.index("--count") + 1] == "2176"
    assert answers[:5] == ["dblast", "data", "regenerate", "--out",
                           f"corpora/smollm2_self_t1_r{r}"]
    assert answers[answers.index("--prompts-file") + 1] == f"corpora/smollm2_self_prompts_r{r}"
    assert answers[answers.index("--shard-size") + 1] == "32"


def test_a_bad_self_prompt_round_is_refused(tmp_path):
    done = subprocess.run(["bash", os.path.join(ROOT, "experiments", "flagship",
                                                "grow_self_prompt_corpus.sh")],
                          env=dict(os.environ, ROUND="x"), capture_output=True, text=True)
    assert done.returncode == 2 and "ROUND must be 0-9" in done.stderr
