"""The SmolLM2 reproduction / ablation scripts, run with a stand-in `dblast` that records
its arguments: the scripts share settings.sh, so every drafter must train with the same
overrides, and each stage must hand the right folders to the next."""

import json
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


# The budget scripts (experiments/budget, recipe, claims, and the shipped drafters' rebuild
# scripts) run from a copy of them, since they write into the repository's runs/: a stand-in
# python records budget_curve.py calls (and starts the curve file the scripts wait for),
# stand-in dblast / git record theirs.
BUDGET_SCRIPTS = ["budget/recipe.sh", "budget/from_trunk.sh", "claims/common.sh",
                  "claims/paper_claims.sh", "claims/al_vs_nll.sh", "claims/k_sweep.sh",
                  "claims/category_temperature.sh", "claims/temperature_gain.sh",
                  "smollm2/train_dflash_k1.sh", "smollm2/train_dblast_k4.sh",
                  *[f"recipe/{n}.sh" for n in (
                      "distill_and_warm_start", "five_taps_and_two_layers", "k4_from_taps5_trunk",
                      "k1_on_greedy_text", "distill_on_five_taps", "sampled_head",
                      "k4_from_sampled_head_trunk")]]


def _run_budget(script, tmp_path, **env):
    repo = tmp_path / "repo"
    for rel in BUDGET_SCRIPTS:
        (repo / "experiments" / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / "experiments" / rel).write_text(
            open(os.path.join(ROOT, "experiments", rel)).read())
    log = tmp_path / "calls.txt"
    log.unlink(missing_ok=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    record = f'printf "%s\\n" "$(basename "$0") $*" >> {shlex.quote(str(log))}\n'
    (bin_dir / "dblast").write_text("#!/bin/sh\n" + record)
    (bin_dir / "git").write_text("#!/bin/sh\n" + record)
    (bin_dir / "sleep").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "python").write_text("#!/bin/sh\n" + record + 'for a in "$@"; do case "$a" in '
                                    '--workdir=*) d="${a#--workdir=}"; mkdir -p "$d"; '
                                    'echo "{}" >> "$d/budget_curve.jsonl";; esac; done\n')
    for f in bin_dir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    subprocess.run(["bash", str(repo / "experiments" / script)], check=True, timeout=120,
                   env=dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", **env),
                   capture_output=True, text=True)
    return [line.split() for line in log.read_text().splitlines()], repo


def _workdir(call):
    return next((a.split("=", 1)[1] for a in call if a.startswith("--workdir=")), None)


def _flags(call):
    return [a for a in call if a.startswith("--override=") or a.startswith("--experiment=")]


def test_shipped_drafter_scripts_train_the_trunk_then_the_drafter_then_export(tmp_path):
    trunk = ("taps5_distill_head4k", ["--override=learning_rate=1e-3",
             "--override=train_head_tokens=4096", "--override=train_head_sampled=1024",
             "--override=target_layer_ids=1,7,14,20,27", "--override=distill_weight=1.0"])
    for script, experiment, workdir in [
            ("train_dflash_k1.sh", "smollm2_k1_al", "k1al_from_head4k_1000"),
            ("train_dblast_k4.sh", "smollm2_dblast_k4_al", "k4al_from_head4k_1000")]:
        calls, repo = _run_budget(f"smollm2/{script}", tmp_path / script)
        first, export_trunk, train, export = calls
        # the trunk from the corpus: sampled_head.sh's run with its arguments, no old commit
        assert _workdir(first) == f"runs/budget/{trunk[0]}" and set(trunk[1]) <= set(first)
        assert "--max_steps=1000" in first and "--budget_cpu_s=100000" in first
        assert export_trunk[:3] == ["dblast", "export", f"runs/budget/{trunk[0]}"]
        assert export_trunk[export_trunk.index("--out") + 1] == "runs/budget/trunk_k1"
        assert _workdir(train) == f"runs/budget/{workdir}"
        assert {f"--experiment={experiment}", "--override=learning_rate=5e-4",
                "--override=drafter_init=drafter:runs/budget/trunk_k1", "--max_steps=1000",
                "--segment_steps=100"} <= set(train)
        assert export[:3] == ["dblast", "export", f"runs/budget/{workdir}"]
        assert "bfloat16" in export and "corpora/smollm2_t1:0:68" in export
        # a trunk already there is not trained again
        (repo / "runs/budget/trunk_k1").mkdir()
        (repo / "runs/budget/trunk_k1/model.safetensors").write_text("")
        calls, _ = _run_budget(f"smollm2/{script}", tmp_path / script)
        assert [_workdir(c) for c in calls] == [f"runs/budget/{workdir}", None]


def test_claim_scripts_score_their_drafters_as_the_combined_run_does(tmp_path):
    calls, _ = _run_budget("claims/paper_claims.sh", tmp_path / "all")
    combined = {tuple(c[c.index("--out") + 1:]) for c in calls if c[:2] == ["dblast", "validate"]}
    trained = {_workdir(c): _flags(c) for c in calls if _workdir(c)}
    assert not [c for c in calls if c[0] == "git"]  # the trunk is trained, not taken from git
    for script, names in [("al_vs_nll.sh", ["k1_al", "dflash", "k4_nll", "k4_al"]),
                          ("k_sweep.sh", ["k1_al", "k2_al", "k4_al", "k8_al"]),
                          ("category_temperature.sh", ["k1_al", "k4_al", "k4_al_zt0.5",
                                                       "k4_al_zt2"]),
                          ("temperature_gain.sh", ["k1_al", "k4_al", "k1_al_1000",
                                                   "k4_al_1000"])]:
        calls, _ = _run_budget(f"claims/{script}", tmp_path / script)
        validations = [c for c in calls if c[:2] == ["dblast", "validate"]]
        assert validations and all(c[c.index("--baseline") + 1] == "k1_al" for c in validations)
        for c in validations:
            drafters = [c[i + 1] for i, a in enumerate(c) if a == "--drafter"]
            assert [d.split("=", 1)[0] for d in drafters] == names
            # each drafter on held-out data the combined run scores it on too (the shipped
            # pair at T_v = 1.0 / 1.5: section 4.7's validation, not the combined run's)
            data = tuple(c[c.index("--data"):])
            for d in drafters:
                assert any(d in v and data == v[-len(data):] for v in combined) or (
                    "_1000=" in d and "0.7" not in data)
        for c in calls:  # and trained with the combined run's arguments
            if _workdir(c):
                assert _flags(c) == trained[_workdir(c)]


def test_recipe_scripts_run(tmp_path):
    for name in ("distill_and_warm_start", "five_taps_and_two_layers", "k4_from_taps5_trunk",
                 "k1_on_greedy_text", "distill_on_five_taps", "sampled_head",
                 "k4_from_sampled_head_trunk"):
        calls, _ = _run_budget(f"recipe/{name}.sh", tmp_path / name, T0_SHARDS="4")
        assert calls and all(_workdir(c) or c[1] == "export" for c in calls)


def _eval_results(folder, temps, rows):
    """A results.json as `dblast eval` writes it: tau, tau_se and speedup tables with one
    row per drafter ({name: value}, the same value in every column)."""
    columns = [f"humaneval@T{t}" for t in temps] + [f"macro@T{t}" for t in temps]
    tables = {metric: {"columns": columns,
                       "rows": [{"drafter": name, **{c: value[i] for c in columns}}
                                for name, value in rows.items()]}
              for i, metric in enumerate(("tau", "tau_se", "speedup"))}
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({"tables": tables}))


def test_decoding_methods_table_reads_the_methods_each_folder_holds(tmp_path):
    """The K = 4 of shipped_on_benchmarks.sh gets its row; a missing folder is named."""
    rows = {"k1": (1.5, 0.02, 0.7), "k4": (1.6, 0.03, 0.6), "ngram": (1.7, 0.04, 1.2),
            "mystery": (1.1, 0.01, 0.9)}
    _eval_results(tmp_path / "b1_argmax", ("0.0", "0.7"), rows)
    _eval_results(tmp_path / "b1_sampled", ("1.0", "1.5"), rows)
    done = subprocess.run([sys.executable, os.path.join(
        ROOT, "experiments", "smollm2", "decoding_methods_table.py"), str(tmp_path)],
        capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    table = [line for line in lines if line.startswith("| `")]
    # batch 1's four temperatures in one row per method, ORDER first, the rest after
    assert [line.split("`")[1] for line in table[:4]] == ["ngram", "k1", "k4", "mystery"]
    assert table[2] == ("| `k4` | 1.60 ± 0.03 / 0.60x | 1.60 ± 0.03 / 0.60x | "
                        "1.60 ± 0.03 / 0.60x | 1.60 ± 0.03 / 0.60x |")
    assert "(b8_argmax: not finished yet" in done.stdout
