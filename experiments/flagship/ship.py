"""Ship a flagship chain's latest export as a pretrained drafter: re-export KEEP/drafter
with the token counts of its last leg's training data (the ranking `@draft_vocab=N` takes
its tokens from), copy it into pretrained/ under NAME and record in the manifest how it was
made: the chain's steps and training CPU-s (its first leg's starting drafter included),
every corpus its legs trained on, and the commands that rebuild it.

    python experiments/flagship/ship.py --keep=experiments/flagship/k1 \\
        --name=smollm2-dflash-k1 --out=runs/ship/smollm2-dflash-k1

A chain with no finished leg, or whose export is missing, is refused before anything is
written; the manifest is written atomically (dblast_jax.pretrained.add_pretrained).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "budget"))
from curve_file import read_curve  # noqa: E402  (no flags)

FLAGS = flags.FLAGS
# this checkout's pretrained/: an editable install may import dblast_jax from another clone
REPO_PRETRAINED = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                                "pretrained"))
flags.DEFINE_string("keep", None, "the chain's committed folder (KEEP/drafter, "
                    "KEEP/legs.jsonl)", required=True)
flags.DEFINE_string("name", None, "the pretrained drafter's name", required=True)
flags.DEFINE_string("out", None, "where the re-export with token counts is written "
                    "first (a scratch folder)", required=True)
flags.DEFINE_string("target", "smollm2-135m-instruct", "the drafter's target model")
flags.DEFINE_integer("prior_steps", 2000, "training steps of the chain's first starting "
                     "drafter (the K = 1 shipped before the flagship: 2,000; for a chain "
                     "grown from the 1-layer K = 1 chain, that chain's steps at the branch)")
flags.DEFINE_string("root", None, "the pretrained tree (default: the pretrained/ of the "
                    "repository this script is in, whichever checkout dblast_jax is "
                    "imported from)")


def chain_summary(keep: str, prior_steps: int) -> dict:
    """What the chain's legs.jsonl says about how its latest export was made."""
    legs = read_curve(os.path.join(keep, "legs.jsonl"))
    if not legs:
        raise ValueError(f"{keep}/legs.jsonl records no finished leg: nothing to ship")
    first = legs[0]
    prior_cpu_s = float(first.get("prior_cpu_s", 2100))
    datas = []
    for leg in legs:
        data = leg.get("data", "corpora/smollm2_t1")
        if data not in datas:
            datas.append(data)
    last = legs[-1]
    return {
        "legs": len(legs),
        "steps": prior_steps + sum(int(leg["steps"]) for leg in legs),
        "training_cpu_s": round(prior_cpu_s + sum(float(leg["training_cpu_s"])
                                                  for leg in legs)),
        "datas": datas,
        "last_data": last.get("data", "corpora/smollm2_t1"),
        "k": int(last.get("k", 1)),
        "drafter_layers": int(last.get("drafter_layers", 1)),
        "seq_len": int(last.get("seq_len", 256)),
        "held_out": last.get("end", {}),
        "init": first.get("init", ""),
    }


def main(argv):
    del argv
    from dblast_jax import pretrained

    drafter = os.path.join(FLAGS.keep, "drafter")
    if not os.path.isfile(os.path.join(drafter, "config.json")):
        raise SystemExit(f"no export to ship: {drafter}/config.json is missing")
    try:
        chain = chain_summary(FLAGS.keep, FLAGS.prior_steps)
    except ValueError as e:
        raise SystemExit(str(e))
    if not os.path.exists(chain["last_data"]):
        raise SystemExit(f"the last leg's training data {chain['last_data']} (its token "
                         "counts) is missing: train_on_grown_corpus.sh merges it again")
    done = subprocess.run(["dblast", "export", drafter, "--out", FLAGS.out, "--target",
                           FLAGS.target, "--dtype", "bfloat16", "--token-counts-from",
                           chain["last_data"]])
    if done.returncode != 0:
        raise SystemExit(f"dblast export of {drafter} to {FLAGS.out} failed (exit "
                         f"{done.returncode}); nothing was shipped")
    chain_name = os.path.basename(os.path.normpath(FLAGS.keep))
    layers = chain["drafter_layers"]
    k = chain["k"]
    kind = ("K = 1 DFlash drafter" if k == 1 else
            f"K = {k} DBlast drafter (the latent mixture, verified against the whole mixture)")
    held = chain["held_out"]
    grown = (chain["init"] and os.path.normpath(os.path.dirname(chain["init"]))
             != os.path.normpath(FLAGS.keep) and not chain["init"].startswith("pretrained"))
    start = (f", its first leg started from {chain['init']} (a drafter of "
             f"{FLAGS.prior_steps:,} steps)" if grown else "")
    info = {
        "description": (
            f"{kind}, block 8, {layers} layer{'s' if layers > 1 else ''} reading five target "
            "taps (1, 7, 14, 20, 27), mask token 16 (<empty_output>)"
            + (": a plain DFlash checkpoint" if k == 1 else "")
            + f". The flagship run {FLAGS.keep}{start}: {chain['legs']} "
            f"leg{'s' if chain['legs'] > 1 else ''} of NLL + AL + top-64 "
            "distillation with the sampled training head (4,096 + 1,024 tokens) on the "
            "greedy and sampled SmolLM2 answers, "
            f"{chain['steps']:,} steps and {chain['training_cpu_s'] / 3600:.1f} training "
            "CPU-hours in all (bfloat16)"),
        "experiment": "smollm2_k1_al" if k == 1 else f"smollm2_dblast_k{k}_al",
        "steps": chain["steps"],
        "training_cpu_s": chain["training_cpu_s"],
        "data": ("training: " + ", ".join(chain["datas"]) + " (merged by "
                 "experiments/flagship/train_on_grown_corpus.sh from corpora/smollm2_t0, "
                 "corpora/smollm2_t1 and the grown sampled passes corpora/smollm2_t1_more*, "
                 "held-out prompts left out); held out: corpora/smollm2_t1 shards 68-71"),
        "command": (f"{'K=' + str(k) + ' ' if k != 1 else ''}"
                    f"{'LAYERS=' + str(layers) + ' ' if layers != 1 else ''}"
                    "bash experiments/flagship/train_on_grown_corpus.sh  # the next leg; "
                    f"{chain['legs']} leg{'s' if chain['legs'] > 1 else ''}, each run by "
                    "experiments/flagship/train_k1.sh with "
                    f"the corpus, steps and window recorded in {FLAGS.keep}/legs.jsonl; then "
                    f"python experiments/flagship/ship.py --keep={FLAGS.keep} "
                    f"--name={FLAGS.name} --out=OUT"
                    + (f" --prior_steps={FLAGS.prior_steps}" if FLAGS.prior_steps != 2000
                       else "")),
        "token_counts": (f"response-token counts of {chain['last_data']} (the last leg's "
                         "training data): the ranking of `@draft_vocab=N`"),
        "results": (f"RESULTS.md (the shipped drafters); {FLAGS.keep}/README.md; "
                    "docs/research_log.md"),
        "held_out_at_last_leg_end": {key: held[key] for key in
                                     ("al_estimate", "al_estimate_mixture",
                                      "hot/al_estimate", "hot/al_estimate_mixture",
                                      "greedy/greedy_accepted")
                                     if key in held},
        "verify_temperature": 1.0,
        "chain": chain_name,
    }
    dest = pretrained.add_pretrained(FLAGS.name, FLAGS.out, target=FLAGS.target, info=info,
                                     root=FLAGS.root or REPO_PRETRAINED)
    print(f"shipped {FLAGS.keep}/drafter as pretrained:{FLAGS.name} in {dest}")
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    app.run(main)
