"""Which batch size, and which way of scoring, makes corpus regeneration cheapest?
Response tokens per CPU-second.

Regeneration (`dblast data regenerate`) is the long background job of growing a corpus:
the target samples an answer per prompt and scores each token at every stored temperature
in the same loop (on-device `generate_scored_tokens`; `--scoring teacher-forced` times the
second pass over prompt + answer it replaced). A bigger batch reads the weights once for
more rows, but every row waits for the batch's longest answer. This measures both costs
on the same prompts, side by side in one run: for each batch size, one warm-up pass over
the prompts (it compiles every shape the timed pass meets) and then a timed pass, through
the same per-shard function regeneration uses. CPU-seconds (process time, all threads)
are the budget that matters on a shared machine; wall seconds are reported beside them.

    python benchmarks/bench_regenerate.py --prompts-from corpora/smollm2_t1:0:2 \
        --batch 8 16 32 64 --out benchmarks/results_regenerate.json
    python benchmarks/bench_regenerate.py --prompts-from corpora/smollm2_t1:0:1 \
        --batch 16 --scoring in-loop teacher-forced --out benchmarks/results_regenerate_scoring.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from dblast_jax.data import regenerate as R
from dblast_jax.generation import load_target


def two_pass_shard(target, items, cfg: "R.RegenConfig", plan: "R._ShardPlan") -> int:
    """How regeneration scored before: the plain loop, then a teacher-forced pass over
    prompt + answer. The same batches and keys as `R._run_shard`, so the same answers.
    Returns the response tokens generated."""
    from dblast_jax.config import SamplingConfig
    from dblast_jax.sampler import cache_size_for, generate_tokens
    sampling = SamplingConfig(temperature=plan.gen_temperature, max_new_tokens=cfg.max_new_tokens,
                              stop_tokens=tuple(target.stop_ids))
    order = sorted(range(len(items)), key=lambda i: len(items[i].tokens))
    shard_key = jax.random.fold_in(jax.random.key(cfg.seed), plan.index)
    tokens = 0
    for b, lo in enumerate(range(0, len(order), cfg.batch_size)):
        batch = [items[i] for i in order[lo:lo + cfg.batch_size]]
        real = len(batch)
        batch += [batch[0]] * (cfg.batch_size - real)
        width = R._round_up(max(len(w.tokens) for w in batch), cfg.pad_multiple)
        toks, lens = R._pad_batch([w.tokens for w in batch], width)
        out, counts = generate_tokens(
            target.params, jnp.asarray(toks), jnp.asarray(lens), jax.random.fold_in(shard_key, b),
            config=target.config, sampling=sampling,
            cache_size=cache_size_for(width, cfg.max_new_tokens, multiple=cfg.pad_multiple))
        out, counts = np.asarray(out), np.asarray(counts)
        rows = [list(w.tokens) + [int(t) for t in out[r, :counts[r]]]
                for r, w in enumerate(batch)]
        stoks, _ = R._pad_batch(rows, R._round_up(max(map(len, rows)), cfg.pad_multiple))
        lp, _ = R.teacher_forced(target.params, jnp.asarray(stoks), jnp.asarray(lens),
                                 config=target.config, temperatures=cfg.verify_temperatures,
                                 num_new=cfg.max_new_tokens, row_block=cfg.logprob_rows)
        np.asarray(lp)
        tokens += int(counts[:real].sum())
    return tokens


def timed_pass(target, items, batch: int, args, scoring: str = "in-loop") -> dict:
    cfg = R.RegenConfig(gen_temperatures=(args.temperature,),
                        verify_temperatures=tuple(args.verify_temperatures),
                        max_new_tokens=args.new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                        batch_size=batch, shard_size=len(items), seed=args.seed)
    plan = R._ShardPlan(0, float(args.temperature), 0, len(items))
    counts = {"tokens": 0}

    def on_batch(n_prompts: int, n_tokens: int) -> None:
        counts["tokens"] += n_tokens

    c0, w0 = time.process_time(), time.perf_counter()
    if scoring == "in-loop":
        R._run_shard(target, items, plan, cfg, tuple(target.stop_ids), on_batch)
    else:
        counts["tokens"] = two_pass_shard(target, items, cfg, plan)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    return {"batch": batch, "scoring": scoring, "response_tokens": counts["tokens"],
            "cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
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
    ap.add_argument("--scoring", nargs="+", choices=["in-loop", "teacher-forced"],
                    default=["in-loop"],
                    help="in-loop: scores kept by the generation loop (what regeneration "
                    "does); teacher-forced: a second pass over prompt + answer (what it did "
                    "before); both: side by side on the same prompts and answers")
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
        for scoring in args.scoring:
            timed_pass(target, items, batch, args, scoring)  # compiles every shape
            row = timed_pass(target, items, batch, args, scoring)
            rows.append(row)
            print(json.dumps(row), flush=True)
    best = max(rows, key=lambda r: r["tokens_per_cpu_s"])
    base = next((r for r in rows if r["batch"] == 16), rows[0])
    print(f"\n{len(items)} prompts, up to {args.new_tokens} new tokens, T = {args.temperature}")
    print("| batch | scoring | response tokens | CPU-s | wall s | tokens / CPU-s | vs batch "
          f"{base['batch']} {base['scoring']} | tokens / wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['scoring']} | {r['response_tokens']} | {r['cpu_s']} | "
              f"{r['wall_s']} | {r['tokens_per_cpu_s']} | "
              f"{r['tokens_per_cpu_s'] / base['tokens_per_cpu_s']:.2f}x | "
              f"{r['tokens_per_wall_s']} |")
    print(f"cheapest per CPU-second: batch {best['batch']}, {best['scoring']} scoring")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": {k: v for k, v in vars(args).items() if k != "out"},
                       "prompts": len(items), "cpu_count": os.cpu_count(), "rows": rows,
                       "best_batch": best["batch"], "best_scoring": best["scoring"]}, f,
                      indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
