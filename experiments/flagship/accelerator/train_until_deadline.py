"""Train a flagship leg until a wall-clock deadline, then export it: for a lent accelerator
whose call ends at a fixed time (run_on_accelerator.sh).

Why not budget_curve.py: a leg there runs a fixed number of steps, but on a device no one
has timed yet the number that fits before the call is cut off is unknown. So a short probe
(--probe_steps twice: the first pays the compilation) measures the step time on a long
schedule, the run is resumed from the probe's checkpoint with the schedule sized to what
fits before the deadline (warmup + cosine end inside the time), and it stops with a
checkpoint before --deadline less --reserve_s. Held-out acceptance is scored at the start
(the starting drafter), every --segment_steps and at the end, as budget_curve.py does and at
the flagship's batch of 8 whatever the training batch (--validation_batch_size), into
WORKDIR/budget_curve.jsonl (same rows: finish_leg.py's reader reads them); cpu_s there is
this process's CPU time inside training steps, and wall_s its wall time. Rerun on the same
workdir resumes (the planned schedule is kept in WORKDIR/plan.json).

    python experiments/flagship/accelerator/train_until_deadline.py --workdir=W \\
        --deadline=$(( $(date +%s) + 300 )) --export=W/export \\
        --override=data=CORPUS --override=batch_size=64 ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "budget"))
from curve_file import append_row, read_curve  # noqa: E402  (budget_curve.py's rows)

KEEP = ("al_estimate", "al_estimate_mixture", "block_nll", "top1_mean", "top1",
        "accept_prefix", "distill_kl", "greedy_accepted")


def parse_extra(specs: list[str]) -> dict:
    """NAME=CORPUS:A:B[@T_v] (budget_curve.py's --extra_validation) -> {NAME: (data,
    'A:B', T_v or None)}."""
    out = {}
    for spec in specs:
        name, _, where = spec.partition("=")
        where, at, tv = where.partition("@")
        parts = where.rsplit(":", 2)
        if not name or len(parts) != 3 or not all(p.isdigit() for p in parts[1:]):
            raise SystemExit(f"--extra_validation={spec!r}: expected NAME=CORPUS:A:B[@T_v]")
        out[name] = (parts[0], f"{parts[1]}:{parts[2]}", float(tv) if at else None)
    return out


def planned_steps(done: int, step_s: float, seconds_left: float, compile_s: float,
                  max_steps: int, min_steps: int) -> int:
    """The schedule's length: the steps done plus those that fit in `seconds_left` after
    one more compilation (the resumed run's step has a new schedule), at most max_steps."""
    fit = int(max(seconds_left - compile_s, 0) / max(step_s, 1e-6))
    return max(min(done + fit, max_steps), min(done + min_steps, max_steps))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--experiment", default="smollm2_k1_al")
    p.add_argument("--override", action="append", default=[], help="TrainConfig key=value")
    p.add_argument("--deadline", type=float, required=True, help="unix time to be done by")
    p.add_argument("--reserve_s", type=float, default=40.0,
                   help="seconds kept after training for the last score and the export")
    p.add_argument("--max_steps", type=int, default=100000, help="longest schedule")
    p.add_argument("--probe_steps", type=int, default=20)
    p.add_argument("--segment_steps", type=int, default=0,
                   help="score held out every N steps (0: at the start and the end only)")
    p.add_argument("--checkpoint_every", type=int, default=250)
    p.add_argument("--chunk_s", type=float, default=60.0,
                   help="train in runs of about this many seconds, re-timing the step")
    p.add_argument("--validation_data", default="corpora/smollm2_t1")
    p.add_argument("--validation_shards", default="68:72")
    p.add_argument("--validation_batches", type=int, default=8)
    p.add_argument("--validation_batch_size", type=int, default=8,
                   help="sequences per held-out batch, whatever the training batch: the "
                   "flagship's 8, so that scores compare with experiments/flagship/k1")
    p.add_argument("--extra_validation", action="append", default=[])
    p.add_argument("--export", default="", help="folder for the bfloat16 export")
    a = p.parse_args(argv)
    extra_specs = parse_extra(a.extra_validation)

    import jax

    from dblast_jax.train import config as TC
    from dblast_jax.train import trainer as TR
    from dblast_jax.train import validation as V
    from dblast_jax.train.restore import export_workdir

    os.makedirs(a.workdir, exist_ok=True)
    plan_path = os.path.join(a.workdir, "plan.json")
    plan = json.load(open(plan_path)) if os.path.exists(plan_path) else None
    fixed = [f"checkpoint_every={a.checkpoint_every}", "validate_every=0", "export=false"]

    def config(num_steps: int):
        return TC.get_experiment(a.experiment, list(a.override) + fixed
                                 + [f"num_steps={num_steps}"])

    state = {"cpu": 0.0, "setup_cpu": 0.0}
    rows = read_curve(a.workdir)
    if rows:
        state["cpu"] = rows[-1]["cpu_s"]

    def open_trainer(num_steps: int):
        t = time.process_time()
        cfg = config(num_steps)
        trainer = TR.Trainer(cfg, a.workdir, progress=False)
        state["setup_cpu"] = time.process_time() - t
        held = V.make_validation_source(cfg, trainer.target_config, data=a.validation_data,
                                        shards=a.validation_shards)
        extra = {n: (V.make_validation_source(
            cfg if tv is None else cfg.replace(verify_temperature=tv), trainer.target_config,
            data=d, shards=s), tv) for n, (d, s, tv) in extra_specs.items()}
        return trainer, held, extra

    def evaluate(trainer, source, step: int, tv=None) -> dict:
        """Trainer.evaluate at --validation_batch_size and one num_steps whatever the
        schedule: num_steps only moves the loss weights (lam, tau), not the scores kept,
        and the sized run then reuses the probe's compiled evaluation."""
        size = a.validation_batch_size
        saved = trainer.config, trainer.rows
        if size != saved[0].batch_size:
            if jax.process_count() != 1:
                raise SystemExit("--validation_batch_size other than the training batch "
                                 "needs one process")
            trainer.rows = (0, size)
        trainer.config = saved[0].replace(batch_size=size, num_steps=a.max_steps)
        try:
            return trainer.evaluate(source, a.validation_batches, step=step,
                                    verify_temperature=tv)
        finally:
            trainer.config, trainer.rows = saved

    def score(trainer, held, extra, seg_cpu: float, wall: float) -> dict:
        t, tw = time.process_time(), time.time()
        step = trainer.start_step
        m = evaluate(trainer, held, step)
        row = {"step": step, "cpu_s": state["cpu"], "segment_cpu_s": seg_cpu,
               "setup_cpu_s": state["setup_cpu"], "time": time.time(), "wall_s": wall,
               "device": jax.devices()[0].device_kind, **{k: m[k] for k in KEEP if k in m}}
        for name, (source, tv) in extra.items():
            e = evaluate(trainer, source, step, tv)
            row.update({f"{name}/{k}": e[k] for k in KEEP if k in e})
        row["validation_cpu_s"] = time.process_time() - t
        row["validation_wall_s"] = time.time() - tw
        append_row(a.workdir, row)
        print(f"[train] step {step}  AL {row['al_estimate']:.4f}  top1[0] "
              f"{row['top1'][0]:.3f}  greedy {row['greedy_accepted']:.3f}"
              + "".join(f"  {n} AL {row[f'{n}/al_estimate']:.4f}" for n in extra)
              + f"  ({row['validation_wall_s']:.1f} s)", flush=True)
        return row

    def train_to(trainer, stop: int) -> float:
        """Steps up to `stop`; returns their wall seconds (CPU seconds go to state)."""
        t, tw = time.process_time(), time.time()
        trainer.run(stop_at=stop)
        state["cpu"] += time.process_time() - t
        return time.time() - tw

    t_begin = time.time()
    if plan is None:  # probe on a long schedule, then size the schedule to the time left
        trainer, held, extra = open_trainer(a.max_steps)
        if not rows:
            score(trainer, held, extra, 0.0, 0.0)
        start = trainer.start_step
        first = train_to(trainer, start + a.probe_steps)
        second = train_to(trainer, start + 2 * a.probe_steps)
        step_s = second / a.probe_steps
        compile_s = max(first - second, 0.0)
        trainer.close()
        left = a.deadline - time.time() - a.reserve_s
        steps = planned_steps(trainer.start_step, step_s, left, compile_s + 10.0,
                              a.max_steps, min_steps=1)
        plan = {"num_steps": steps, "probe_step_s": step_s, "compile_s": compile_s,
                "probe_end_step": trainer.start_step}
        with open(plan_path, "w") as f:
            json.dump(plan, f)
        print(f"[train] probe: {step_s * 1000:.1f} ms/step after {compile_s:.1f} s of "
              f"compilation; schedule of {steps} steps for {left:.0f} s", flush=True)
    trainer, held, extra = open_trainer(plan["num_steps"])
    step_s = plan["probe_step_s"]
    seg_cpu0 = state["cpu"]
    compiling = plan["compile_s"]  # the first run of this trainer compiles its step again
    while trainer.start_step < plan["num_steps"]:
        left = a.deadline - a.reserve_s - time.time() - compiling
        start = trainer.start_step
        n = plan["num_steps"] - start
        if a.segment_steps:
            n = min(n, a.segment_steps - start % a.segment_steps)
        # chunks of ~chunk_s, each re-timing the step: a misjudged step time costs at
        # most one chunk's error; stop with a checkpoint before the deadline
        n = min(n, max(int(a.chunk_s / step_s), 10), int(left / step_s) - 1)
        if n < 1:
            print(f"[train] stopping at step {start} of {plan['num_steps']}: {left:.0f} s "
                  "left before the reserve", flush=True)
            break
        wall = train_to(trainer, start + n)
        if n >= 10 and not compiling:
            step_s = wall / n
        compiling = 0.0
        print(f"[train] step {trainer.start_step} of {plan['num_steps']}: "
              f"{step_s * 1000:.1f} ms/step", flush=True)
        if (a.segment_steps and trainer.start_step % a.segment_steps == 0
                and trainer.start_step < plan["num_steps"]):
            score(trainer, held, extra, state["cpu"] - seg_cpu0, time.time() - t_begin)
            seg_cpu0 = state["cpu"]
    last = read_curve(a.workdir)
    if not last or last[-1]["step"] != trainer.start_step:
        score(trainer, held, extra, state["cpu"] - seg_cpu0, time.time() - t_begin)
    step = trainer.start_step
    trainer.close()
    if a.export:
        export_workdir(a.workdir, a.export, dtype="bfloat16", force=True)
    rows = read_curve(a.workdir)
    cfg = config(plan["num_steps"])
    summary = {"steps": step, "num_steps": plan["num_steps"],
               "settings": {k: getattr(cfg, k) for k in (
                   "batch_size", "seq_len", "anchors_per_sequence", "learning_rate",
                   "warmup_fraction", "schedule_steps", "schedule_offset", "data")},
               "probe_step_s": plan["probe_step_s"], "compile_s": plan["compile_s"],
               "before": {k: v for k, v in rows[0].items() if "al_estimate" in k},
               "after": {k: v for k, v in rows[-1].items() if "al_estimate" in k},
               "wall_s": round(time.time() - t_begin, 1), "export": a.export or None}
    with open(os.path.join(a.workdir, "train_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"[train] done: {json.dumps(summary)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
