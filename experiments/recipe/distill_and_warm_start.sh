#!/usr/bin/env bash
# Issue 14's equal-budget runs (docs/research_log.md section 4): the current recipe, + distillation
# from the target's top-64 distribution, + warm start from the target's layers, each to
# 1,500 training CPU-seconds, side by side. Resumable: rerun after a kill (raise
# --budget_cpu_s to train on). Workdirs and logs land in runs/budget/.
set -u
cd "$(dirname "$0")/../.."
source experiments/budget/recipe.sh
run() { run_budget "$@" --override=drafter_layers=1; }
run baseline &
run distill --override=distill_weight=1.0 &
# C shares B's feature cache (teacher top-k): start it once B is training
until [ -s runs/budget/distill/budget_curve.jsonl ]; do sleep 20; done
run distill_warm --override=distill_weight=1.0 --override=drafter_init=target &
wait
