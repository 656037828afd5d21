"""Make (or resume / grow) a regenerated training corpus.

    python launch/make_data.py --out=data/smollm2-T1 --gen_temperatures=1.0 \
        --verify_temperatures=0.7,1.0,1.5 --max_new_tokens=512 --batch_size=8

Re-running with the same flags skips finished shards; --max_shards bounds one run.
Several processes (one per host of a pod, say) share the shards: run the same command on
each with --auto_distributed, or --coordinator_address / --num_processes / --process_id
(as launch/train.py); --out must then be one shared folder. --mesh=-1,1,1 splits each
batch over this process's devices. launch/README.md has a TPU pod recipe.
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
from dblast_jax.data.cli_commands import run_regenerate  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_bool("debug", False, "show the traceback of every error, expected ones too "
                  "(also: DBLAST_DEBUG=1)")
flags.DEFINE_string("model", "smollm2-135m-instruct", "preset, HF folder or .gguf file")
flags.DEFINE_string("out", None, "corpus folder", required=True)
flags.DEFINE_list("pools", None, "training pools (default: all)")
flags.DEFINE_integer("limit", None, "first N prompts of the shuffled pools", lower_bound=1)
flags.DEFINE_list("gen_temperatures", ["1.0"], "sampling temperatures")
flags.DEFINE_list("verify_temperatures", ["1.0"], "temperatures to store log-probs at")
flags.DEFINE_integer("top_k", 0, "0 disables", lower_bound=0)
flags.DEFINE_float("top_p", 1.0, "1.0 disables")
flags.DEFINE_integer("max_new_tokens", 512, "answer length limit", lower_bound=1)
flags.DEFINE_integer("max_prompt_tokens", 1024, "longer prompts are skipped", lower_bound=1)
flags.DEFINE_integer("batch_size", 8, "prompts per generate call", lower_bound=1)
flags.DEFINE_integer("shard_size", 256, "prompts per shard", lower_bound=1)
flags.DEFINE_integer("seed", 0, "sampling and prompt-order seed", lower_bound=0)
flags.DEFINE_integer("max_shards", None, "stop after this many new shards", lower_bound=1)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "parameter dtype")
flags.DEFINE_string("system", None, "system message")
flags.DEFINE_string("prompts_from", None, "CORPUS:A:B: answer the prompts of that corpus's "
                    "shards A .. B-1 instead of the training pools")
flags.DEFINE_string("mesh", None, "data,fsdp,tensor mesh over this process's devices, e.g. "
                    "-1,1,1")
distributed.define_cluster_flags()
flags.DEFINE_bool("progress", True, "tqdm progress bar (process 0)")


def main(argv):
    del argv
    errors.check_float_flags([("gen_temperatures", FLAGS.gen_temperatures),
                              ("verify_temperatures", FLAGS.verify_temperatures)],
                             minimum=0.0, example="1.0")
    errors.check_float_flags([("top_p", FLAGS.top_p)], minimum=0.0, strict=True, maximum=1.0,
                             example="0.95")
    import jax

    distributed.initialize_from(FLAGS)
    m = run_regenerate(
        FLAGS.model, FLAGS.out, pools=FLAGS.pools, limit=FLAGS.limit,
        gen_temperatures=[float(t) for t in FLAGS.gen_temperatures],
        verify_temperatures=[float(t) for t in FLAGS.verify_temperatures],
        top_k=FLAGS.top_k, top_p=FLAGS.top_p, max_new_tokens=FLAGS.max_new_tokens,
        max_prompt_tokens=FLAGS.max_prompt_tokens, batch_size=FLAGS.batch_size,
        shard_size=FLAGS.shard_size, seed=FLAGS.seed, max_shards=FLAGS.max_shards,
        dtype=FLAGS.dtype, system=FLAGS.system, prompts_from=FLAGS.prompts_from,
        mesh=FLAGS.mesh, progress=FLAGS.progress)
    if jax.process_index() != 0:
        return
    t = m["totals"]
    print(f"{FLAGS.out}: {t['shards']}/{m['num_shards']} shards, {t['sequences']} sequences, "
          f"{t['tokens']} tokens; complete={m['complete']}; {m['wall_seconds_this_run']} s")


if __name__ == "__main__":
    errors.run_absl(main, "launch/make_data.py")
