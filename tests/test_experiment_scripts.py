"""The SmolLM2 reproduction / ablation scripts, run with a stand-in `dblast` that records
its arguments: the scripts share settings.sh, so every drafter must train with the same
overrides, and each stage must hand the right folders to the next."""

import os
import shlex
import stat
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "experiments", "smollm2")


def _run(script, tmp_path, **env):
    log = tmp_path / "calls.txt"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    recorder = f'#!/bin/sh\nprintf "%s\\n" "$(basename "$0") $*" >> {shlex.quote(str(log))}\n'
    (bin_dir / "dblast").write_text(recorder)
    # `python -m dblast_jax.train.curves` is recorded; other python calls run for real
    (bin_dir / "python").write_text(
        f'#!/bin/sh\nif [ "$1" = "-m" ]; then printf "%s\\n" "python $*" >> '
        f'{shlex.quote(str(log))}; exit 0; fi\nexec {shlex.quote(sys.executable)} "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    full_env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}",
                    CORPUS=str(tmp_path / "corpus"), RUNS=str(tmp_path / "runs"), **env)
    subprocess.run(["bash", os.path.join(SCRIPTS, script)], check=True, env=full_env,
                   capture_output=True, text=True)
    return [line.split() for line in log.read_text().splitlines()]


def _overrides(call):
    return [call[i + 1] for i, a in enumerate(call) if a == "--override"]


def test_reproduce_trains_four_drafters_alike_then_evaluates_them(tmp_path):
    calls = _run("reproduce.sh", tmp_path, SHARDS="5", VAL_SHARDS="1", STEPS="7")
    regen, *trains, evaluate, curves = calls
    assert regen[:3] == ["dblast", "data", "regenerate"] and regen[-1] == "6"  # 5 + 1 shards
    assert [c[c.index("--experiment") + 1] for c in trains] == [
        "smollm2_dflash_baseline", "smollm2_k1_al", "smollm2_dblast_k4_nll",
        "smollm2_dblast_k4_al"]
    first = _overrides(trains[0])
    assert all(_overrides(c) == first for c in trains)
    assert {"num_steps=7", "data_shards=5", "validation_shards=5:6",
            "validation_batches=4", f"feature_cache={tmp_path}/runs/features"} <= set(first)
    assert evaluate[:2] == ["dblast", "eval"] and "dflash_baseline" in evaluate
    specs = [evaluate[i + 1] for i, a in enumerate(evaluate) if a == "--drafter"]
    assert specs[-1] == (f"dblast_k4_al_mixture={tmp_path}/runs/smollm2_dblast_k4_al/export"
                         "@mode=mixture")
    assert curves[:3] == ["python", "-m", "dblast_jax.train.curves"]


def test_ablations_train_like_reproduce_and_validate_on_its_held_out_shards(tmp_path):
    sizes = dict(SHARDS="5", VAL_SHARDS="1", STEPS="7")
    (tmp_path / "main").mkdir()
    main_train = _run("reproduce.sh", tmp_path / "main", **sizes)[1]
    calls = _run("ablations.sh", tmp_path, **sizes)
    *trains, validate = calls
    assert [c[c.index("--experiment") + 1] for c in trains] == [
        "smollm2_dblast_k2_al", "smollm2_dblast_k8_al"]

    def shared(call):  # the feature cache lives under each RUNS folder
        return [o for o in _overrides(call) if not o.startswith("feature_cache=")]
    assert all(shared(c) == shared(main_train) for c in trains)
    assert validate[:2] == ["dblast", "validate"]
    assert validate[validate.index("--shards") + 1] == "5:6"
    names = [validate[i + 1].split("=", 1)[0] for i, a in enumerate(validate) if a == "--drafter"]
    assert names == ["k1_al", "k2_al", "k8_al", "k4_al", "k4_al_zt0.5", "k4_al_zt2"]

    (tmp_path / "with_eval").mkdir()
    calls = _run("ablations.sh", tmp_path / "with_eval", ABLATION_EVAL="1",
                 ABLATIONS="smollm2_dblast_k2_al", **sizes)
    assert [c[1] for c in calls] == ["train", "validate", "eval"]
    assert calls[-1][-1].endswith("runs/eval_ablations")
