"""One error path for `dblast` and launch/*.py (issue 18): an expected failure is one line on
stderr naming what is wrong, where, and the fix, with exit status 2 and no traceback; a bug
keeps its traceback (status 1); --debug / DBLAST_DEBUG=1 shows the traceback always."""

import errno
import json
import os
import subprocess
import sys

import pytest

from dblast_jax import cli, errors

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one_line_error(capsys, *needles):
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _run(args, **kw):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("DBLAST_DEBUG", None)
    return subprocess.run([sys.executable] + args, cwd=REPO, env=env, capture_output=True,
                          timeout=120, **kw)


# ---- unknown names ---------------------------------------------------------------------------

def test_train_unknown_experiment(tmp_path, capsys):
    rc = cli.main(["train", "--workdir", str(tmp_path / "run"), "--experiment", "nope"])
    assert rc == 2
    line = _one_line_error(capsys, "unknown experiment 'nope'", "known: ", "tiny_dflash")
    assert line.startswith("dblast train: error: ")
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_launch_train_unknown_experiment(tmp_path):
    done = _run(["launch/train.py", "--experiment=nope", f"--workdir={tmp_path / 'run'}"])
    err = done.stderr.decode()
    assert done.returncode == 2, err[-3000:]
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "unknown experiment 'nope'" in lines[0], err
    assert "tiny_dblast_k4_al" in lines[0]


# ---- non-finite and out-of-range numbers -----------------------------------------------------

@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_temperature_must_be_finite(value, capsys):
    assert cli.main(["generate", f"--temperature={value}", "--prompt", "hi"]) == 2
    _one_line_error(capsys, "--temperature", "finite", repr(value), "e.g.")


@pytest.mark.parametrize("argv, flag", [
    (["generate", "--top-p", "nan"], "--top-p"),
    (["generate", "--top-p", "1.5"], "--top-p"),
    (["generate", "--draft-temperature", "0"], "--draft-temperature"),
    (["eval", "--drafter", "a=random", "--temperatures", "0.7", "nan"], "--temperatures"),
    (["validate", "--drafter", "a=random", "--data", "synthetic", "--verify-temperature",
      "inf"], "--verify-temperature"),
    (["data", "regenerate", "--out", "x", "--gen-temperatures", "1.0,nan"],
     "--gen-temperatures"),
])
def test_float_flags_refuse_bad_values(argv, flag, capsys):
    assert cli.main(argv) == 2
    _one_line_error(capsys, flag, "--help")


def test_sampling_config_refuses_non_finite():
    from dblast_jax.config import SamplingConfig
    for field in ("temperature", "top_p", "category_temperature", "draft_temperature"):
        with pytest.raises(ValueError, match=f"{field} must be a finite number"):
            SamplingConfig(**{field: float("nan")})
    with pytest.raises(ValueError, match="finite"):
        SamplingConfig(temperature=float("inf"))


def test_launcher_float_flags_and_train_overrides():
    with pytest.raises(ValueError, match="--temperatures: expected a finite number"):
        errors.check_float_flags([("temperatures", ["0.7", "nan"])], minimum=0.0)
    with pytest.raises(ValueError, match="--top_p: must be <= 1"):
        errors.check_float_flags([("top_p", 2.0)], minimum=0.0, strict=True, maximum=1.0)
    from dblast_jax.train.config import get_experiment
    with pytest.raises(ValueError, match="learning_rate='nan': expected a finite number"):
        get_experiment("tiny_dflash", ["learning_rate=nan"])


# ---- early checks ----------------------------------------------------------------------------

def test_validate_unknown_baseline_refused_before_loading(capsys, monkeypatch):
    from dblast_jax import generation

    def no_load(*a, **k):
        raise AssertionError("loaded a model before checking --baseline")

    monkeypatch.setattr(generation, "load_target", no_load)
    monkeypatch.setattr(generation, "named_drafters", no_load)
    for cmd in (["validate", "--data", "synthetic"], ["eval"]):
        rc = cli.main(cmd + ["--model", "tiny-llama", "--drafter", "k1=random", "--drafter",
                             "k4=random-k4", "--baseline", "nope"])
        assert rc == 2
        _one_line_error(capsys, "--baseline 'nope'", "'k1'", "'k4'")


def test_demo_set_wrong_type(capsys):
    assert cli.main(["demo", "--set", "train_steps=abc"]) == 2
    _one_line_error(capsys, "train_steps", "integer", "--set train_steps=40")
    assert cli.main(["demo", "--set", "pretrained=maybe"]) == 2
    _one_line_error(capsys, "pretrained", "true or false")
    assert cli.main(["demo", "--set", "learning_rate=inf"]) == 2
    _one_line_error(capsys, "learning_rate", "finite")


# ---- files and folders -----------------------------------------------------------------------

def test_workdir_that_is_a_file(tmp_path, capsys):
    blocker = tmp_path / "run"
    blocker.write_text("not a folder")
    assert cli.main(["train", "--workdir", str(blocker), "--experiment", "tiny_dflash"]) == 2
    _one_line_error(capsys, "--workdir", str(blocker), "is a file, not a folder")
    assert cli.main(["demo", "--tiny", "--workdir", str(blocker)]) == 2
    _one_line_error(capsys, "--workdir", "is a file")
    # the same failure deeper down (os.makedirs) maps to one line naming the path
    with pytest.raises(FileExistsError) as info:
        os.makedirs(blocker, exist_ok=True)
    message = errors.describe(info.value)
    assert str(blocker) in message and "choose another path" in message


def test_os_errors_name_the_path(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device", "/data/run/ckpt/3")
    assert errors.describe(full).startswith("no space left on the device writing "
                                            "/data/run/ckpt/3; free some space")
    written = tmp_path / "shard.bin"
    with pytest.raises(OSError) as info:
        with open(written, "wb") as f:  # a write() error carries no file name
            f.write(b"x")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert errors.describe(info.value).startswith(f"no space left on the device writing "
                                                  f"{written}; ")
    denied = PermissionError(errno.EACCES, "Permission denied", "/root/x")
    assert "/root/x: permission denied" in errors.describe(denied)
    missing = FileNotFoundError(errno.ENOENT, "No such file or directory", "corpus.jsonl")
    assert "corpus.jsonl: no such file" in errors.describe(missing)
    assert errors.describe(FileNotFoundError("drafter folder 'x' does not exist")) == (
        "drafter folder 'x' does not exist")
    assert errors.describe(KeyError("hidden_size")) is None  # a bare key: a bug, traceback
    assert errors.describe(RuntimeError("boom")) is None


@pytest.fixture(scope="module")
def drafter_folder(tmp_path_factory):
    from dblast_jax.config import DrafterConfig
    from dblast_jax.generation import export_drafter, init_drafter, load_target
    target = load_target("tiny-llama")
    config = DrafterConfig.for_target(target.config, num_layers=1, block_size=4)
    return str(export_drafter(init_drafter(target, config, 0),
                              tmp_path_factory.mktemp("drafter") / "k1"))


def _broken_copy(src, dst, name, mutate):
    import shutil
    shutil.copytree(src, dst)
    path = os.path.join(dst, name)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(mutate(data))
    return path


def _eval_with(folder):
    return cli.main(["eval", "--model", "tiny-llama", "--drafter", f"d={folder}",
                     "--out", os.path.join(os.path.dirname(folder), "eval_out")])


def test_truncated_safetensors(drafter_folder, tmp_path, capsys):
    path = _broken_copy(drafter_folder, tmp_path / "d", "model.safetensors",
                        lambda b: b[: len(b) // 2])
    assert _eval_with(str(tmp_path / "d")) == 2
    _one_line_error(capsys, path, "safetensors", "truncated")


def test_random_byte_safetensors(drafter_folder, tmp_path, capsys):
    path = _broken_copy(drafter_folder, tmp_path / "d", "model.safetensors",
                        lambda b: os.urandom(len(b)))
    assert _eval_with(str(tmp_path / "d")) == 2
    _one_line_error(capsys, path, "safetensors")


def test_malformed_config_json(drafter_folder, tmp_path, capsys):
    path = _broken_copy(drafter_folder, tmp_path / "d", "config.json",
                        lambda b: b.replace(b",", b"", 1))
    assert _eval_with(str(tmp_path / "d")) == 2
    _one_line_error(capsys, path, "not valid JSON at line", "column", "fix the file")


def test_config_json_with_random_bytes(drafter_folder, tmp_path, capsys):
    path = _broken_copy(drafter_folder, tmp_path / "d", "config.json",
                        lambda b: b"\xff\xfe" + b)
    assert _eval_with(str(tmp_path / "d")) == 2
    _one_line_error(capsys, path, "not UTF-8", "re-create")


def test_jsonl_error_names_the_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n{"a": \n')

    def reader(p):  # a reader that does not name its file (as several do)
        with open(p) as f:
            return [json.loads(ln) for ln in f if ln.strip()]

    with pytest.raises(json.JSONDecodeError) as info:
        reader(str(path))
    assert errors.describe(info.value).startswith(f"{path}: not valid JSON at line 4 ")


def test_demo_config_record_malformed(tmp_path, capsys):
    work = tmp_path / "demo"
    work.mkdir()
    (work / "demo_config.json").write_text('{"model": ')
    assert cli.main(["demo", "--tiny", "--workdir", str(work), "--no-progress"]) == 2
    _one_line_error(capsys, str(work / "demo_config.json"), "line 1", "another --workdir")


# ---- tracebacks: bugs and --debug ------------------------------------------------------------

def test_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    argv = ["train", "--workdir", str(tmp_path / "run"), "--experiment", "nope"]
    assert cli.main(["--debug"] + argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "unknown experiment 'nope'" in err
    monkeypatch.setenv("DBLAST_DEBUG", "1")
    assert cli.main(argv) == 2
    assert "Traceback" in capsys.readouterr().err


def test_a_bug_keeps_its_traceback(monkeypatch, capsys):
    def boom(args):
        raise RuntimeError("a genuine bug")

    monkeypatch.setattr(cli, "_cmd_fetch", boom)
    assert cli.main(["fetch"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "a genuine bug" in err


# ---- bytes that are not UTF-8 ----------------------------------------------------------------

def test_non_utf8_prompt_bytes():
    done = _run(["-m", "dblast_jax.cli", "generate", "--model", "tiny-llama", "--prompt",
                 b"\xff\xfe"])
    err = done.stderr.decode("utf-8", "replace")
    assert done.returncode == 2, err[-3000:]
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--prompt" in lines[0] and "not UTF-8" in lines[0], err
    assert errors.non_utf8_argument(["--prompt=\udcff"]).startswith("the value of --prompt")


def test_launch_evaluate_baseline_and_flag_errors(tmp_path):
    done = _run(["launch/evaluate.py", "--drafter=a=random", "--baseline=nope",
                 f"--out={tmp_path / 'e'}"])
    err = done.stderr.decode()
    assert done.returncode == 2, err[-3000:]
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--baseline='nope'" in lines[0], err
    assert not (tmp_path / "e").exists()


def test_raw_safetensors_error_names_the_file(tmp_path):
    """Whatever reader opens it, a SafetensorError is described with the file's name."""
    import numpy as np
    from safetensors.numpy import load_file, save_file
    path = str(tmp_path / "w.safetensors")
    save_file({"w": np.zeros((64,), np.float32)}, path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(Exception) as info:
        load_file(path)
    assert type(info.value).__name__ == "SafetensorError"
    message = errors.describe(info.value)
    assert message.startswith(f"cannot read {path}: ") and "re-export or restore" in message


# ---- silent no-ops and non-JSON output (issue 33, cases 5 and 8) -----------------------------

@pytest.mark.parametrize("stop", ["-5", "0"])
def test_stop_at_below_one_is_refused_before_anything_is_written(tmp_path, capsys, stop):
    rc = cli.main(["train", "--workdir", str(tmp_path / "run"), "--experiment", "tiny_dflash",
                   "--stop-at", stop])
    assert rc == 2
    _one_line_error(capsys, f"must be a step >= 1, got {stop}")
    assert not (tmp_path / "run").exists()


def test_generate_json_writes_null_for_undefined_statistics(capsys):
    """One new token: no speculative step ran, so tau is undefined (nan): null, not NaN."""
    rc = cli.main(["generate", "--model", "tiny-smollm2", "--drafter", "ngram",
                   "--max-new-tokens", "1", "--json", "--prompt", "A", "--prompt", "B"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out,
                     parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert out["stats"]["steps"] == 0 and out["stats"]["tau"] is None
    assert len(out["tokens"]) == 2


# ---- cloud paths without their extra, config fields that are not numbers (issue 33, 2 and 9) --

def test_gs_paths_without_the_gcs_extra_are_one_line(drafter_folder, tmp_path, capsys,
                                                     monkeypatch):
    """gs:// with gcsfs missing: one line naming the path and the extra, exit 2 (was two
    chained tracebacks and exit 1); nothing is written anywhere."""
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if the gcs extra were not installed
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["train", "--workdir", "gs://bucket/w", "--experiment", "tiny_dflash"])
    assert rc == 2
    _one_line_error(capsys, "gs://bucket/w", "pip install 'dblast_jax[gcs]'")
    rc = cli.main(["export", drafter_folder, "--target", "tiny-llama", "--out",
                   "gs://bucket/x"])
    assert rc == 2
    _one_line_error(capsys, "gs://bucket/x", "gcsfs", "pip install 'dblast_jax[gcs]'")
    assert os.listdir(tmp_path) == []
    assert errors.describe(ImportError("No module named 'nope'")) is None  # still a bug


@pytest.mark.parametrize("field, value, want", [
    ("hidden_size", "576abc", "must be an integer, got \"576abc\""),
    ("intermediate_size", [1536], "must be an integer, got [1536]"),
    ("rms_norm_eps", "tiny", "must be a number, got \"tiny\""),
])
def test_a_config_field_that_is_not_a_number_names_file_and_field(drafter_folder, tmp_path,
                                                                  capsys, field, value, want):
    """Was "invalid literal for int() with base 10: '576abc'" (and a traceback for a
    list): now the file, the field and the value."""
    def mutate(data):
        cfg = json.loads(data)
        cfg[field] = value
        return json.dumps(cfg).encode()

    path = _broken_copy(drafter_folder, tmp_path / "d", "config.json", mutate)
    assert _eval_with(str(tmp_path / "d")) == 2
    _one_line_error(capsys, path, f"field '{field}'", want)
