#!/usr/bin/env bash
# Issue 14, the mixture from a trained trunk (docs/research_log.md section 4.3): K = 4 (NLL + AL) and its
# K = 1 control (NLL + AL) each start from the finished five-tap K = 1 DFlash drafter
# (runs/budget/taps5, 1,000 steps: five_taps_and_two_layers.sh) with drafter_init=drafter:WORKDIR and
# train STEPS more steps on the same data, batch, anchors and feature cache, side by side
# on the same held-out blocks (T_v = 1.0; sampled-branch and sampled-mixture). The K = 4
# head costs ~3.3x the K = 1 head per step, so starting it from a trained trunk instead of
# from scratch is what makes the mixture affordable here.
# Resumable: rerun after a kill. Workdirs and logs land in runs/budget/.
set -u
cd "$(dirname "$0")/../.."
STEPS=${STEPS:-300}
LR=${LR:-5e-4}
BUDGET_CPU_S=100000
source experiments/budget/recipe.sh
run() { run_budget "$@" "${TAPS5[@]}" --override=drafter_init=drafter:runs/budget/taps5; }
run k1al_from_taps5 --experiment=smollm2_k1_al
run k4al_from_taps5 --experiment=smollm2_dblast_k4_al
