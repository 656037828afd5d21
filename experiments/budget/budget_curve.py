"""Held-out acceptance against CPU-seconds: the yardstick of a training recipe.

Trains one drafter in segments of --segment_steps and, after each, scores it on held-out
corpus shards (expected accepted drafts per block at T_v, sampled-branch, and the
sampled-mixture estimate). The x-axis is the CPU time of this process spent inside the
training steps only (time.process_time: every core counts, so a contended machine does not
inflate it the way wall time would); the feature-cache build and validation are timed
apart. Rows go to WORKDIR/budget_curve.jsonl; a killed run resumes from its checkpoint.

    python experiments/budget/budget_curve.py --experiment=smollm2_dflash_baseline \\
        --workdir=runs/budget/baseline --budget_cpu_s=1500 \\
        --override=data=corpora/smollm2_t1 --override=data_shards=68 ...
    python experiments/budget/budget_curve.py --plot=runs/budget/baseline,runs/budget/distill \\
        --out=experiments/budget/curve.png
    python experiments/budget/budget_curve.py --compare=runs/budget/baseline,runs/budget/distill

--compare=BASE,OTHER prints OTHER's points beside BASE's at the same step and at the same
training CPU-seconds (BASE linearly interpolated between its points; blank outside them).
"""

from __future__ import annotations

import os
import time

from absl import app, flags

from curve_file import CURVE, append_row, cpu_at_resume, read_curve

FLAGS = flags.FLAGS
flags.DEFINE_string("experiment", "smollm2_dflash_baseline", "registered experiment")
flags.DEFINE_multi_string("override", [], "key=value TrainConfig overrides")
flags.DEFINE_string("workdir", "", "training workdir (budget_curve.jsonl lands here)")
flags.DEFINE_integer("segment_steps", 50, "steps between held-out scores")
flags.DEFINE_integer("checkpoint_every", 0, "steps between checkpoints (0: one per "
                     "segment); a long segment loses at most this many steps to a kill")
flags.DEFINE_float("budget_cpu_s", 1500.0, "stop after this many training CPU-seconds")
flags.DEFINE_integer("max_steps", 100000, "the schedule's length (num_steps)")
flags.DEFINE_string("validation_data", "corpora/smollm2_t1", "held-out corpus")
flags.DEFINE_string("validation_shards", "68:72", "held-out shard range A:B")
flags.DEFINE_integer("validation_batches", 16, "held-out batches (fixed anchors)")
flags.DEFINE_multi_string("extra_validation", [], "NAME=CORPUS:A:B[@T_v]: another held-out "
                          "set scored with the main one (at the config's T_v, or at @T_v: the "
                          "corpus must store log-probs there); its numbers go into each row "
                          "as NAME/al_estimate, NAME/greedy_accepted, ... (e.g. "
                          "greedy=corpora/smollm2_t0_heldout:0:4: agreement with greedy text; "
                          "hot=corpora/smollm2_t1:68:72@1.5: the held-out set at T_v = 1.5)")
flags.DEFINE_list("plot", [], "workdirs to plot instead of training (NAME=DIR or DIR)")
flags.DEFINE_string("out", "budget_curve.png", "plot file (with --plot)")
flags.DEFINE_list("compare", [], "BASE,OTHER (workdirs or .jsonl, NAME=... allowed): a "
                  "table of OTHER against BASE at equal steps and at equal CPU-seconds")
flags.DEFINE_enum("plot_x", "cpu_s", ["cpu_s", "step"], "x-axis of --plot: training "
                  "CPU-seconds (the yardstick) or optimizer steps (curves from machines or "
                  "days whose CPU-seconds differ)")

def train_curve() -> None:
    from dblast_jax.train import config as TC
    from dblast_jax.train import trainer as TR
    from dblast_jax.train import validation as V

    extra_specs = {}  # checked before the trainer's (slow) setup
    for spec in FLAGS.extra_validation:
        name, sep, where = spec.partition("=")
        where, at, tv = where.partition("@")
        parts = where.rsplit(":", 2)
        try:
            tv = float(tv) if at else None
        except ValueError:
            tv = float("nan")
        if (not sep or not name or "/" in name or name in extra_specs or len(parts) != 3
                or not all(p.isdigit() for p in parts[1:])
                or (tv is not None and not 0 < tv < float("inf"))):
            raise app.UsageError(f"--extra_validation={spec!r}: expected NAME=CORPUS:A:B or "
                                 "NAME=CORPUS:A:B@T_v (a new NAME without '/', T_v > 0)")
        extra_specs[name] = (parts[0], f"{parts[1]}:{parts[2]}", tv)
    overrides = list(FLAGS.override) + [
        f"num_steps={FLAGS.max_steps}",
        f"checkpoint_every={FLAGS.checkpoint_every or FLAGS.segment_steps}",
        "validate_every=0", "export=false"]
    cfg = TC.get_experiment(FLAGS.experiment, overrides)
    os.makedirs(FLAGS.workdir, exist_ok=True)
    t0 = time.process_time()
    trainer = TR.Trainer(cfg, FLAGS.workdir, progress=False)
    setup_cpu = time.process_time() - t0
    held_out = V.make_validation_source(cfg, trainer.target_config,
                                        data=FLAGS.validation_data,
                                        shards=FLAGS.validation_shards)
    extra = {name: (V.make_validation_source(
        cfg if tv is None else cfg.replace(verify_temperature=tv), trainer.target_config,
        data=data, shards=shards), tv) for name, (data, shards, tv) in extra_specs.items()}
    rows = read_curve(FLAGS.workdir)
    # steps past the last row (a kill between a checkpoint and its row, a carried run)
    cpu = cpu_at_resume(rows, trainer.start_step, FLAGS.workdir)

    def score(step: int, seg_cpu: float) -> None:
        t = time.process_time()
        m = trainer.evaluate(held_out, FLAGS.validation_batches, step=step)
        keep = ("al_estimate", "al_estimate_mixture", "block_nll", "top1_mean", "top1",
                "accept_prefix", "distill_kl", "greedy_accepted")
        row = {"step": step, "cpu_s": cpu, "segment_cpu_s": seg_cpu,
               "setup_cpu_s": setup_cpu, "time": time.time(),
               **{k: m[k] for k in keep if k in m}}
        for name, (source, tv) in extra.items():
            e = trainer.evaluate(source, FLAGS.validation_batches, step=step,
                                 verify_temperature=tv)
            row.update({f"{name}/{k}": e[k] for k in keep if k in e})
        row["validation_cpu_s"] = time.process_time() - t
        append_row(FLAGS.workdir, row)
        print(f"step {step}  cpu {cpu:7.0f} s  AL {row['al_estimate']:.4f}  mixture "
              f"{row.get('al_estimate_mixture', float('nan')):.4f}  top1[0] "
              f"{row['top1'][0]:.3f}  greedy {row['greedy_accepted']:.3f}"
              + "".join(f"  {name} AL {row[f'{name}/al_estimate']:.4f} greedy "
                        f"{row[f'{name}/greedy_accepted']:.3f}" for name in extra), flush=True)

    if not rows:
        score(trainer.start_step, 0.0)
    while cpu < FLAGS.budget_cpu_s and trainer.start_step < cfg.num_steps:
        t = time.process_time()
        trainer.run(stop_at=trainer.start_step + FLAGS.segment_steps)
        seg = time.process_time() - t
        cpu += seg
        score(trainer.start_step, seg)
    trainer.close()


def plot_curves() -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for spec in FLAGS.plot:
        name, _, folder = spec.rpartition("=")
        rows = read_curve(folder)
        if not rows:
            raise ValueError(f"--plot {spec}: {folder} holds no {CURVE} rows (train it "
                             "first with --workdir)")
        name = name or os.path.basename(folder.rstrip("/")).removesuffix(".jsonl")
        x = [r[FLAGS.plot_x] for r in rows]
        line, = axes[0].plot(x, [r["al_estimate"] for r in rows], marker=".", label=name)
        mixture = [r.get("al_estimate_mixture", r["al_estimate"]) for r in rows]
        if any(abs(m - r["al_estimate"]) > 1e-6 for m, r in zip(mixture, rows)):  # K > 1
            axes[0].plot(x, mixture, marker=".", linestyle="--", color=line.get_color(),
                         label=f"{name} (sampled-mixture)")
        axes[1].plot(x, [r["top1"][0] for r in rows], marker=".", label=name)
    axes[0].set_ylabel("held-out expected accepted drafts / block (T_v = 1)\n"
                       "(solid: sampled-branch)")
    axes[1].set_ylabel("held-out top-1 agreement, first block slot")
    for ax in axes:
        ax.set_xlabel("training CPU-seconds" if FLAGS.plot_x == "cpu_s" else "training steps")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(FLAGS.out, dpi=110)
    print(f"wrote {FLAGS.out}")


def value_at(rows: list[dict], x: float, key: str = "al_estimate",
             axis: str = "cpu_s") -> float | None:
    """rows' `key` linearly interpolated at `axis` = x; None outside the rows' range."""
    pts = sorted((r[axis], r[key]) for r in rows if key in r)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[0][1] if pts and pts[0][0] == x else None


def compare_curves() -> None:
    if len(FLAGS.compare) != 2:
        raise app.UsageError(f"--compare takes BASE,OTHER, got {FLAGS.compare}")
    (base_name, base), (name, other) = (
        (n or os.path.basename(f.rstrip("/")).removesuffix(".jsonl"), read_curve(f))
        for n, _, f in (spec.rpartition("=") for spec in FLAGS.compare))
    for n, rows in ((base_name, base), (name, other)):
        if not rows:
            raise ValueError(f"--compare: {n} holds no {CURVE} rows")
    fmt = lambda v: "" if v is None else f"{v:.3f}"
    gain = lambda a, b: "" if a is None or b is None or b <= 0 else f"{100 * (a / b - 1):+.0f}%"
    print(f"| step | cpu_s | {name} | {base_name} at equal steps | gain | {base_name} at "
          "equal CPU | gain |")
    print("|---|---|---|---|---|---|---|")
    for r in other:
        if r["step"] == 0:
            continue
        same_step = next((b["al_estimate"] for b in base if b["step"] == r["step"]), None)
        same_cpu = value_at(base, r["cpu_s"])
        print(f"| {r['step']} | {r['cpu_s']:.0f} | {r['al_estimate']:.3f} | {fmt(same_step)} "
              f"| {gain(r['al_estimate'], same_step)} | {fmt(same_cpu)} "
              f"| {gain(r['al_estimate'], same_cpu)} |")


def main(argv):
    del argv
    if FLAGS.compare:
        compare_curves()
    elif FLAGS.plot:
        plot_curves()
    elif not FLAGS.workdir:
        raise app.UsageError("--workdir is required (or --plot)")
    else:
        train_curve()


if __name__ == "__main__":
    from dblast_jax import errors
    errors.run_absl(main, "budget_curve.py")  # bad flags / files: one line, exit 2
