"""Record a finished leg of a flagship run (experiments/flagship/train_k1.sh) in the
committed folder KEEP: its drafter exported to KEEP/drafter (bfloat16, the next leg's
starting point), its held-out points copied to KEEP/curve_legN.jsonl, and one row in
KEEP/legs.jsonl, written last (a kill before it repeats the whole step on the next call).
A leg whose schedule has not finished is left alone (exit 1).

    python experiments/flagship/finish_leg.py --leg_dir=runs/flagship/k1_leg1 \\
        --keep=experiments/flagship/k1 --leg=1
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "budget"))
from budget_curve import read_curve  # noqa: E402  (the one reader of curve files)

FLAGS = flags.FLAGS
flags.DEFINE_string("leg_dir", None, "the leg's training workdir", required=True)
flags.DEFINE_string("keep", None, "the committed folder of the run", required=True)
flags.DEFINE_integer("leg", None, "the leg's number (1, 2, ...)", required=True)


def main(argv) -> int:
    from dblast_jax.io.atomic import atomic_write_text
    from dblast_jax.train.restore import export_workdir

    legs_path = os.path.join(FLAGS.keep, "legs.jsonl")
    legs = read_curve(legs_path)
    if any(row["leg"] == FLAGS.leg for row in legs):
        print(f"leg {FLAGS.leg} is already recorded in {legs_path}")
        return 0
    with open(os.path.join(FLAGS.leg_dir, "leg.json")) as f:
        leg = json.load(f)
    rows = read_curve(FLAGS.leg_dir)
    if not rows or rows[-1]["step"] < leg["steps"]:
        done = rows[-1]["step"] if rows else 0
        print(f"leg {FLAGS.leg} has trained {done} of {leg['steps']} steps; rerun "
              "train_k1.sh to finish it", file=sys.stderr)
        return 1
    export_workdir(FLAGS.leg_dir, os.path.join(FLAGS.keep, "drafter"), dtype="bfloat16",
                   force=True)
    curve = os.path.join(FLAGS.keep, f"curve_leg{FLAGS.leg}.jsonl")
    atomic_write_text(curve, "".join(json.dumps(r) + "\n" for r in rows))
    keep = ("al_estimate", "top1", "greedy_accepted", "block_nll")
    record = {"leg": FLAGS.leg, "init": leg["init"], "steps": leg["steps"],
              "training_cpu_s": rows[-1]["cpu_s"],
              "start": {k: rows[0][k] for k in keep if k in rows[0]},
              "end": {k: rows[-1][k] for k in keep if k in rows[-1]},
              "finished": time.strftime("%Y-%m-%d", time.gmtime(rows[-1]["time"]))}
    atomic_write_text(legs_path, "".join(json.dumps(r) + "\n" for r in legs + [record]))
    print(f"leg {FLAGS.leg}: held-out AL {record['start'].get('al_estimate'):.4f} -> "
          f"{record['end'].get('al_estimate'):.4f}; recorded in {legs_path}")
    return 0


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
