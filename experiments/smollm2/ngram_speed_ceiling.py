"""What limits prompt lookup's speed on this CPU, and would another policy lift it?

At T = 0 speculative decoding emits exactly the greedy text, so the n-gram drafter's steps
can be replayed on greedy answers without running the target: at each step the drafts
(`dblast_jax.ngram.propose`, the drafter's own code) are compared with the text that
follows, which gives the accepted count. Each step then costs one verify pass whose width
is 1 (a plain step: nothing matched) or 1 + k; the cost of each width relative to a plain
step is measured here, side by side on the real target (batch 1, interleaved rounds). The
predicted speed of a policy is tokens / cost summed over the replayed steps.

Policies replayed exactly (each its own trajectory):
  * the drafter's default (min_n = 2, max_n = 4, k = 7: a plain step where nothing matched);
  * vLLM's habit of matching a single token (min_n = 1);
  * longer suffixes (max_n = 8) and, from the per-match-length statistics of a replay
    with min_n = 1, max_n = 8, k = 7, the best k for each match length (0: a plain step).

    python experiments/smollm2/ngram_speed_ceiling.py \\
        --out experiments/smollm2/results_decoding_methods/ngram_speed_ceiling.json
"""

from __future__ import annotations

import functools
import glob
import json
import os
import time

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("corpus", "corpora/smollm2_t0_heldout", "greedy answers (T = 0 corpus)")
flags.DEFINE_integer("max_new_tokens", 256, "replay each answer's first N response tokens")
flags.DEFINE_integer("rounds", 15, "interleaved timing rounds per verify width")
flags.DEFINE_integer("cache_tokens", 200, "tokens in the KV cache when timing (a prompt)")
flags.DEFINE_string("widths_json", "", "reuse verify costs {width: ratio} from this file "
                    "(e.g. an earlier --out) instead of measuring them")
flags.DEFINE_string("out", "", "write the results here (JSON)")

MAX_K = 7
HISTORY = 2048  # the replay's token buffer (prompt + answer must fit)


def greedy_answers(folder: str) -> list[tuple[np.ndarray, int]]:
    """(tokens of prompt + answer, prompt length) of every answer in a corpus folder."""
    answers = []
    for path in sorted(glob.glob(os.path.join(folder, "shard-*.npz"))):
        z = np.load(path)
        temps = set(np.round(z["gen_temperature"], 6).tolist())
        if temps != {0.0}:
            raise ValueError(f"{path}: answers at T = {sorted(temps)}; the replay needs "
                             "greedy (T = 0) answers, whose text speculative decoding "
                             "reproduces exactly")
        for i, plen in enumerate(z["prompt_lengths"]):
            answers.append((z["tokens"][z["offsets"][i]:z["offsets"][i + 1]], int(plen)))
    if not answers:
        raise ValueError(f"{folder}: no shard-*.npz files")
    return answers


def replay(answers, min_n: int, max_n: int, k_of_match, max_new: int) -> list[tuple[int, int, int]]:
    """Replays the drafter on each answer: one (match length, k, accepted) per step."""
    import jax
    import jax.numpy as jnp
    from dblast_jax import ngram

    propose = jax.jit(functools.partial(ngram.propose, num_drafts=MAX_K, min_n=min_n,
                                        max_n=max_n))
    steps = []
    for tokens, plen in answers:
        end = min(len(tokens), plen + max_new)
        if end > HISTORY:
            raise ValueError(f"an answer of {end} tokens exceeds the replay buffer {HISTORY}")
        history = np.zeros((1, HISTORY), np.int32)
        history[0, :end] = tokens[:end]
        pos = plen + 1  # the prefill emitted the first token; it is the first anchor
        while pos < end:
            drafts, match = propose(jnp.asarray(history), jnp.asarray([pos]))
            m = int(match[0])
            k = k_of_match(m) if m > 0 else 0
            d = np.asarray(drafts[0, :k])
            truth = tokens[pos:pos + k]
            accepted = 0
            while accepted < min(k, len(truth)) and d[accepted] == truth[accepted]:
                accepted += 1
            steps.append((m, k, accepted))
            pos += accepted + 1
    return steps


def predicted_speed(steps, cost: dict[int, float]) -> dict:
    tokens = sum(a + 1 for _, _, a in steps)
    spent = sum(cost[k + 1] for _, k, _ in steps)
    return {"steps": len(steps), "tokens": tokens, "tau": tokens / len(steps),
            "plain_steps": sum(1 for _, k, _ in steps if k == 0),
            "predicted_speedup": tokens / spent}


def measure_widths(rounds: int, cache_tokens: int) -> dict[int, float]:
    """Median time of the target's verify pass (`extend`) over w tokens / that of w = 1."""
    import jax
    import jax.numpy as jnp
    import dblast_jax as dj
    from dblast_jax.models import target as target_lm

    target = dj.load_target("smollm2-135m-instruct")
    cfg, params = target.config, target.params
    prompt = jnp.ones((1, cache_tokens), jnp.int32)
    _, _, cache = target_lm.prefill(params, prompt, jnp.array([cache_tokens]), config=cfg,
                                    cache_size=cache_tokens + 64)
    extend = jax.jit(functools.partial(target_lm.extend, config=cfg))
    pos = jnp.array([cache_tokens])
    blocks = {w: jnp.ones((1, w), jnp.int32) for w in range(1, MAX_K + 2)}
    for block in blocks.values():  # compile each width untimed
        jax.block_until_ready(extend(params, block, pos, cache))
    times = {w: [] for w in blocks}
    for _ in range(rounds):
        for w, block in blocks.items():
            t = time.perf_counter()
            jax.block_until_ready(extend(params, block, pos, cache))
            times[w].append(time.perf_counter() - t)
    plain = float(np.median(times[1]))
    print(f"plain step (verify width 1): {plain * 1e3:.1f} ms (median of {rounds})")
    return {w: float(np.median(t)) / plain for w, t in times.items()}


def best_k_per_match(steps, cost: dict[int, float]) -> dict[int, int]:
    """k (0..7) per match length maximising total tokens / total cost, from the steps of a
    replay with k = 7 (an accepted count at k is min(accepted at 7, k)): Dinkelbach's
    iteration on the ratio."""
    by_match: dict[int, list[int]] = {}
    for m, _, a in steps:
        if m > 0:
            by_match.setdefault(m, []).append(a)
    plain = sum(1 for m, _, _ in steps if m == 0)
    rate, best = 1.0, {}
    for _ in range(50):
        best = {m: max(range(MAX_K + 1), key=lambda k: sum(min(a, k) + 1 for a in acc)
                       - rate * len(acc) * cost[k + 1]) for m, acc in by_match.items()}
        tokens = plain + sum(sum(min(a, best[m]) + 1 for a in acc)
                             for m, acc in by_match.items())
        spent = plain + sum(len(acc) * cost[best[m] + 1] for m, acc in by_match.items())
        if abs(tokens / spent - rate) < 1e-9:
            break
        rate = tokens / spent
    return best


def main(argv) -> None:
    del argv
    try:
        answers = greedy_answers(FLAGS.corpus)
    except ValueError as e:  # not a greedy corpus, or no shards: one line
        raise app.UsageError(f"--corpus: {e}")
    if FLAGS.widths_json:
        with open(FLAGS.widths_json) as f:
            cost = {int(w): r for w, r in json.load(f)["verify_cost"].items()}
    else:
        cost = measure_widths(FLAGS.rounds, FLAGS.cache_tokens)
    print("verify cost / plain step by width:",
          ", ".join(f"{w}: {r:.2f}" for w, r in sorted(cost.items())))
    policies = {"default (min_n 2, max_n 4, k 7)": (2, 4, lambda m: MAX_K),
                "single-token matches (min_n 1, max_n 4, k 7)": (1, 4, lambda m: MAX_K),
                "longer suffixes (min_n 2, max_n 8, k 7)": (2, 8, lambda m: MAX_K)}
    stats_steps = replay(answers, 1, 8, lambda m: MAX_K, FLAGS.max_new_tokens)
    best = dict(sorted(best_k_per_match(stats_steps, cost).items()))
    policies[f"best k per match length (min_n 1, max_n 8): {best}"] = (
        1, 8, lambda m: best.get(m, MAX_K))
    results = {"corpus": FLAGS.corpus, "answers": len(answers),
               "max_new_tokens": FLAGS.max_new_tokens,
               "verify_cost": {str(w): r for w, r in sorted(cost.items())}, "policies": {}}
    by_match: dict[int, list[int]] = {}
    for m, _, a in stats_steps:
        by_match.setdefault(m, []).append(a)
    results["accepted_by_match_length"] = {
        str(m): {"steps": len(acc), "mean_accepted_of_7": float(np.mean(acc)),
                 "p_accepted_at_least": [float(np.mean(np.array(acc) >= j))
                                         for j in range(1, MAX_K + 1)]}
        for m, acc in sorted(by_match.items())}
    print("\n| match length | steps | mean accepted of 7 | P(first draft accepted) |")
    print("|---|---|---|---|")
    for m, row in results["accepted_by_match_length"].items():
        print(f"| {m} | {row['steps']} | {row['mean_accepted_of_7']:.2f} | "
              f"{row['p_accepted_at_least'][0]:.2f} |")
    print("\n| policy | steps | plain steps | tau | predicted speed vs plain |")
    print("|---|---|---|---|---|")
    for name, (min_n, max_n, k_of) in policies.items():
        row = predicted_speed(replay(answers, min_n, max_n, k_of, FLAGS.max_new_tokens), cost)
        results["policies"][name] = row
        print(f"| {name} | {row['steps']} | {row['plain_steps']} | {row['tau']:.2f} | "
              f"{row['predicted_speedup']:.2f}x |")
    if FLAGS.out:
        from dblast_jax.io.atomic import atomic_write_text
        atomic_write_text(FLAGS.out, json.dumps(results, indent=1))
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
