"""Issue 33, case 4: every folder a command writes follows export's rule (one check,
dblast_jax/io/output_folder.py): absent, empty, or a folder of its own kind (a resume).
A folder holding anything else is refused in one line naming the folder, the files in
the way and the flag to pick another folder, before anything is written; the folders the
writers leave behind (a half-made corpus, an evaluation's rows, a workdir's checkpoints,
a lock file) still resume."""

import json
import os

import pytest

from dblast_jax import cli
from dblast_jax.io.output_folder import OutputFolderError, check_output_folder

USER_FILES = {"data.csv": "a,b\n1,2\n", "notes.txt": "my notes\n",
              "config.json": '{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}\n',
              "model.safetensors": "not really weights"}


def _user_folder(path):
    """A user's folder of other files (a model, data, notes): returns its snapshot."""
    path.mkdir(parents=True)
    for name, text in USER_FILES.items():
        (path / name).write_text(text)
    return _snapshot(path)


def _snapshot(path):
    return {n: (path / n).read_bytes() for n in sorted(os.listdir(path))}


def _refused(capsys, folder, flag):
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    for needle in (str(folder), "neither empty nor", flag, "nothing was written",
                   *sorted(USER_FILES)):
        assert needle in line, (needle, line)
    return line


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from conftest import make_corpus
    return make_corpus(tmp_path_factory.mktemp("src"))


def test_every_command_refuses_a_folder_of_other_files(tmp_path, corpus, capsys,
                                                       monkeypatch):
    """regenerate (which wrote manifest.json and shards among them before), eval,
    validate, train and demo: exit 2, one line, the folder byte for byte unchanged (no
    lock file left either); refused before a model is loaded."""
    from dblast_jax import generation

    def no_load(*a, **k):
        raise AssertionError("loaded a model before checking the output folder")

    monkeypatch.setattr(generation, "load_target", no_load)
    monkeypatch.setattr(generation, "named_drafters", no_load)
    folder = tmp_path / "mine"
    before = _user_folder(folder)
    commands = [
        (["data", "regenerate", "--model", "tiny-llama", "--out", str(folder),
          "--prompts-from", f"{corpus}:0:1", "--no-progress"], "--out"),
        (["eval", "--model", "tiny-llama", "--drafter", "d=random", "--out", str(folder),
          "--no-progress"], "--out"),
        (["validate", "--model", "tiny-llama", "--drafter", "d=random", "--data", "synthetic",
          "--out", str(folder), "--no-progress"], "--out"),
        (["train", "--experiment", "tiny_dflash", "--workdir", str(folder)], "--workdir"),
        (["demo", "--tiny", "--workdir", str(folder), "--no-progress"], "--workdir"),
    ]
    for argv, flag in commands:
        assert cli.main(argv) == 2, argv
        _refused(capsys, folder, flag)
        assert _snapshot(folder) == before, argv


def test_the_api_writers_refuse_it_too(tmp_path):
    """The library calls behind the commands: regenerate, run_evaluation, the feature
    cache and train()."""
    from dblast_jax import evaluate as ev
    from dblast_jax.data import regenerate as regen
    from dblast_jax.train import feature_cache as fc
    from dblast_jax.train import trainer as TR
    from conftest import tiny_cfg
    folder = tmp_path / "mine"
    before = _user_folder(folder)
    calls = [
        lambda: regen.regenerate(None, [[1, 2, 3]], folder, progress=False),
        lambda: ev.run_evaluation(None, {}, out_dir=str(folder), progress=False),
        lambda: fc.build_feature_cache([], None, None, [0], 8, folder, progress=False),
        lambda: TR.train(tiny_cfg("tiny_dflash"), str(folder), progress=False),
    ]
    for call in calls:
        with pytest.raises(OutputFolderError) as err:
            call()
        assert "\n" not in str(err.value) and "data.csv" in str(err.value)
        assert _snapshot(folder) == before


def test_folders_of_their_own_kind_resume(tmp_path):
    """What each writer leaves behind is accepted, lock files and temp files included;
    the user's notes beside a writer's record do not make it foreign."""
    def make(name, files):
        path = tmp_path / name
        for rel, text in files.items():
            (path / rel).parent.mkdir(parents=True, exist_ok=True)
            (path / rel).write_text(text)
        return path

    corpus = json.dumps({"format": "dblast-corpus-v1", "shards": []})
    cases = {
        # a corpus cut short before its first manifest, and one being written now
        ("corpus", "half_corpus"): {".lock": "{}", "shard-00000.npz": "x",
                                    ".shard-00000.npz.done.json": "{}",
                                    ".manifest.json.ab12cd34.tmp": ""},
        ("corpus", "corpus"): {"manifest.json": corpus, "shard-00000.npz": "x",
                               "README.md": "my corpus"},
        ("evaluation", "eval"): {".lock": "{}", "rows.jsonl": "{}\n",
                                 "run_config.json": json.dumps(
                                     {"max_new_tokens": 8, "verify_mode": "greedy-branch"}),
                                 "tensorboard/events.out.tfevents.1": ""},
        ("evaluation", "eval_rows_only"): {"rows.jsonl": "{}\n"},
        ("training workdir", "workdir"): {
            "experiment.json": json.dumps({"drafter_config": {}, "loss": "ce"}),
            "checkpoints/4/x": "", "checkpoints/8.orbax-checkpoint-tmp/x": "",
            "metrics.jsonl": "", "leg.json": "{}"},
        ("feature cache", "features"): {"0123456789abcdef/meta.json": json.dumps(
            {"format": "dblast-feature-cache-v1"}), "0123456789abcdef/taps.npy": ""},
        ("validation", "validation"): {"validation.json": json.dumps(
            {"settings": {}, "results": {}}), "validation.md": ""},
        ("demo", "demo"): {"demo_config.json": json.dumps({"seed": 0}), "corpus/x": ""},
    }
    for (kind, name), files in cases.items():
        assert check_output_folder(make(name, files), kind, "--out") == "resume", name
    empty = make("empty", {".lock": "{}", ".DS_Store": ""})
    assert check_output_folder(empty, "corpus", "--out") == "empty"
    assert check_output_folder(tmp_path / "absent", "evaluation", "--out") == "absent"
    # a record of another kind is no record: a foreign manifest.json among user files
    foreign = make("foreign", {"manifest.json": '{"format": "other"}', "data.csv": ""})
    with pytest.raises(OutputFolderError, match=r"holds data.csv\)"):
        check_output_folder(foreign, "corpus", "--out")
    with pytest.raises(OutputFolderError, match="is a file, not a folder.*--out"):
        check_output_folder(tmp_path / "foreign" / "data.csv", "corpus", "--out")
