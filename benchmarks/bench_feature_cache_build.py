"""Why the feature cache runs records at their own width (`feature_cache.WIDTH_MULTIPLE`).

A flagship leg starts by running the frozen target once over every training record
(`train/feature_cache.py`): ~1.06 CPU-s a record at seq_len 384, an hour of a working day
on the sampled + greedy corpus, and redone on every new machine. Records used to be
right-padded to seq_len in index order; the build now sorts a window of records by length
and runs each batch only as wide as its longest record (rounded up to 64). This builds the
cache of the same records both ways (taps at the flagship's five layers, the teacher's
top-64, the data's log-probs), alternating rounds in one process so that machine noise hits
both, reports CPU-s per record (compilation included, as in a leg) and the ratio, and checks that the two caches agree on every
record's own positions.

    python benchmarks/bench_feature_cache_build.py --corpus corpora/smollm2_t1:0:4 \
        --out benchmarks/results_feature_cache_build.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import numpy as np

from dblast_jax.data.corpus import Corpus, parse_shard_range
from dblast_jax.generation import load_target
from dblast_jax.train import feature_cache as FC
from dblast_jax.train.objective import target_head


def _build(source, target, folder, seq_len: int, width_multiple: int, batch_size: int,
           taps: tuple[int, ...], topk: int):
    FC.WIDTH_MULTIPLE = width_multiple
    head = target_head(target.params, target.config)
    t0 = time.process_time()
    cache = FC.build_feature_cache(source, target.config, target.params, taps,
                                   seq_len, folder, target_name=target.name, dtype="bfloat16",
                                   batch_size=batch_size, progress=False, log=lambda s: None,
                                   teacher_topk=topk, head=head, data_logp_temperature=1.0)
    return cache, time.process_time() - t0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", default="corpora/smollm2_t1:0:4", help="FOLDER:A:B shards")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--seq_len", type=int, default=384)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--taps", default="1,7,14,20,27", help="target layers tapped")
    ap.add_argument("--topk", type=int, default=64, help="the teacher's top-k")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    folder, spec = args.corpus.rsplit(":", 2)[0], ":".join(args.corpus.rsplit(":", 2)[1:])
    first, stop = parse_shard_range(spec)
    source = Corpus(folder, first_shard=first, max_shards=stop)
    target = load_target(args.target)
    lengths = np.minimum(source.lengths()[0], args.seq_len)
    ways = {"padded to seq_len": args.seq_len, "own width": 64}
    times = {name: [] for name in ways}
    caches = {}
    for r in range(args.rounds):
        for name, multiple in (ways.items() if r % 2 == 0 else reversed(ways.items())):
            with tempfile.TemporaryDirectory() as tmp:
                # each build compiles its own pass (as a leg's does): own width compiles up
                # to seq_len / 64 shapes, padded one; that cost is in the timings
                cache, cpu = _build(source, target, tmp + "/c", args.seq_len, multiple,
                                    args.batch_size, tuple(int(x) for x in args.taps.split(",")),
                                    args.topk)
                times[name].append(cpu / len(source))
                if r == 0:
                    caches[name] = [(cache.taps(i)[:n].copy(), cache.data_logp(i)[:n].copy())
                                    for i, n in enumerate(lengths)]
                print(f"round {r} {name}: {cpu / len(source):.3f} CPU-s a record", flush=True)
    worst = max(float(np.abs(a[0] - b[0]).max()) for a, b in
                zip(caches["padded to seq_len"], caches["own width"]))
    worst_logp = max(float(np.abs(a[1] - b[1]).max()) for a, b in
                     zip(caches["padded to seq_len"], caches["own width"]))
    result = {
        "corpus": args.corpus, "records": len(source), "seq_len": args.seq_len,
        "mean_used_tokens": float(lengths.mean()),
        "cpu_s_per_record": {k: statistics.median(v) for k, v in times.items()},
        "speedup": statistics.median(times["padded to seq_len"])
        / statistics.median(times["own width"]),
        "max_abs_diff_taps_bf16": worst, "max_abs_diff_data_logp": worst_logp,
        "command": "python benchmarks/bench_feature_cache_build.py " + " ".join(
            f"--{k}={v}" for k, v in vars(args).items() if k != "out" and v is not None),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
