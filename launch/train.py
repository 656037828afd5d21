"""Train a drafter: an experiment by name, flag overrides, a workdir; 1 CPU to a TPU pod.

    python launch/train.py --experiment=tiny_dblast_k4_al --workdir=/tmp/run
    python launch/train.py --workdir=/tmp/run              # resume: the workdir alone
    python launch/train.py --experiment=smollm2_dblast_k4_al --data=corpus.jsonl \
        --override=num_steps=500 --override=batch_size=4 --workdir=runs/k4
    # multi-host (run once per process / host; CPU hosts use gloo collectives):
    python launch/train.py ... --coordinator_address=host0:1234 --num_processes=2 --process_id=0

See launch/README.md for TPU pod and single-GPU commands.

An expected failure (unknown experiment, bad flag, missing / malformed file) prints one line
and exits with status 2; --debug (or DBLAST_DEBUG=1) shows the traceback.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

try:
    import dblast_jax  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dblast_jax import distributed, errors  # noqa: E402  (after the checkout fallback)

FLAGS = flags.FLAGS
flags.DEFINE_bool("debug", False, "show the traceback of every error, expected ones too "
                  "(also: DBLAST_DEBUG=1)")
flags.DEFINE_string("experiment", None, "experiment name (see --list_experiments); optional "
                    "when --workdir already holds a run (resume)")
flags.DEFINE_multi_string("override", [], "key=value for any TrainConfig field (repeatable); "
                          "the drafter's as drafter.FIELD (drafter.num_categories=4; the "
                          "flat names of before, e.g. num_categories=4, remain accepted)")
flags.DEFINE_string("workdir", None, "run directory: checkpoints, metrics.jsonl, export/")
flags.DEFINE_string("mesh", None, "data,fsdp,tensor mesh shape, e.g. 8,1,1 or -1,1,1")
flags.DEFINE_string("target", None, "target preset / HF folder / .gguf (overrides config)")
flags.DEFINE_string("data", None, "'synthetic' or a .jsonl corpus (overrides config)")
distributed.define_cluster_flags()
flags.DEFINE_integer("stop_at", None, "stop (with a checkpoint) after this step, as a "
                     "preemption would; rerun to resume")
flags.DEFINE_bool("progress", True, "tqdm progress bar (process 0)")
flags.DEFINE_bool("list_experiments", False, "print the registered experiments and exit")
flags.DEFINE_bool("memory_report", False, "compile one train step for the config (nothing "
                  "runs) and print XLA's memory analysis with the configured vocabulary chunk "
                  "and with one chunk of the whole vocabulary (unchunked logits); then exit")


def build_config():
    from dblast_jax.train import checkpoint as ckpt_lib
    from dblast_jax.train.config import TrainConfig, apply_overrides, get_experiment

    saved = ckpt_lib.read_train_config(FLAGS.workdir) if FLAGS.workdir else None
    if FLAGS.experiment:
        config = get_experiment(FLAGS.experiment, FLAGS.override)
    elif saved is not None:
        config = apply_overrides(TrainConfig.from_dict(saved), FLAGS.override)
    else:
        raise app.UsageError(f"--workdir {FLAGS.workdir!r} holds no run; pass --experiment "
                             "(see --list_experiments)")
    changes = {}
    if FLAGS.target:
        changes["target"] = FLAGS.target
    if FLAGS.data:
        changes["data"] = FLAGS.data
    if FLAGS.mesh:
        try:
            changes["mesh"] = tuple(int(x) for x in FLAGS.mesh.split(","))
        except ValueError:
            raise app.UsageError(f"--mesh={FLAGS.mesh!r}: expected data,fsdp,tensor integers, "
                                 "e.g. --mesh=-1,1,1") from None
    return config.replace(**changes) if changes else config


def target_config_only(name: str):
    """The target's config without loading weights (for --memory_report)."""
    from dblast_jax.config import TargetConfig
    from dblast_jax.generation import TINY_PRESETS

    known = {"smollm2-135m-instruct": TargetConfig.smollm2_135m, "qwen3-4b": TargetConfig.qwen3_4b,
             "qwen3-8b": TargetConfig.qwen3_8b, **TINY_PRESETS}
    if name in known:
        return known[name]()
    from dblast_jax.io.hf import load_hf_config
    return load_hf_config(name)


def memory_report(config) -> None:
    from dblast_jax.train.trainer import step_memory_analysis

    tcfg = target_config_only(config.target)
    rows = []
    for chunk in (config.logits_chunk_size, tcfg.vocab_size):
        m = step_memory_analysis(config.replace(logits_chunk_size=chunk), tcfg)
        rows.append((chunk, m))
        print(json.dumps({"logits_chunk_size": chunk, **{k: v / 2**20 for k, v in m.items()},
                          "unit": "MiB"}), flush=True)
    (_, a), (_, b) = rows
    print(json.dumps({"unchunked_over_chunked": {"temp": b["temp"] / a["temp"],
                                                  "total": b["total"] / a["total"]}}))


def main(argv):
    del argv
    if FLAGS.list_experiments:
        from dblast_jax.train.config import EXPERIMENTS, describe
        for name, cfg in sorted(EXPERIMENTS.items()):
            print(f"{name}:\n  " + describe(cfg).replace("\n", "\n  "))
        return 0
    if FLAGS.memory_report:
        if not FLAGS.experiment:
            raise app.UsageError("--memory_report needs --experiment")
        memory_report(build_config())
        return 0
    if not FLAGS.workdir:
        raise app.UsageError("--workdir is required")
    from absl import logging
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint phase at INFO
    distributed.initialize_from(FLAGS)
    import jax

    from dblast_jax.train.trainer import train

    config = build_config()
    if jax.process_index() == 0:
        print(f"[train] {config.name}: {jax.process_count()} process(es), "
              f"{jax.device_count()} device(s), mesh {config.mesh}, workdir {FLAGS.workdir}",
              flush=True)
    # a foreign checkpoint, a missing corpus, a full disk...: one line, status 2 (run_absl)
    result = train(config, FLAGS.workdir, stop_at=FLAGS.stop_at, progress=FLAGS.progress)
    if jax.process_index() == 0:
        last = result.history[-1] if result.history else {}
        print(json.dumps({"step": result.step, "export": result.export_path,
                          "timing": result.timing,
                          "last": {k: last.get(k) for k in ("loss", "nll", "al_estimate",
                                                            "al_estimate_mixture", "top1_mean")}}),
              flush=True)
    return 0


if __name__ == "__main__":
    errors.run_absl(main, "launch/train.py")
