"""Evaluate drafters: tau (empirical + expected), speedup, tables and plots; resumable.

    python launch/evaluate.py --drafters=base=drafters/k1,k4=drafters/k4 --baseline=base \
        --benchmarks=humaneval,mt-bench,gsm8k,creative-writing --temperatures=0.7,1.0,1.5 \
        --prompts_per_benchmark=32 --max_new_tokens=256 --out=eval/smollm2

Re-running with the same flags skips finished prompts (rows.jsonl in --out).
Several processes (one per host of a pod, say) share the units of work out: run the same
command on each with --auto_distributed, or --coordinator_address / --num_processes /
--process_id (as launch/train.py); --out must then be one shared folder, and process 0
writes the tables. --mesh lays out each process's own devices. launch/README.md has a pod
recipe.
An expected failure prints one line and exits with status 2; --debug (or DBLAST_DEBUG=1)
shows the traceback.
"""

import os
import sys

from absl import flags

try:
    import dblast_jax  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dblast_jax import distributed, errors  # noqa: E402  (after the checkout fallback)

FLAGS = flags.FLAGS
flags.DEFINE_bool("debug", False, "show the traceback of every error, expected ones too "
                  "(also: DBLAST_DEBUG=1)")
flags.DEFINE_string("model", "smollm2-135m-instruct", "target preset, HF folder or .gguf file")
flags.DEFINE_multi_string("drafter", None, "NAME=FOLDER[@mode=mixture,zt=0.5] or NAME=random-kN "
                          "(repeatable; '@' settings: this name's verify mode / category "
                          "temperature Z_T / a shorter block, block=N)", required=True)
flags.DEFINE_string("baseline", None, "drafter NAME the relative gains refer to")
flags.DEFINE_list("benchmarks", ["humaneval", "mt-bench", "gsm8k", "creative-writing"],
                  "evaluation sets")
flags.DEFINE_list("temperatures", ["0.7", "1.0", "1.5"], "target temperatures")
flags.DEFINE_integer("prompts_per_benchmark", 32, "first N prompts of each set (0 = all)",
                     lower_bound=0)
flags.DEFINE_integer("max_new_tokens", 256, "answer length per turn", lower_bound=1)
flags.DEFINE_enum("verify_mode", "greedy-branch", ["greedy-branch", "sampled-branch", "mixture"],
                  "verification mode")
flags.DEFINE_integer("batch_size", 1, "prompts per generate call (one result row per batch)",
                     lower_bound=1)
flags.DEFINE_integer("seed", 0, "sampling seed", lower_bound=0)
flags.DEFINE_string("out", "eval_out", "output folder (resumable)")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "parameter dtype")
flags.DEFINE_string("mesh", None, "data,fsdp,tensor mesh of this process's devices for "
                    "decoding (e.g. 2,2,2 or -1,1,1): prompts over data, weights over fsdp / "
                    "tensor")
distributed.define_cluster_flags()
flags.DEFINE_bool("progress", True, "tqdm progress bar (process 0)")


def main(argv):
    del argv
    import jax

    from dblast_jax.distributed import local_mesh
    from dblast_jax.dtypes import dtype_from_name
    from dblast_jax.evaluate import run_evaluation, table_markdown
    from dblast_jax.generation import load_target, named_drafters, on_mesh, parse_drafter_spec

    errors.check_float_flags([("temperatures", FLAGS.temperatures)], minimum=0.0,
                             example="0.7,1.0")
    names = [parse_drafter_spec(spec)[0] for spec in FLAGS.drafter]
    if FLAGS.baseline is not None and FLAGS.baseline not in names:  # before loading anything
        raise ValueError(f"--baseline={FLAGS.baseline!r} is not one of the --drafter names "
                         f"{names}; pass --baseline=NAME with one of them")
    dtype = dtype_from_name(FLAGS.dtype)
    distributed.initialize_from(FLAGS)
    mesh = local_mesh(FLAGS.mesh)  # this process's devices: each decodes its own units
    target = load_target(FLAGS.model, dtype=dtype)
    drafters = {name: on_mesh(d, mesh)
                for name, d in named_drafters(FLAGS.drafter, target, dtype).items()}
    target = on_mesh(target, mesh)
    results = run_evaluation(
        target, drafters, benchmarks=FLAGS.benchmarks,
        temperatures=[float(t) for t in FLAGS.temperatures],
        prompts_per_benchmark=FLAGS.prompts_per_benchmark or None,
        max_new_tokens=FLAGS.max_new_tokens, out_dir=FLAGS.out, baseline=FLAGS.baseline,
        seed=FLAGS.seed, verify_mode=FLAGS.verify_mode, batch_size=FLAGS.batch_size,
        progress=FLAGS.progress)
    if jax.process_index() != 0:  # process 0 merged the rows and wrote the results
        return
    print(table_markdown(results["tables"]["tau"]))
    print(f"results, tables and plots in {FLAGS.out}")


if __name__ == "__main__":
    errors.run_absl(main, "launch/evaluate.py")
