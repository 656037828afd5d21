"""Drafter training step: live frozen-target pass vs cached target features.

Same experiment, same corpus snapshot, same batches; one Trainer reads the taps from a
feature cache (TrainConfig.feature_cache), the other runs the target every step. The
two are stepped in alternating rounds in one process, so machine noise hits both, and
the ratio of their median step times is reported with the one-off cost of building
the cache.

    python benchmarks/bench_train_step.py --experiments smollm2_dflash_baseline \
        smollm2_dblast_k4_al --rounds 3 --steps-per-round 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from dblast_jax.generation import load_target
from dblast_jax.train import get_experiment
from dblast_jax.train.trainer import Trainer


def measure(experiment: str, args, target) -> dict:
    common = [f"data={args.data}", f"data_shards={args.data_shards}",
              f"batch_size={args.batch_size}", f"seq_len={args.seq_len}",
              f"anchors_per_sequence={args.anchors}", f"drafter_layers={args.layers}",
              "num_steps=100000", "checkpoint_every=100000", "log_every=1", "export=false"]
    root = tempfile.mkdtemp(prefix="bench_train_")
    cache_dir = os.path.join(root, "features")
    trainers = {}
    t0 = time.perf_counter()
    trainers["live"] = Trainer(get_experiment(experiment, common), os.path.join(root, "live"),
                               target=target, progress=False, log=lambda s: None)
    t1 = time.perf_counter()
    trainers["cached"] = Trainer(get_experiment(experiment, common + [
        f"feature_cache={cache_dir}"]), os.path.join(root, "cached"), target=target,
        progress=False, log=lambda s: None)
    cache_build_s = (time.perf_counter() - t1) - (t1 - t0)  # minus the common setup
    times = {"live": [], "cached": []}
    done = {"live": 0, "cached": 0}
    for name, tr in trainers.items():  # compile + one step each, not timed
        done[name] = tr.run(stop_at=1).step
    for r in range(args.rounds):
        order = ("live", "cached") if r % 2 == 0 else ("cached", "live")
        for name in order:
            res = trainers[name].run(stop_at=done[name] + args.steps_per_round)
            done[name] = res.step
            times[name] += [h["step_time_s"] for h in res.history if "step_time_s" in h]
    for tr in trainers.values():
        tr.close()
    sub = next(os.scandir(cache_dir)).path
    live, cached = statistics.median(times["live"]), statistics.median(times["cached"])
    return {"experiment": experiment, "live_s_per_step": live, "cached_s_per_step": cached,
            "speedup": live / cached, "steps_timed": len(times["live"]),
            "cache_build_s": cache_build_s,
            "cache_mb": os.path.getsize(os.path.join(sub, "taps.npy")) / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--data", default="corpora/smollm2_t1")
    p.add_argument("--data-shards", type=int, default=16)
    p.add_argument("--experiments", nargs="+",
                   default=["smollm2_dflash_baseline", "smollm2_dblast_k4_al"])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--anchors", type=int, default=24)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps-per-round", type=int, default=4,
                   help=">= 2: a round's first step is not timed (the trainer logs it as "
                   "the start-up step)")
    p.add_argument("--out", default="benchmarks/results_train_step.json")
    args = p.parse_args()
    if args.steps_per_round < 2:
        p.error("--steps-per-round must be >= 2")
    target = load_target(args.target)
    rows = [measure(e, args, target) for e in args.experiments]
    print("| experiment | live s/step | cached s/step | speedup | cache build s | cache MB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['experiment']} | {r['live_s_per_step']:.2f} | {r['cached_s_per_step']:.2f}"
              f" | {r['speedup']:.2f}x | {r['cache_build_s']:.0f} | {r['cache_mb']:.0f} |")
    with open(args.out, "w") as f:
        json.dump({"settings": vars(args), "rows": rows}, f, indent=1)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
