"""Record a finished leg of a flagship run (experiments/flagship/train_k1.sh) in the
committed folder KEEP: its drafter exported to KEEP/drafter (bfloat16, the next leg's
starting point), its held-out points copied to KEEP/curve_legN.jsonl, and one row in
KEEP/legs.jsonl, written last (a kill before it repeats the whole step on the next call),
then the run's learning curve redrawn (KEEP/learning_curve.png: held-out acceptance
against cumulative training CPU-hours, log x, every leg's raw points).
A leg whose schedule has not finished is left alone (exit 1).

    python experiments/flagship/finish_leg.py --keep=experiments/flagship/k1 --plot_only

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
from curve_file import read_curve  # noqa: E402  (the one reader of curve files; no flags)

FLAGS = flags.FLAGS
flags.DEFINE_string("leg_dir", None, "the leg's training workdir")
flags.DEFINE_string("keep", None, "the committed folder of the run", required=True)
flags.DEFINE_integer("leg", None, "the leg's number (1, 2, ...)")
flags.DEFINE_float("prior_cpu_s", 2100.0, "training CPU-s spent on the first leg's "
                   "starting drafter before the run (the shipped K = 1: ~2,100 in two "
                   "1,000-step stages); the x offset of the curve, so that log x holds leg 1")
flags.DEFINE_bool("plot_only", False, "only redraw KEEP/learning_curve.png")
flags.DEFINE_string("reference", None, "another chain's committed folder drawn in grey "
                    "on the same axis (the 1-layer run beside the depth run)")


def held_out_al(row: dict) -> float:
    """A curve point's held-out acceptance: the mixture's (drafts sampled from q, verified
    against the whole mixture) where the drafter has one (K > 1), which is the K = 1
    drafter's own otherwise."""
    return row.get("al_estimate_mixture", row["al_estimate"])


def chain_points(keep: str, prior_cpu_s: float) -> list[tuple[dict, list, list]]:
    """(leg row, cumulative training CPU-hours, held-out AL) of every recorded leg of a
    chain; a chain grown from another (the depth run) records in its first leg what its
    starting drafter cost, so both chains share one x axis."""
    legs = read_curve(os.path.join(keep, "legs.jsonl"))
    offset = legs[0].get("prior_cpu_s", prior_cpu_s) if legs else prior_cpu_s
    points = []
    for leg in legs:
        rows = read_curve(os.path.join(keep, f"curve_leg{leg['leg']}.jsonl"))
        points.append((leg, [(offset + r["cpu_s"]) / 3600 for r in rows],
                       [held_out_al(r) for r in rows]))
        offset += leg["training_cpu_s"]
    return points


def plot_learning_curve(keep: str, prior_cpu_s: float,
                        reference: str | None = None) -> str:
    """Held-out AL (T_v = 1.0) of every recorded leg against cumulative training
    CPU-hours on a log axis: where more compute still pays, and by how much. A reference
    chain (the 1-layer run, for the depth run) is drawn in grey on the same axis, so that
    the two compare at equal CPU."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = chain_points(keep, prior_cpu_s)
    if not points:
        raise ValueError(f"{keep}/legs.jsonl holds no finished leg to plot")
    fig, ax = plt.subplots(figsize=(7, 4))
    if reference:
        ref = chain_points(reference, prior_cpu_s)
        layers = ref[-1][0].get("drafter_layers", 1) if ref else 1
        for i, (_, x, y) in enumerate(ref):
            ax.plot(x, y, color="0.6", marker=".", linewidth=1,
                    label=f"{os.path.basename(reference)} ({layers} layer{'s' * (layers > 1)})"
                    if i == 0 else None)
    for leg, x, y in points:
        ax.plot(x, y, marker="o", label=f"leg {leg['leg']} ({leg['steps']:,} steps)")
    ax.set_xscale("log")
    ax.set_xlabel("cumulative training CPU-hours (log; includes the starting drafter's)")
    ax.set_ylabel("held-out expected accepted drafts / block\n(T_v = 1.0, b = 8; "
                  "K > 1: the mixture)")
    layers = points[-1][0].get("drafter_layers", 1)
    ax.set_title(f"K = 1 flagship, {layers} drafter layer{'s' if layers > 1 else ''}: "
                 "the learning curve (goal 0.9)")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    out = os.path.join(keep, "learning_curve.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv) -> int:
    from dblast_jax.io.atomic import atomic_write_text
    from dblast_jax.train.restore import export_workdir

    if FLAGS.plot_only:
        try:
            print(f"wrote {plot_learning_curve(FLAGS.keep, FLAGS.prior_cpu_s, FLAGS.reference)}")
        except ValueError as e:  # nothing recorded yet: one line, nothing written
            print(f"finish_leg: {e}", file=sys.stderr)
            return 1
        return 0
    if FLAGS.leg_dir is None or FLAGS.leg is None:
        raise app.UsageError("--leg_dir and --leg are required (or --plot_only)")
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
    metrics = ("al_estimate", "al_estimate_mixture", "top1", "greedy_accepted", "block_nll")
    # and the same metrics on the extra held-out sets (--extra_validation=NAME=...: NAME/key)
    keep = lambda row: [k for k in row if k.rsplit("/", 1)[-1] in metrics]
    record = {"leg": FLAGS.leg, "init": leg["init"], "steps": leg["steps"],
              "data": leg.get("data", "corpora/smollm2_t1"),
              "data_shards": leg.get("data_shards", 68), "seq_len": leg.get("seq_len", 256),
              "drafter_layers": leg.get("drafter_layers", 1), "k": leg.get("k", 1),
              # the chain's x-axis origin (chain_points) and, for a chain grown from the
              # 1-layer K = 1 chain, how many of its legs it grew from (the pass rotation
              # counts them): read from its first leg only
              **{k: leg[k] for k in ("prior_cpu_s", "trunk_legs")
                 if k in leg and FLAGS.leg == 1},
              # the chain's one cosine this leg followed (none: a warm restart)
              **{k: leg[k] for k in ("schedule_steps", "schedule_offset", "learning_rate")
                 if leg.get(k)},
              "training_cpu_s": rows[-1]["cpu_s"],
              "start": {k: rows[0][k] for k in keep(rows[0])},
              "end": {k: rows[-1][k] for k in keep(rows[-1])},
              "finished": time.strftime("%Y-%m-%d", time.gmtime(rows[-1]["time"]))}
    atomic_write_text(legs_path, "".join(json.dumps(r) + "\n" for r in legs + [record]))
    print(f"leg {FLAGS.leg}: held-out AL {record['start'].get('al_estimate'):.4f} -> "
          f"{record['end'].get('al_estimate'):.4f}; recorded in {legs_path}")
    print(f"wrote {plot_learning_curve(FLAGS.keep, FLAGS.prior_cpu_s, FLAGS.reference)}")
    return 0


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
