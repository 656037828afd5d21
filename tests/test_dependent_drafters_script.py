"""experiments/claims/dependent_drafters.sh with recording stand-ins for `python`
(budget_curve.py) and `dblast`: every variant trains from the same trunk with the same
recipe and only its own mechanism's flags, then all are validated together, paired
against the K = 1 control."""

import os
import shlex
import stat
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "experiments", "claims", "dependent_drafters.sh")

RECORDER = """#!{py}
import os, sys
with open({log!r}, "a") as f:
    f.write(" ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]) + "\\n")
if "validate" in sys.argv:
    out = sys.argv[sys.argv.index("--out") + 1]
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, "validation.md"), "w").write("| table of " + out + " |\\n")
"""


def _run(tmp_path, **env):
    log = tmp_path / "calls.txt"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python", "dblast"):
        (bin_dir / name).write_text(RECORDER.format(py=sys.executable, log=str(log)))
        (bin_dir / name).chmod(0o755 | stat.S_IEXEC)
    trunk = tmp_path / "trunk"
    trunk.mkdir()
    (trunk / "config.json").write_text("{}")
    full = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", TRUNK=str(trunk),
                OUT=str(tmp_path / "out"), DATA="some/corpus", **env)
    done = subprocess.run(["bash", SCRIPT], env=full, capture_output=True, text=True)
    calls = [shlex.split(line) for line in log.read_text().splitlines()] if log.exists() else []
    return done, calls, trunk


def test_variants_share_the_recipe_and_differ_only_in_their_mechanism(tmp_path):
    done, calls, trunk = _run(tmp_path, STEPS="7")
    assert done.returncode == 0, done.stderr
    trains = [c for c in calls if "experiments/budget/budget_curve.py" in c]
    validates = [c for c in calls if "validate" in c]
    assert len(trains) == 5 and len(validates) == 3
    mechanism = {}
    shared = None
    for c in trains:
        name = os.path.basename(next(a for a in c if a.startswith("--workdir="))
                                .split("=", 1)[1])
        flags = [a for a in c if a.startswith(("--experiment=", "--override=correction",
                                               "--override=drafter.block_attention"))]
        mechanism[name] = flags
        rest = sorted(a for a in c if a not in flags and not a.startswith("--workdir="))
        assert shared is None or rest == shared  # the same recipe for every variant
        shared = rest
    assert mechanism == {
        "k1_control": ["--experiment=smollm2_k1_al"],
        "dblast_k4": ["--experiment=smollm2_dblast_k4_al"],
        "correction": ["--experiment=smollm2_k1_al", "--override=correction=previous-token"],
        "block_causal": ["--experiment=smollm2_k1_al",
                         "--override=drafter.block_attention=causal"],
        "k4_correction": ["--experiment=smollm2_dblast_k4_al",
                          "--override=correction=previous-token"]}
    assert {f"--override=drafter_init=drafter:{trunk}", "--max_steps=7",
            "--override=data=some/corpus", "--override=seq_len=384"} <= set(shared)
    temps = [v[v.index("--verify-temperature") + 1] for v in validates]
    assert temps == ["0.7", "1.0", "1.5"]
    for v in validates:
        assert v[v.index("--baseline") + 1] == "k1_control"
        assert [v[i + 1].split("=")[0] for i, a in enumerate(v) if a == "--drafter"] == [
            "k1_control", "dblast_k4", "correction", "block_causal", "k4_correction"]
    assert "## T_v = 1.5" in done.stdout and "validate_t1.5 |" in done.stdout


def test_a_subset_without_the_control_and_an_unknown_variant(tmp_path):
    done, calls, _ = _run(tmp_path, VARIANTS="correction block_causal", STEPS="3")
    assert done.returncode == 0, done.stderr
    validates = [c for c in calls if "validate" in c]
    assert validates and all("--baseline" not in v for v in validates)
    again = tmp_path / "again"
    again.mkdir()
    done, calls, _ = _run(again, VARIANTS="k8_magic")
    assert done.returncode == 1 and "unknown variant k8_magic" in done.stderr
