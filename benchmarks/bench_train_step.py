"""Drafter training step: two settings of one experiment stepped side by side.

`--pair live-vs-cached` (the default): one Trainer reads the taps from a feature cache
(TrainConfig.feature_cache), the other runs the target every step (both without
distillation, as measured in BENCHMARKS.md). `--pair no-distill-vs-distill`: both read a
feature cache, one trains without distillation, the other with distill_weight=1 (its cache
also holds the teacher's top-k). `--pair full-vs-sampled-head`: both distil from one
feature cache (built by the first), the second normalises log q over the
`--head-tokens` most frequent response tokens + `--head-sampled` sampled ones
(TrainConfig.train_head_tokens, train/sampled_head.py). `--pair seq-len:256:384`: the
flagship's recipe (distillation, sampled head), each Trainer with its own cache, reading
records through a 256- and a 384-token window. The two Trainers are stepped in alternating rounds in one
process, so machine noise hits both, and the ratio of their median step times is reported
with the one-off cost of building the second one's cache.

    python benchmarks/bench_train_step.py --experiments smollm2_dflash_baseline \
        smollm2_dblast_k4_al --rounds 3 --steps-per-round 4
    python benchmarks/bench_train_step.py --pair no-distill-vs-distill --layers 1 \
        --taps 1,7,14,20,27 --anchors 16 --experiments smollm2_dflash_baseline \
        --out benchmarks/results_train_step_distill.json
    python benchmarks/bench_train_step.py --pair full-vs-sampled-head --layers 1 \
        --taps 1,7,14,20,27 --anchors 16 --experiments smollm2_dflash_baseline \
        --out benchmarks/results_train_step_sampled_head.json
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


def _pair_overrides(pair: str, root: str, head: tuple[int, int] = (4096, 1024)
                    ) -> tuple[tuple[str, list[str]], tuple[str, list[str]]]:
    """(name, overrides) of the two Trainers of a pair; the second one's cache is timed
    (the first one's for full-vs-sampled-head, where they share it)."""
    full = ["train_head_tokens=0"]  # the other pairs time the full head, as BENCHMARKS.md
    if pair.startswith("seq-len"):  # the flagship's recipe at two record windows
        recipe = ["distill_weight=1.0", f"train_head_tokens={head[0]}",
                  f"train_head_sampled={head[1]}"]
        short, long = (int(x) for x in pair.split(":")[1:])
        return ((f"seq{short}", recipe + [f"seq_len={short}", f"feature_cache={root}/f{short}"]),
                (f"seq{long}", recipe + [f"seq_len={long}", f"feature_cache={root}/f{long}"]))
    if pair == "full-vs-sampled-head":
        both = ["distill_weight=1.0", f"feature_cache={root}/features_teacher"]
        return (("full_head", both + full), ("sampled_head", both + [
            f"train_head_tokens={head[0]}", f"train_head_sampled={head[1]}"]))
    if pair == "live-vs-cached":
        off = ["distill_weight=0"] + full
        return (("live", off), ("cached", off + [f"feature_cache={root}/features"]))
    return (("no_distill", ["distill_weight=0", f"feature_cache={root}/features_plain"] + full),
            ("distill", ["distill_weight=1.0", f"feature_cache={root}/features_teacher"] + full))


def measure(experiment: str, args, target) -> dict:
    common = [f"data={args.data}", f"data_shards={args.data_shards}",
              f"batch_size={args.batch_size}", f"seq_len={args.seq_len}",
              f"anchors_per_sequence={args.anchors}", f"drafter_layers={args.layers}",
              "num_steps=100000", "checkpoint_every=100000", "log_every=1", "export=false"]
    if args.taps:
        common.append(f"target_layer_ids={args.taps}")
    if args.verify_temperature is not None:
        common.append(f"verify_temperature={args.verify_temperature}")
    root = tempfile.mkdtemp(prefix="bench_train_")
    (a, a_over), (b, b_over) = _pair_overrides(args.pair, root,
                                               (args.head_tokens, args.head_sampled))
    trainers = {}
    t0 = time.perf_counter()
    trainers[a] = Trainer(get_experiment(experiment, common + a_over), os.path.join(root, a),
                          target=target, progress=False, log=lambda s: None)
    t1 = time.perf_counter()
    trainers[b] = Trainer(get_experiment(experiment, common + b_over), os.path.join(root, b),
                          target=target, progress=False, log=lambda s: None)
    setup = {a: t1 - t0, b: time.perf_counter() - t1}
    # live-vs-cached: the cache is the only difference; otherwise both setups build one
    cache_build_s = {"live-vs-cached": setup[b] - setup[a],
                     "full-vs-sampled-head": setup[a]}.get(args.pair, setup[b])
    times = {a: [], b: []}
    done = {a: 0, b: 0}
    for name, tr in trainers.items():  # compile + one step each, not timed
        done[name] = tr.run(stop_at=1).step
    for r in range(args.rounds):
        for name in ((a, b) if r % 2 == 0 else (b, a)):
            res = trainers[name].run(stop_at=done[name] + args.steps_per_round)
            done[name] = res.step
            times[name] += [h["step_time_s"] for h in res.history if "step_time_s" in h]
    for tr in trainers.values():
        tr.close()
    cache = next(o for o in b_over if o.startswith("feature_cache=")).split("=", 1)[1]
    sub = next(os.scandir(cache)).path
    ta, tb = statistics.median(times[a]), statistics.median(times[b])
    return {"experiment": experiment, f"{a}_s_per_step": ta, f"{b}_s_per_step": tb,
            "speedup": ta / tb, "steps_timed": len(times[a]),
            "cache_build_s": cache_build_s, "setup_s": setup,
            "cache_mb": sum(os.path.getsize(e.path) for e in os.scandir(sub)
                            if e.name.endswith(".npy")) / 2**20}


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
    p.add_argument("--taps", default="", help="target_layer_ids, e.g. 1,7,14,20,27 "
                   "(default: the experiment's)")
    p.add_argument("--verify-temperature", type=float, default=None,
                   help="T_v of the AL loss (default: the experiment's; the corpus must "
                   "store log-probs at it)")
    p.add_argument("--pair", default="live-vs-cached",
                   help="live-vs-cached, no-distill-vs-distill, full-vs-sampled-head, or "
                   "seq-len:A:B (the flagship recipe, each with its cache, at seq_len A and B)")
    p.add_argument("--head-tokens", type=int, default=4096,
                   help="full-vs-sampled-head: train_head_tokens of the second")
    p.add_argument("--head-sampled", type=int, default=1024,
                   help="full-vs-sampled-head: train_head_sampled of the second")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps-per-round", type=int, default=4,
                   help=">= 2: a round's first step is not timed (the trainer logs it as "
                   "the start-up step)")
    p.add_argument("--out", default="benchmarks/results_train_step.json")
    args = p.parse_args()
    if args.pair not in ("live-vs-cached", "no-distill-vs-distill", "full-vs-sampled-head"):
        parts = args.pair.split(":")
        if not (len(parts) == 3 and parts[0] == "seq-len" and all(x.isdigit() for x in parts[1:])):
            p.error(f"--pair {args.pair!r}: expected live-vs-cached, no-distill-vs-distill, "
                    "full-vs-sampled-head or seq-len:A:B (e.g. seq-len:256:384)")
    if args.steps_per_round < 2:
        p.error("--steps-per-round must be >= 2")
    target = load_target(args.target)
    rows = [measure(e, args, target) for e in args.experiments]
    (a, _), (b, _) = _pair_overrides(args.pair, "")
    print(f"| experiment | {a} s/step | {b} s/step | ratio | {b} cache build s | cache MB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['experiment']} | {r[a + '_s_per_step']:.2f} | {r[b + '_s_per_step']:.2f}"
              f" | {r['speedup']:.2f}x | {r['cache_build_s']:.0f} | {r['cache_mb']:.0f} |")
    with open(args.out, "w") as f:
        json.dump({"settings": vars(args), "rows": rows}, f, indent=1)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
