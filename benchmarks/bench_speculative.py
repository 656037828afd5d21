"""Speculative decoding costs on this machine, measured side by side in one run.

  drafter-cost : one draft pass (K = 1 / K = 4; greedy-branch projects one branch,
                 mixture all K) vs one target verify pass over b tokens.
  loop         : per-step time of the on-device while_loop vs the same jitted step
                 driven from Python (tiny models, batch 1).
  e2e          : speculative vs plain tokens/s on the real target, with tau beside it.
                 An untrained (random) drafter shows the overhead floor.
  draft-vocab  : the cost of one speculative step (draft pass + verify pass over b
                 tokens) against one plain decode step, with the drafter's full LM head
                 and with draft-time vocabularies of N tokens (--draft-vocab), for a
                 drafter that ships its token counts (e.g. pretrained:smollm2-dflash-k1).
  mechanism-cost : the draft and the whole speculative step (draft + verify + cache
                 updates: the loop body) of each way of making a block dependent - the K = 4
                 mixture, the serial previous-token correction, block-causal drafting,
                 K = 4 + correction - against the independent K = 1 drafter and a plain
                 decode step, at --mechanism-temperature with sampled drafts (the cost
                 column of the dependent-drafter comparison, issue 32).

    python benchmarks/bench_speculative.py --parts drafter-cost loop e2e
    python benchmarks/bench_speculative.py --parts draft-vocab \
        --drafter pretrained:smollm2-dflash-k1 --batch 1 8 --draft-vocab 4096 8192 16384
    python benchmarks/bench_speculative.py --parts mechanism-cost --batch 1 8 \
        --json benchmarks/results_mechanism_cost.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dblast_jax import draft_vocab as DV
from dblast_jax.config import DrafterConfig, SamplingConfig, TargetConfig
from dblast_jax.generation import (acceptance_stats, drafter_from_spec, encode_prompts,
                                   init_drafter, load_drafter, load_target, with_draft_vocab)
from dblast_jax import sampler as S
from dblast_jax.models import drafter as D
from dblast_jax.models import target as T
from dblast_jax.sampler import (cache_size_for, generate_tokens, pad_prompts,
                                python_driven_speculative, spec_cache_size,
                                speculative_generate_tokens)


def median_time(fn, repeats):
    jax.block_until_ready(fn())  # compile / warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_median_times(calls: dict, repeats: int) -> dict:
    """Median seconds of each call, timed round-robin (one of each per round), so that a
    load change on a shared machine hits every call alike."""
    for fn in calls.values():
        jax.block_until_ready(fn())  # compile / warm up
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def drafter_cost(target, block, batches, repeats):
    rows = []
    tc = target.config
    cache_len = 256
    for batch in batches:
        tokens = jnp.ones((batch, 64), jnp.int32)
        lengths = jnp.full((batch,), 64, jnp.int32)
        _, _, tcache = T.prefill(target.params, tokens, lengths, config=tc, cache_size=cache_len)
        verify = jax.jit(functools.partial(T.extend, config=tc))
        block_tokens = jnp.ones((batch, block), jnp.int32)
        pos = jnp.full((batch,), 64, jnp.int32)
        anchor = jnp.ones((batch,), jnp.int32)
        t_verify = median_time(lambda: verify(target.params, block_tokens, pos, tcache)[0], repeats)
        for k in (1, 4):
            dcfg = DrafterConfig.for_target(tc, num_layers=1, block_size=block, num_categories=k)
            drafter = init_drafter(target, dcfg, 0)
            dcache = D.init_draft_cache(dcfg, batch, cache_len)
            taps = jnp.zeros((batch, 64, len(dcfg.target_layer_ids), tc.hidden_size))
            dcache = D.append_context(drafter.params, taps, jnp.zeros((batch,), jnp.int32), dcache,
                                      drafter_config=dcfg)

            def one_branch(dp, tp, cache):
                hidden, prior = D.draft_hidden(dp, tp, anchor, pos, cache,
                                               drafter_config=dcfg, target_config=tc)
                z = jnp.argmax(prior, -1)
                return jnp.argmax(D.branch_logits(tp, D.select_branch(hidden, z), tc), -1)

            def all_branches(dp, tp, cache):
                hidden, _ = D.draft_hidden(dp, tp, anchor, pos, cache,
                                           drafter_config=dcfg, target_config=tc)
                return jnp.argmax(D.branch_logits(tp, hidden, tc), -1)

            def body_only(dp, tp, cache):
                return D.draft_hidden(dp, tp, anchor, pos, cache,
                                      drafter_config=dcfg, target_config=tc)[0]

            for name, fn in (("one branch + head", one_branch), ("all K + head", all_branches),
                             ("drafter body only", body_only)):
                if k == 1 and name == "all K + head":
                    continue
                f = jax.jit(fn)
                t = median_time(lambda: f(drafter.params, target.params, dcache), repeats)
                rows.append({"part": "drafter-cost", "batch": batch, "K": k, "what": name,
                             "draft_ms": 1e3 * t, "verify_ms": 1e3 * t_verify,
                             "ratio": t / t_verify})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def draft_vocab_cost(target, drafter, sizes, batches, repeats):
    """ms of a plain decode step, a verify pass over the drafter's block and its draft
    pass (argmax drafts: one K = 1 branch) with the full head and each draft vocabulary,
    timed side by side; step_over_plain = (draft + verify) / plain decode."""
    rows = []
    tc, dcfg = target.config, drafter.config
    block, cache_len, ctx = dcfg.block_size, 256, 64
    variants = [("full", drafter)] + [(str(n), with_draft_vocab(drafter, target, n))
                                      for n in sizes]
    for batch in batches:
        tokens = jnp.ones((batch, ctx), jnp.int32)
        lengths = jnp.full((batch,), ctx, jnp.int32)
        _, taps, tcache = T.prefill(target.params, tokens, lengths, config=tc,
                                    cache_size=cache_len, tap_layers=dcfg.target_layer_ids)
        extend = jax.jit(functools.partial(T.extend, config=tc))
        pos = jnp.full((batch,), ctx, jnp.int32)
        anchor = jnp.ones((batch,), jnp.int32)
        dcache = D.init_draft_cache(dcfg, batch, cache_len)
        dcache = D.append_context(drafter.params, taps, jnp.zeros((batch,), jnp.int32),
                                  dcache, drafter_config=dcfg)

        @jax.jit
        def draft(dp, tp, cache):
            core, dv = DV.split(dp)
            hidden, prior = D.draft_hidden(core, tp, anchor, pos, cache, drafter_config=dcfg,
                                           target_config=tc)
            h = D.select_branch(hidden, jnp.argmax(prior, -1))
            return DV.to_target_ids(dv, jnp.argmax(DV.draft_logits(tp, dv, h, tc), -1))

        calls = {"plain": lambda: extend(target.params, anchor[:, None], pos, tcache)[0],
                 "verify": lambda: extend(target.params, jnp.ones((batch, block), jnp.int32),
                                          pos, tcache)[0]}
        for name, variant in variants:
            calls[name] = functools.partial(draft, variant.params, target.params, dcache)
        t = interleaved_median_times(calls, repeats)
        for name, _ in variants:
            rows.append({"part": "draft-vocab", "batch": batch, "block": block,
                         "draft_vocab": name, "plain_step_ms": 1e3 * t["plain"],
                         "verify_ms": 1e3 * t["verify"], "draft_ms": 1e3 * t[name],
                         "step_over_plain": (t[name] + t["verify"]) / t["plain"]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


# name -> (DrafterConfig.for_target options, verify mode at T > 0): the variants of
# experiments/claims/dependent_drafters.sh, each drafted and verified the way it decodes
MECHANISMS = {
    "k1": (dict(num_categories=1), "sampled-branch"),
    "dblast_k4": (dict(num_categories=4), "sampled-mixture"),
    "correction": (dict(num_categories=1, correction="previous-token"), "sampled-branch"),
    "block_causal": (dict(num_categories=1, block_attention="causal"), "sampled-branch"),
    "k4_correction": (dict(num_categories=4, correction="previous-token"), "sampled-mixture"),
}


def mechanism_cost(target, block, batches, temperature, repeats, ctx=64):
    """ms of the draft and of one whole speculative step (the while_loop's body) of each
    mechanism, timed side by side with a plain decode step; ratios against K = 1. The
    drafters are untrained: the cost does not depend on the weights."""
    rows = []
    tc = target.config
    for batch in batches:
        tokens = jnp.ones((batch, ctx), jnp.int32)
        lengths = jnp.full((batch,), ctx, jnp.int32)
        plain_cache = ctx + block + 64
        _, _, tcache = T.prefill(target.params, tokens, lengths, config=tc,
                                 cache_size=plain_cache)
        extend = jax.jit(functools.partial(T.extend, config=tc))
        pos = jnp.full((batch,), ctx, jnp.int32)
        calls = {"plain": lambda: extend(target.params, tokens[:, :1], pos, tcache)[0]}
        for name, (options, mode) in MECHANISMS.items():
            dcfg = DrafterConfig.for_target(tc, num_layers=1, block_size=block, **options)
            drafter = init_drafter(target, dcfg, 0)
            sampling = SamplingConfig(temperature=temperature, max_new_tokens=64,
                                      verify_mode=mode, stop_tokens=())
            cache = spec_cache_size(ctx, sampling, block)
            init = jax.jit(S._spec_init, static_argnums=(5, 6, 7, 8))
            state = init(target.params, drafter.params, tokens, lengths, jax.random.key(0),
                         tc, dcfg, sampling, cache)
            body = jax.jit(functools.partial(S._spec_body, tcfg=tc, dcfg=dcfg,
                                             sampling=sampling))
            draft = jax.jit(lambda st, dp, dcfg=dcfg, sampling=sampling: S._draft(
                dp, target.params, st, S.step_keys(st.rng, st.step), tc, dcfg, sampling))
            calls[f"{name}/draft"] = functools.partial(draft, state, drafter.params)
            calls[f"{name}/step"] = functools.partial(body, state, target.params,
                                                      drafter.params)
        t = interleaved_median_times(calls, repeats)
        for name in MECHANISMS:
            rows.append({"part": "mechanism-cost", "batch": batch, "block": block,
                         "temperature": temperature, "mechanism": name,
                         "verify_mode": MECHANISMS[name][1],
                         "plain_step_ms": 1e3 * t["plain"],
                         "draft_ms": 1e3 * t[f"{name}/draft"],
                         "step_ms": 1e3 * t[f"{name}/step"],
                         "draft_over_k1": t[f"{name}/draft"] / t["k1/draft"],
                         "step_over_k1": t[f"{name}/step"] / t["k1/step"],
                         "step_over_plain": t[f"{name}/step"] / t["plain"]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def loop_overhead(steps, repeats):
    tc = TargetConfig.tiny_llama()
    target_params = T.init_params(tc, 0)
    dcfg = DrafterConfig.for_target(tc, num_layers=1, block_size=4)
    dparams = D.init_drafter_params(dcfg, tc, 0)
    tokens, lengths = pad_prompts([[1, 2, 3, 4]])
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=steps + 1, stop_tokens=())
    kw = dict(target_config=tc, drafter_config=dcfg, sampling=sampling,
              cache_size=spec_cache_size(tokens.shape[1], sampling, dcfg.block_size))
    run_loop = lambda: speculative_generate_tokens(target_params, dparams, tokens, lengths,
                                                   jax.random.key(0), **kw)
    run_py = lambda: python_driven_speculative(target_params, dparams, tokens, lengths,
                                               jax.random.key(0), **kw)
    n_steps = int((np.asarray(run_loop()[2]) >= 0).sum())
    t_loop = median_time(run_loop, repeats)
    t_py = median_time(run_py, repeats)
    row = {"part": "loop", "steps": n_steps, "while_loop_ms_per_step": 1e3 * t_loop / n_steps,
           "python_loop_ms_per_step": 1e3 * t_py / n_steps, "ratio_python_over_device": t_py / t_loop}
    print(json.dumps(row), flush=True)
    return [row]


def end_to_end(target, drafter, batches, temps, new_tokens, repeats):
    rows = []
    prompts = ["Explain speculative decoding to a new engineer.",
               "Write a short poem about the sea at night.",
               "What are three tips for learning a new language?",
               "How does a hash map work?"]
    for batch in batches:
        ids = encode_prompts(target, [prompts[i % len(prompts)] for i in range(batch)])
        tokens, lengths = pad_prompts(ids)
        for temp in temps:
            sampling = SamplingConfig(temperature=temp, max_new_tokens=new_tokens, stop_tokens=())
            plain_cache = cache_size_for(tokens.shape[1], new_tokens)
            t_plain = median_time(lambda: generate_tokens(
                target.params, tokens, lengths, jax.random.key(0), config=target.config,
                sampling=sampling, cache_size=plain_cache), repeats)
            spec_call = lambda: speculative_generate_tokens(
                target.params, drafter.params, tokens, lengths, jax.random.key(0),
                target_config=target.config, drafter_config=drafter.config, sampling=sampling,
                cache_size=spec_cache_size(tokens.shape[1], sampling, drafter.config.block_size))
            t_spec = median_time(spec_call, repeats)
            _, _, acc, exp = spec_call()
            stats = acceptance_stats(np.asarray(acc), np.asarray(exp), drafter.config.block_size)
            n = batch * new_tokens
            rows.append({"part": "e2e", "batch": batch, "temperature": temp,
                         "new_tokens": new_tokens, "drafter": drafter.name,
                         "plain_tok_s": n / t_plain, "spec_tok_s": n / t_spec,
                         "speedup": t_plain / t_spec, "tau": stats["tau"],
                         "tau_expected": stats["tau_expected"]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--parts", nargs="+", default=["drafter-cost", "loop", "e2e"])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", default="random",
                        help="a drafter folder, or random (untrained, K = 1)")
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--e2e-block", type=int, default=8)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--loop-steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--draft-vocab", type=int, nargs="+", default=[4096, 8192, 16384],
                        help="draft-vocab part: the vocabulary sizes to time")
    parser.add_argument("--mechanism-temperature", type=float, default=1.5,
                        help="mechanism-cost part: the sampling temperature (> 0: drafts "
                             "sampled, as the dependent drafters decode at high T)")
    parser.add_argument("--json", help="also write all rows here")
    args = parser.parse_args()

    rows = []
    target = None
    if {"drafter-cost", "e2e", "draft-vocab", "mechanism-cost"} & set(args.parts):
        target = load_target(args.model)
    if "drafter-cost" in args.parts:
        rows += drafter_cost(target, args.block, args.batch, args.repeats)
    if "draft-vocab" in args.parts:
        rows += draft_vocab_cost(target, drafter_from_spec(args.drafter, target),
                                 args.draft_vocab, args.batch, args.repeats)
    if "mechanism-cost" in args.parts:
        rows += mechanism_cost(target, args.block, args.batch, args.mechanism_temperature,
                               args.repeats)
    if "loop" in args.parts:
        rows += loop_overhead(args.loop_steps, args.repeats)
    if "e2e" in args.parts:
        if args.drafter == "random":
            dcfg = DrafterConfig.for_target(target.config, num_layers=1, block_size=args.e2e_block)
            drafter = init_drafter(target, dcfg, 0)
            drafter.name = f"random-b{args.e2e_block}"
        else:
            drafter = load_drafter(args.drafter, target)
        rows += end_to_end(target, drafter, args.batch, args.temperatures, args.new_tokens,
                           args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
