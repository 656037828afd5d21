#!/usr/bin/env bash
# Issue 14, cheaper steps (docs/research_log.md section 4.6): the five-tap distillation recipe of
# section 4.5 with the sampled training head (train/sampled_head.py): each log q is
# normalised over the 4,096 most frequent response tokens plus 1,024 tokens drawn from
# the rest at every step, instead of all 49,152. Same data, batch, anchors, schedule,
# held-out scoring and feature cache as taps5_distill, so the curves compare at equal
# steps and at equal CPU-seconds. Resumable: rerun after a kill. Also continues
# taps5_distill (to step 1,000) beside it, so both share the machine alike; once that
# ends, the sampled head with 64 anchors per sequence instead of 16 (a cached sequence's
# taps and fc pass then feed four times the labels; the median sequence has 156 eligible
# anchors). Run it as BUDGET_CPU_S=100000 bash experiments/recipe/sampled_head.sh: every
# run goes to the end of its 1,000-step schedule.
set -u
cd "$(dirname "$0")/../.."
source experiments/budget/recipe.sh
run() { run_budget "$@" "${TAPS5[@]}" --override=distill_weight=1.0; }
HEAD=(--override=train_head_tokens=4096 --override=train_head_sampled=1024)
run taps5_distill_head4k "${HEAD[@]}" &
run taps5_distill
run taps5_distill_head4k_a64 "${HEAD[@]}" --override=anchors_per_sequence=64
wait
