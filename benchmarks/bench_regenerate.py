"""Which batch size makes corpus regeneration cheapest? Response tokens per CPU-second.

Regeneration (`dblast data regenerate`) is the long background job of growing a corpus:
the target samples an answer per prompt (on-device `generate_tokens`) and then scores it
teacher-forced at every stored temperature. A bigger batch reads the weights once for
more rows, but every row waits for the batch's longest answer. This measures both costs
on the same prompts, side by side in one run: for each batch size, one warm-up pass over
the prompts (it compiles every shape the timed pass meets) and then a timed pass, through
the same per-shard function regeneration uses. CPU-seconds (process time, all threads)
are the budget that matters on a shared machine; wall seconds are reported beside them.

    python benchmarks/bench_regenerate.py --prompts-from corpora/smollm2_t1:0:2 \
        --batch 8 16 32 64 --out benchmarks/results_regenerate.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

from dblast_jax.data import regenerate as R
from dblast_jax.generation import load_target


def timed_pass(target, items, batch: int, args) -> dict:
    cfg = R.RegenConfig(gen_temperatures=(args.temperature,),
                        verify_temperatures=tuple(args.verify_temperatures),
                        max_new_tokens=args.new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                        batch_size=batch, shard_size=len(items), seed=args.seed)
    plan = R._ShardPlan(0, float(args.temperature), 0, len(items))
    counts = {"tokens": 0}

    def on_batch(n_prompts: int, n_tokens: int) -> None:
        counts["tokens"] += n_tokens

    c0, w0 = time.process_time(), time.perf_counter()
    _, timing = R._run_shard(target, items, plan, cfg, tuple(target.stop_ids), on_batch)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    return {"batch": batch, "response_tokens": counts["tokens"], "cpu_s": round(cpu, 2),
            "wall_s": round(wall, 2), "generate_wall_s": round(timing["generate_seconds"], 2),
            "score_wall_s": round(timing["score_seconds"], 2),
            "tokens_per_cpu_s": round(counts["tokens"] / cpu, 2),
            "tokens_per_wall_s": round(counts["tokens"] / wall, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts-from", default="corpora/smollm2_t1:0:2", metavar="CORPUS:A:B",
                    help="the prompts of these corpus shards (already chat-templated)")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--verify-temperatures", type=float, nargs="+", default=[0.7, 1.0, 1.5])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", help="write the rows and settings here as JSON")
    args = ap.parse_args()
    if min(args.batch) < 1:
        ap.error(f"--batch sizes must be >= 1, got {args.batch}")

    folder, shards = args.prompts_from.rsplit(":", 2)[0], ":".join(
        args.prompts_from.rsplit(":", 2)[1:])
    prompts = R.corpus_prompts(folder, shards)
    items = [w for w in R.encode_work(prompts) if len(w.tokens) <= args.max_prompt_tokens]
    if len(items) < max(args.batch):
        ap.error(f"{len(items)} prompts fit --max-prompt-tokens; the largest batch "
                 f"({max(args.batch)}) needs at least that many: take more shards")
    target = load_target(args.model)
    rows = []
    for batch in args.batch:
        timed_pass(target, items, batch, args)  # compiles every shape of the timed pass
        row = timed_pass(target, items, batch, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    best = max(rows, key=lambda r: r["tokens_per_cpu_s"])
    base = next((r for r in rows if r["batch"] == 16), rows[0])
    print(f"\n{len(items)} prompts, up to {args.new_tokens} new tokens, T = {args.temperature}")
    print("| batch | response tokens | CPU-s | wall s | tokens / CPU-s | vs batch "
          f"{base['batch']} | tokens / wall s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['response_tokens']} | {r['cpu_s']} | {r['wall_s']} | "
              f"{r['tokens_per_cpu_s']} | {r['tokens_per_cpu_s'] / base['tokens_per_cpu_s']:.2f}x"
              f" | {r['tokens_per_wall_s']} |")
    print(f"cheapest per CPU-second: batch {best['batch']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": {k: v for k, v in vars(args).items() if k != "out"},
                       "prompts": len(items), "cpu_count": os.cpu_count(), "rows": rows,
                       "best_batch": best["batch"]}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
