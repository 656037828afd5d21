#!/usr/bin/env bash
# Issue 14, the drafter's inputs and depth (docs/research_log.md section 4.2): the section-4 baseline
# recipe with five target taps spread over the depth (layers 1, 7, 14, 20, 27: DFlash's
# spacing for five taps of a 30-layer target) instead of one middle tap, with one and with
# two drafter layers, each to 1,500 training CPU-seconds side by side. Same data, schedule
# and held-out scoring as distill_and_warm_start.sh, so the curves compare with its baseline.
# Resumable: rerun after a kill. Workdirs and logs land in runs/budget/.
set -u
cd "$(dirname "$0")/../.."
source experiments/budget/recipe.sh
run() { run_budget "$@" --override=target_layer_ids=1,7,14,20,27; }
run taps5 --override=drafter_layers=1 &
# the second run shares the first's feature cache: start it once the first is training
until [ -s runs/budget/taps5/budget_curve.jsonl ]; do sleep 20; done
run taps5_l2 --override=drafter_layers=2 &
wait
