"""Issue 33: an audit of every command-line flag of `dblast` and of launch/*.py for range
and type. TABLE holds one row per flag that takes a value: a bad value and the one-line
message it must give (exit 2, no traceback, nothing else on stderr); SWITCHES and
FREE_TEXT list the flags with nothing to check, with the reason. A flag in none of them
-- a new flag added without a check -- fails `test_every_flag_is_audited`.

The dblast rows run in-process (argparse refuses most at parse time; the others before a
model of any size loads: the rows name the tiny presets where one is loaded). Each
launcher's rows run in one subprocess that parses its absl flags row after row."""

import argparse
import json
import os
import subprocess
import sys
import textwrap

import pytest

from dblast_jax import cli
from conftest import REPO_ROOT

DRAFT = ["--drafter", "d=random"]
SYN = ["--drafter", "d=random", "--data", "synthetic"]
TINY = ["--model", "tiny-llama"]
EXP = ["--workdir", "{DIR}", "--experiment", "tiny_dflash"]
PRESET = "is neither a known preset"

# (program, flag) -> (arguments, a substring of the one-line message). {FILE} is a file,
# {DIR} an absent folder in the test's temporary folder.
TABLE = {
    # ---- dblast
    ("dblast fetch", "names"): (["fetch", "nope"], "unknown file 'nope'"),
    ("dblast generate", "--model"): (["generate", "--model", "nope"], PRESET),
    ("dblast generate", "--dtype"): (["generate", "--dtype", "float16"], "invalid choice"),
    ("dblast generate", "--drafter"): (["generate", *TINY, "--drafter", "{DIR}"],
                                       "does not exist"),
    ("dblast generate", "--verify-mode"): (["generate", "--verify-mode", "x"],
                                           "invalid choice"),
    ("dblast generate", "--category-temperature"): (
        ["generate", "--category-temperature", "0"], "--category-temperature: must be > 0"),
    ("dblast generate", "--draft-temperature"): (
        ["generate", "--draft-temperature", "nan"], "--draft-temperature: expected a finite"),
    ("dblast generate", "--mesh"): (["generate", "--mesh", "2,2"],
                                    "--mesh: mesh '2,2': expected three integers"),
    ("dblast generate", "--temperature"): (["generate", "--temperature", "-1"],
                                           "--temperature: must be >= 0"),
    ("dblast generate", "--top-k"): (["generate", "--top-k", "-1"], "--top-k: must be >= 0"),
    ("dblast generate", "--top-p"): (["generate", "--top-p", "0"], "--top-p: must be > 0"),
    ("dblast generate", "--max-new-tokens"): (["generate", "--max-new-tokens", "0"],
                                              "--max-new-tokens: must be >= 1"),
    ("dblast generate", "--seed"): (["generate", "--seed", "-1"], "--seed: must be >= 0"),
    ("dblast train", "--workdir"): (["train", "--workdir", "{FILE}"], "is a file, not a folder"),
    ("dblast train", "--experiment"): (["train", "--workdir", "{DIR}", "--experiment", "nope"],
                                       "unknown experiment 'nope'"),
    ("dblast train", "--override"): (["train", *EXP, "--override", "nope=1"],
                                     "TrainConfig has no field 'nope'"),
    ("dblast train", "--target"): (["train", *EXP, "--target", "nope"], PRESET),
    ("dblast train", "--data"): (["train", *EXP, "--data", "{DIR}.jsonl"], "does not exist"),
    ("dblast train", "--stop-at"): (["train", *EXP, "--stop-at", "0"],
                                    "must be a step >= 1, got 0"),
    ("dblast carry pack", "workdir"): (["carry", "pack", "{DIR}", "{DIR}2"],
                                       "is not a training workdir"),
    ("dblast carry pack", "dest"): (["carry", "pack", "{DIR}", "{FILE}"],
                                    "holds no carried run"),
    ("dblast carry unpack", "src"): (["carry", "unpack", "{DIR}", "{DIR}2"],
                                     "holds no carried run"),
    ("dblast carry unpack", "workdir"): (["carry", "unpack", "{DIR}", "{FILE}"],
                                         "is a file, not a workdir"),
    ("dblast export", "source"): (["export", "{DIR}", "--out", "{DIR}2", "--target",
                                   "tiny-llama"], "does not exist"),
    ("dblast export", "--out"): (["export", "random", "--out", "{FILE}", "--target",
                                  "tiny-llama"], "it is a file, not a folder"),
    ("dblast export", "--target"): (["export", "random", "--out", "{DIR}", "--target", "nope"],
                                    PRESET),
    ("dblast export", "--dtype"): (["export", "random", "--out", "{DIR}", "--dtype", "x"],
                                   "invalid choice"),
    ("dblast export", "--token-counts-from"): (
        ["export", "random", "--out", "{DIR}", "--target", "tiny-llama",
         "--token-counts-from", "{DIR}2"], "expected 'synthetic', a .jsonl file"),
    ("dblast export", "--draft-vocab"): (["export", "random", "--out", "{DIR}",
                                          "--draft-vocab", "0"], "--draft-vocab: must be >= 1"),
    ("dblast export", "--mesh"): (["export", "random", "--out", "{DIR}", "--mesh", "1,x,1"],
                                  "--mesh: mesh '1,x,1'"),
    ("dblast eval", "--model"): (["eval", "--model", "nope", *DRAFT, "--out", "{DIR}"], PRESET),
    ("dblast eval", "--drafter"): (["eval", "--drafter", "bad"], "expected NAME=FOLDER"),
    ("dblast eval", "--blocks"): (["eval", *DRAFT, "--blocks", "1"], "--blocks: must be >= 2"),
    ("dblast eval", "--baseline"): (["eval", *DRAFT, "--baseline", "nope"],
                                    "--baseline 'nope' is not one of the --drafter names"),
    ("dblast eval", "--benchmarks"): (["eval", *TINY, *DRAFT, "--benchmarks", "nope", "--out",
                                       "{DIR}"], "unknown prompt set 'nope'"),
    ("dblast eval", "--temperatures"): (["eval", *DRAFT, "--temperatures", "0.7", "-1"],
                                        "--temperatures: must be >= 0"),
    ("dblast eval", "--prompts-per-benchmark"): (
        ["eval", *DRAFT, "--prompts-per-benchmark", "0"], "--prompts-per-benchmark: must be"),
    ("dblast eval", "--max-new-tokens"): (["eval", *DRAFT, "--max-new-tokens", "x"],
                                          "--max-new-tokens: expected an integer"),
    ("dblast eval", "--verify-mode"): (["eval", *DRAFT, "--verify-mode", "x"],
                                       "invalid choice"),
    ("dblast eval", "--batch-size"): (["eval", *DRAFT, "--batch-size", "0"],
                                      "--batch-size: must be >= 1"),
    ("dblast eval", "--seed"): (["eval", *DRAFT, "--seed", "-1"], "--seed: must be >= 0"),
    ("dblast eval", "--out"): (["eval", *DRAFT, "--out", "gs://b/x"], "must be a local"),
    ("dblast eval", "--mesh"): (["eval", *DRAFT, "--mesh", "2,2"], "--mesh: mesh '2,2'"),
    ("dblast eval", "--coordinator-address"): (
        ["eval", *DRAFT, "--coordinator-address", "host"], "expected HOST:PORT"),
    ("dblast eval", "--num-processes"): (["eval", *DRAFT, "--num-processes", "0"],
                                         "--num-processes: must be >= 1"),
    ("dblast eval", "--process-id"): (["eval", *DRAFT, "--process-id", "-1"],
                                      "--process-id: must be >= 0"),
    ("dblast eval", "--cpu-collectives"): (["eval", *DRAFT, "--cpu-collectives", "x"],
                                           "invalid choice"),
    ("dblast validate", "--model"): (["validate", "--model", "nope", *SYN], PRESET),
    ("dblast validate", "--drafter"): (["validate", "--drafter", "bad", "--data", "synthetic"],
                                       "expected NAME=FOLDER"),
    ("dblast validate", "--data"): (["validate", *TINY, "--drafter", "d=random", "--data",
                                     "{DIR}"], "expected 'synthetic'"),
    ("dblast validate", "--shards"): (["validate", *TINY, *SYN, "--shards", "x"],
                                      "shard range 'x': expected A:B"),
    ("dblast validate", "--batches"): (["validate", *SYN, "--batches", "0"],
                                       "--batches: must be >= 1"),
    ("dblast validate", "--batch-size"): (["validate", *SYN, "--batch-size", "-2"],
                                          "--batch-size: must be >= 1"),
    ("dblast validate", "--seq-len"): (["validate", *SYN, "--seq-len", "1"],
                                       "--seq-len: must be >= 2"),
    ("dblast validate", "--anchors"): (["validate", *SYN, "--anchors", "0"],
                                       "--anchors: must be >= 1"),
    ("dblast validate", "--verify-temperature"): (
        ["validate", *SYN, "--verify-temperature", "0"], "--verify-temperature: must be > 0"),
    ("dblast validate", "--baseline"): (["validate", *SYN, "--baseline", "nope"],
                                        "--baseline 'nope'"),
    ("dblast validate", "--seed"): (["validate", *SYN, "--seed", "x"],
                                    "--seed: expected an integer"),
    ("dblast validate", "--out"): (["validate", *SYN, "--out", "{FILE}"], "is a file"),
    ("dblast validate", "--coordinator-address"): (
        ["validate", *SYN, "--coordinator-address", "h:0"], "expected HOST:PORT"),
    ("dblast validate", "--num-processes"): (["validate", *SYN, "--num-processes", "x"],
                                             "--num-processes: expected an integer"),
    ("dblast validate", "--process-id"): (["validate", *SYN, "--process-id", "-3"],
                                          "--process-id: must be >= 0"),
    ("dblast validate", "--cpu-collectives"): (["validate", *SYN, "--cpu-collectives", "x"],
                                               "invalid choice"),
    ("dblast demo", "--workdir"): (["demo", "--workdir", "{FILE}"], "is a file"),
    ("dblast demo", "--set"): (["demo", "--set", "train_steps=-3"],
                               "train_steps expects an integer >= 1"),
    ("dblast data fetch", "names"): (["data", "fetch", "nope"], "unknown prompt sets ['nope']"),
    ("dblast data regenerate", "--model"): (["data", "regenerate", "--model", "nope", "--out",
                                             "{DIR}"], PRESET),
    ("dblast data regenerate", "--out"): (["data", "regenerate", "--out", "{FILE}"],
                                          "is a file, not a folder"),
    ("dblast data regenerate", "--pools"): (["data", "regenerate", "--model", "tiny-smollm2",
                                             "--out", "{DIR}", "--pools", "nope"],
                                            "unknown prompt set 'nope'"),
    ("dblast data regenerate", "--limit"): (["data", "regenerate", "--out", "{DIR}",
                                             "--limit", "0"], "--limit: must be >= 1"),
    ("dblast data regenerate", "--prompts-from"): (
        ["data", "regenerate", *TINY, "--out", "{DIR}", "--prompts-from", "{DIR}2:0:1"],
        "no corpus at"),
    ("dblast data regenerate", "--gen-temperatures"): (
        ["data", "regenerate", "--out", "{DIR}", "--gen-temperatures", "1,-1"],
        "--gen-temperatures: expected comma-separated numbers >= 0"),
    ("dblast data regenerate", "--verify-temperatures"): (
        ["data", "regenerate", "--out", "{DIR}", "--verify-temperatures", "inf"],
        "--verify-temperatures: expected comma-separated numbers"),
    ("dblast data regenerate", "--top-k"): (["data", "regenerate", "--out", "{DIR}", "--top-k",
                                             "-1"], "--top-k: must be >= 0"),
    ("dblast data regenerate", "--top-p"): (["data", "regenerate", "--out", "{DIR}", "--top-p",
                                             "2"], "--top-p: must be <= 1"),
    ("dblast data regenerate", "--max-new-tokens"): (
        ["data", "regenerate", "--out", "{DIR}", "--max-new-tokens", "0"],
        "--max-new-tokens: must be >= 1"),
    ("dblast data regenerate", "--max-prompt-tokens"): (
        ["data", "regenerate", "--out", "{DIR}", "--max-prompt-tokens", "0"],
        "--max-prompt-tokens: must be >= 1"),
    ("dblast data regenerate", "--batch-size"): (
        ["data", "regenerate", "--out", "{DIR}", "--batch-size", "0"], "--batch-size: must be"),
    ("dblast data regenerate", "--shard-size"): (
        ["data", "regenerate", "--out", "{DIR}", "--shard-size", "0"], "--shard-size: must be"),
    ("dblast data regenerate", "--seed"): (["data", "regenerate", "--out", "{DIR}", "--seed",
                                            "1.5"], "--seed: expected an integer"),
    ("dblast data regenerate", "--max-shards"): (
        ["data", "regenerate", "--out", "{DIR}", "--max-shards", "0"], "--max-shards: must be"),
    ("dblast data regenerate", "--dtype"): (["data", "regenerate", "--out", "{DIR}", "--dtype",
                                             "x"], "invalid choice"),
    ("dblast data regenerate", "--mesh"): (["data", "regenerate", "--out", "{DIR}", "--mesh",
                                            "2"], "--mesh: mesh '2'"),
    ("dblast data regenerate", "--prompts-file"): (
        ["data", "regenerate", *TINY, "--out", "{DIR}", "--prompts-file", "{DIR}2.jsonl"],
        "no prompt file at"),
    ("dblast data self-prompts", "--model"): (
        ["data", "self-prompts", "--out", "{DIR}", "--count", "8", "--model", "nope"], PRESET),
    ("dblast data self-prompts", "--out"): (
        ["data", "self-prompts", "--out", "{FILE}", "--count", "8"], "is a file, not a folder"),
    ("dblast data self-prompts", "--count"): (
        ["data", "self-prompts", "--out", "{DIR}", "--count", "0"], "--count: must be >= 1"),
    ("dblast data self-prompts", "--seed"): (
        ["data", "self-prompts", "--out", "{DIR}", "--count", "8", "--seed", "-1"],
        "--seed: must be >= 0"),
    ("dblast data self-prompts", "--temperature"): (
        ["data", "self-prompts", "--out", "{DIR}", "--count", "8", "--temperature", "0"],
        "--temperature: must be > 0"),
    ("dblast data self-prompts", "--top-p"): (
        ["data", "self-prompts", "--out", "{DIR}", "--count", "8", "--top-p", "2"],
        "--top-p: must be <= 1"),
    ("dblast data self-prompts", "--max-query-tokens"): (
        ["data", "self-prompts", "--out", "{DIR}", "--count", "8", "--max-query-tokens", "0"],
        "--max-query-tokens: must be >= 1"),
    ("dblast data self-prompts", "--batch-size"): (
        ["data", "self-prompts", "--out", "{DIR}", "--count", "8", "--batch-size", "0"],
        "--batch-size: must be >= 1"),
    ("dblast data self-prompts", "--dtype"): (
        ["data", "self-prompts", "--out", "{DIR}", "--count", "8", "--dtype", "x"],
        "invalid choice"),
    ("dblast data regenerate", "--coordinator-address"): (
        ["data", "regenerate", "--out", "{DIR}", "--coordinator-address", ":1"],
        "expected HOST:PORT"),
    ("dblast data regenerate", "--num-processes"): (
        ["data", "regenerate", "--out", "{DIR}", "--num-processes", "0"],
        "--num-processes: must be >= 1"),
    ("dblast data regenerate", "--process-id"): (
        ["data", "regenerate", "--out", "{DIR}", "--process-id", "-1"],
        "--process-id: must be >= 0"),
    ("dblast data regenerate", "--cpu-collectives"): (
        ["data", "regenerate", "--out", "{DIR}", "--cpu-collectives", "x"], "invalid choice"),
    ("dblast data tfds", "--corpus"): (["data", "tfds", "--corpus", "{DIR}", "--data-dir",
                                        "{DIR}2"], "no corpus at"),
    ("dblast data tfds", "--max-shards"): (["data", "tfds", "--max-shards", "0", "--data-dir",
                                            "{DIR}"], "--max-shards: must be >= 1"),
    ("dblast data tfds", "--prompts"): (["data", "tfds", "--prompts", "nope", "--data-dir",
                                         "{DIR}"], "unknown prompt set 'nope'"),
    ("dblast data tfds", "--data-dir"): (["data", "tfds", "--prompts", "gsm8k", "--data-dir",
                                          "{FILE}"], "is a file, not a folder"),
    ("dblast data stats", "corpus"): (["data", "stats", "{DIR}"], "no corpus at"),
    ("dblast data merge", "sources"): (["data", "merge", "--out", "{DIR}", "{DIR}2"],
                                       "no corpus there"),
    ("dblast data merge", "--out"): (["data", "merge", "--out", "{FILE}", "{DIR}2"],
                                     "is a file"),
    ("dblast data merge", "--verify-temperatures"): (
        ["data", "merge", "--out", "{DIR}", "{DIR}2", "--verify-temperatures", "inf"],
        "--verify-temperatures: expected comma-separated numbers"),
    ("dblast data merge", "--exclude-prompts-of"): (
        ["data", "merge", "--out", "{DIR}", "{DIR}2", "--exclude-prompts-of", "{DIR}3:5:1"],
        "shard range '5:1'"),
    ("dblast data drop-scores", "corpus"): (["data", "drop-scores", "{DIR}", "--out",
                                             "{DIR}2"], "no corpus at"),
    ("dblast data drop-scores", "--out"): (["data", "drop-scores", "{DIR}2", "--out",
                                            "{FILE}"], "is a file"),
    # ---- launch/train.py
    ("launch/train.py", "--experiment"): (["--workdir={DIR}", "--experiment=nope"],
                                          "unknown experiment 'nope'"),
    ("launch/train.py", "--override"): (["--workdir={DIR}", "--experiment=tiny_dflash",
                                         "--override=lr"], "override 'lr'"),
    ("launch/train.py", "--workdir"): (["--workdir={FILE}", "--experiment=tiny_dflash"],
                                       "is a file, not a folder"),
    ("launch/train.py", "--mesh"): (["--workdir={DIR}", "--experiment=tiny_dflash",
                                     "--mesh=2,x,1"], "--mesh='2,x,1'"),
    ("launch/train.py", "--target"): (["--workdir={DIR}", "--experiment=tiny_dflash",
                                       "--target=nope"], PRESET),
    ("launch/train.py", "--data"): (["--workdir={DIR}", "--experiment=tiny_dflash",
                                     "--data={DIR}.jsonl"], "does not exist"),
    ("launch/train.py", "--stop_at"): (["--workdir={DIR}", "--experiment=tiny_dflash",
                                        "--stop_at=-5"], "must be a step >= 1, got -5"),
    ("launch/train.py", "--coordinator_address"): (
        ["--workdir={DIR}", "--coordinator_address=host"], "expected HOST:PORT"),
    ("launch/train.py", "--num_processes"): (["--workdir={DIR}", "--num_processes=0"],
                                             "--num_processes"),
    ("launch/train.py", "--process_id"): (["--workdir={DIR}", "--process_id=-1"],
                                          "--process_id"),
    ("launch/train.py", "--cpu_collectives"): (["--workdir={DIR}", "--cpu_collectives=x"],
                                               "--cpu_collectives"),
    # ---- launch/evaluate.py
    ("launch/evaluate.py", "--model"): (["--drafter=d=random", "--model=nope",
                                         "--out={DIR}"], PRESET),
    ("launch/evaluate.py", "--drafter"): (["--drafter=bad"], "expected NAME=FOLDER"),
    ("launch/evaluate.py", "--baseline"): (["--drafter=d=random", "--baseline=nope"],
                                           "--baseline='nope' is not one of"),
    ("launch/evaluate.py", "--benchmarks"): (["--drafter=d=random", "--model=tiny-llama",
                                              "--benchmarks=nope", "--out={DIR}"],
                                             "unknown prompt set 'nope'"),
    ("launch/evaluate.py", "--temperatures"): (["--drafter=d=random", "--temperatures=0.7,x"],
                                               "--temperatures: expected a number"),
    ("launch/evaluate.py", "--prompts_per_benchmark"): (
        ["--drafter=d=random", "--prompts_per_benchmark=-1"], "--prompts_per_benchmark"),
    ("launch/evaluate.py", "--max_new_tokens"): (["--drafter=d=random", "--max_new_tokens=0"],
                                                 "--max_new_tokens"),
    ("launch/evaluate.py", "--verify_mode"): (["--drafter=d=random", "--verify_mode=x"],
                                              "--verify_mode"),
    ("launch/evaluate.py", "--batch_size"): (["--drafter=d=random", "--batch_size=0"],
                                             "--batch_size"),
    ("launch/evaluate.py", "--seed"): (["--drafter=d=random", "--seed=-1"], "--seed"),
    ("launch/evaluate.py", "--out"): (["--drafter=d=random", "--model=tiny-llama",
                                       "--out=gs://b/x"], "must be a local"),
    ("launch/evaluate.py", "--dtype"): (["--drafter=d=random", "--dtype=x"], "--dtype"),
    ("launch/evaluate.py", "--mesh"): (["--drafter=d=random", "--mesh=2,2"], "mesh '2,2'"),
    ("launch/evaluate.py", "--coordinator_address"): (
        ["--drafter=d=random", "--coordinator_address=h:x"], "expected HOST:PORT"),
    ("launch/evaluate.py", "--num_processes"): (["--drafter=d=random", "--num_processes=0"],
                                                "--num_processes"),
    ("launch/evaluate.py", "--process_id"): (["--drafter=d=random", "--process_id=-1"],
                                             "--process_id"),
    ("launch/evaluate.py", "--cpu_collectives"): (["--drafter=d=random",
                                                   "--cpu_collectives=x"], "--cpu_collectives"),
    # ---- launch/make_data.py
    ("launch/make_data.py", "--model"): (["--out={DIR}", "--model=nope"], PRESET),
    ("launch/make_data.py", "--out"): (["--out={FILE}"], "is a file, not a folder"),
    ("launch/make_data.py", "--pools"): (["--out={DIR}", "--model=tiny-smollm2",
                                          "--pools=nope"], "unknown prompt set 'nope'"),
    ("launch/make_data.py", "--limit"): (["--out={DIR}", "--limit=0"], "--limit"),
    ("launch/make_data.py", "--gen_temperatures"): (["--out={DIR}", "--gen_temperatures=-1"],
                                                    "--gen_temperatures: must be >= 0"),
    ("launch/make_data.py", "--verify_temperatures"): (
        ["--out={DIR}", "--verify_temperatures=nan"], "--verify_temperatures: expected a "
        "finite"),
    ("launch/make_data.py", "--top_k"): (["--out={DIR}", "--top_k=-1"], "--top_k"),
    ("launch/make_data.py", "--top_p"): (["--out={DIR}", "--top_p=0"], "--top_p: must be > 0"),
    ("launch/make_data.py", "--max_new_tokens"): (["--out={DIR}", "--max_new_tokens=0"],
                                                  "--max_new_tokens"),
    ("launch/make_data.py", "--max_prompt_tokens"): (["--out={DIR}", "--max_prompt_tokens=0"],
                                                     "--max_prompt_tokens"),
    ("launch/make_data.py", "--batch_size"): (["--out={DIR}", "--batch_size=0"],
                                              "--batch_size"),
    ("launch/make_data.py", "--shard_size"): (["--out={DIR}", "--shard_size=0"],
                                              "--shard_size"),
    ("launch/make_data.py", "--seed"): (["--out={DIR}", "--seed=-1"], "--seed"),
    ("launch/make_data.py", "--max_shards"): (["--out={DIR}", "--max_shards=0"],
                                              "--max_shards"),
    ("launch/make_data.py", "--dtype"): (["--out={DIR}", "--dtype=x"], "--dtype"),
    ("launch/make_data.py", "--prompts_from"): (["--out={DIR}", "--model=tiny-llama",
                                                 "--prompts_from={DIR}2:0:1"], "no corpus at"),
    ("launch/make_data.py", "--mesh"): (["--out={DIR}", "--mesh=a,b,c"], "mesh 'a,b,c'"),
    ("launch/make_data.py", "--coordinator_address"): (
        ["--out={DIR}", "--coordinator_address=x"], "expected HOST:PORT"),
    ("launch/make_data.py", "--num_processes"): (["--out={DIR}", "--num_processes=0"],
                                                 "--num_processes"),
    ("launch/make_data.py", "--process_id"): (["--out={DIR}", "--process_id=-1"],
                                              "--process_id"),
    ("launch/make_data.py", "--cpu_collectives"): (["--out={DIR}", "--cpu_collectives=x"],
                                                   "--cpu_collectives"),
}

# flags with no value to check: on / off
SWITCHES = {
    ("dblast", "--debug"), ("dblast generate", "--no-chat"), ("dblast generate", "--json"),
    ("dblast generate", "--warmup"), ("dblast export", "--force"),
    ("dblast export", "--remote-code"), ("dblast eval", "--no-progress"),
    ("dblast eval", "--auto-distributed"), ("dblast validate", "--no-progress"),
    ("dblast validate", "--auto-distributed"), ("dblast demo", "--tiny"),
    ("dblast demo", "--no-progress"), ("dblast data regenerate", "--no-progress"),
    ("dblast data regenerate", "--auto-distributed"), ("dblast data stats", "--json"),
    ("dblast data stats", "--no-verify"), ("dblast data self-prompts", "--no-progress"),
    *{(launcher, flag) for launcher in ("launch/train.py", "launch/evaluate.py",
                                         "launch/make_data.py")
      for flag in ("--debug", "--progress", "--auto_distributed")},
    ("launch/train.py", "--list_experiments"), ("launch/train.py", "--memory_report"),
}
# flags whose value is any text (non-UTF-8 bytes are refused for every argument)
FREE_TEXT = {
    ("dblast generate", "--prompt"): "a prompt",
    ("dblast data regenerate", "--system"): "a system message",
    ("dblast data self-prompts", "--system"): "a system message",
    ("launch/make_data.py", "--system"): "a system message",
}

LAUNCHERS = ("launch/train.py", "launch/evaluate.py", "launch/make_data.py")


def _dblast_flags() -> set:
    """(program, flag) of every argument of `dblast` and its sub-commands."""
    found = set()

    def walk(parser, prog):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{prog} {name}")
            elif not isinstance(action, argparse._HelpAction):
                found.add((prog, action.option_strings[0] if action.option_strings
                           else action.dest))
    walk(cli.build_parser(), "dblast")
    return found


def _is_switch_dblast(prog: str, flag: str) -> bool:
    parser = cli.build_parser()
    for word in prog.split()[1:]:
        parser = next(a for a in parser._actions
                      if isinstance(a, argparse._SubParsersAction)).choices[word]
    action = next(a for a in parser._actions
                  if (a.option_strings[:1] or [a.dest])[0] == flag)
    return action.nargs == 0


# The launchers' flags and rows, in one process: each launcher is loaded in turn, its absl
# flags parsed row after row through errors.run_absl (as `python launch/X.py ARGS` would),
# then its flags are removed so that the next launcher can define its own.
_DRIVER = textwrap.dedent("""
    import contextlib, io, json, runpy, sys
    from absl import flags
    from dblast_jax import errors, generation
    from dblast_jax.train import trainer
    jobs = json.loads(sys.argv[1])

    def only_tiny(load):  # a row that got as far as loading a real model is a failed row
        def load_target(name, *a, **k):
            if name not in ALLOWED:
                raise AssertionError(f"the row got as far as loading {name!r}")
            return load(name, *a, **k)
        return load_target

    ALLOWED = %r
    generation.load_target = trainer.load_target = only_tiny(generation.load_target)
    FLAGS = flags.FLAGS
    out = {}
    for launcher, rows in jobs.items():
        module = runpy.run_path(launcher, run_name="audited_launcher")
        mine = {f.name: type(f).__name__ for m, fl in FLAGS.flags_by_module_dict().items()
                if m in ("audited_launcher", "dblast_jax.distributed") for f in fl}
        results = []
        for argv in rows:
            FLAGS.unparse_flags()
            sys.argv = [launcher, *argv]
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    errors.run_absl(module["main"], launcher)
                    status = 0
                except SystemExit as e:
                    status = e.code
            results.append([status, err.getvalue()])
        out[launcher] = {"flags": mine, "results": results}
        FLAGS.unparse_flags()
        for name in mine:
            delattr(FLAGS, name)
    print(json.dumps(out))
""")


ALLOWED_MODELS = ("nope", "tiny-llama", "tiny-qwen3", "tiny-smollm2")
_DRIVER = _DRIVER.replace("%r", repr(ALLOWED_MODELS))


def _run_launchers(jobs):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("DBLAST_DEBUG", None)
    done = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(jobs)], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit")
    (root / "afile").write_text("not a folder")
    return {"{FILE}": str(root / "afile"), "{DIR}": str(root / "new")}


def _fill(argv, places):
    out = []
    for arg in argv:
        for key, value in places.items():
            arg = arg.replace(key, value)
        out.append(arg)
    return out


def _check_one_line(status, err, needle, what):
    assert status == 2, (what, status, err[-2000:])
    assert "Traceback" not in err, (what, err[-2000:])
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, (what, err[-2000:])
    assert "error: " in lines[0] and needle in lines[0], (what, needle, lines[0])


@pytest.fixture(scope="module")
def launcher_runs(places):
    """{launcher: its flags (name -> absl flag type) and its rows' (status, stderr)}."""
    keys = {launcher: sorted(k for k in TABLE if k[0] == launcher) for launcher in LAUNCHERS}
    runs = _run_launchers({launcher: [_fill(TABLE[k][0], places) for k in keys[launcher]]
                           for launcher in LAUNCHERS})
    return {launcher: (runs[launcher]["flags"], dict(zip(keys[launcher],
                                                         runs[launcher]["results"])))
            for launcher in LAUNCHERS}


def test_every_flag_is_audited(launcher_runs):
    flags = _dblast_flags()
    for launcher, (names, _) in launcher_runs.items():
        flags |= {(launcher, f"--{n}") for n in names}
    known = set(TABLE) | SWITCHES | set(FREE_TEXT)
    missing = sorted(flags - known)
    assert not missing, ("flags without an audit row: add (bad value, message) to TABLE, "
                         f"or list them in SWITCHES / FREE_TEXT: {missing}")
    assert not sorted(known - flags), f"audit rows of flags that no longer exist: " \
                                      f"{sorted(known - flags)}"
    for prog, flag in SWITCHES:  # really switches
        if prog.startswith("dblast"):
            assert _is_switch_dblast(prog, flag), (prog, flag)
        else:
            assert launcher_runs[prog][0][flag[2:]] == "BooleanFlag", (prog, flag)


@pytest.mark.parametrize("key", sorted(k for k in TABLE if k[0].startswith("dblast")),
                         ids=lambda k: f"{k[0][7:] or 'dblast'}{k[1]}")
def test_dblast_flag_refuses_a_bad_value_in_one_line(key, places, capsys, monkeypatch):
    from dblast_jax import generation
    from dblast_jax.train import trainer
    real = generation.load_target

    def only_tiny(name, *a, **k):  # a row that got as far as a real model is a failed row
        assert name in ALLOWED_MODELS, f"{key}: the row got as far as loading {name!r}"
        return real(name, *a, **k)

    def no_demo(*a, **k):
        raise AssertionError(f"{key}: the row got as far as running the demo")

    monkeypatch.setattr(generation, "load_target", only_tiny)
    monkeypatch.setattr(trainer, "load_target", only_tiny)
    monkeypatch.setattr(cli, "run_demo", no_demo)
    monkeypatch.delenv("DBLAST_DEBUG", raising=False)
    argv, needle = TABLE[key]
    status = cli.main(_fill(argv, places))
    _check_one_line(status, capsys.readouterr().err, needle, key)
    assert not os.path.exists(places["{DIR}"]), key  # nothing written


def test_launcher_flags_refuse_bad_values_in_one_line(launcher_runs, places):
    for launcher, (_, results) in launcher_runs.items():
        for key, (status, err) in results.items():
            _check_one_line(status, err, TABLE[key][1], key)
    assert not os.path.exists(places["{DIR}"])
