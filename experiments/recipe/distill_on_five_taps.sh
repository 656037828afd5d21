#!/usr/bin/env bash
# Issue 14, two levers on the five-tap recipe (docs/research_log.md section 4.5): distillation from
# the target's top-64 distribution (section 4's best lever on one tap, never run with five
# taps), and the same with tap_rms_scaling (fc trained as on taps divided by their
# per-channel RMS, train/tap_scaling.py: SmolLM2's massive activations no longer dominate
# fc). Both on the section-4.2 taps5 recipe (data, batch, anchors, schedule, b = 8, mask
# token 16, held-out scoring), to 1,500 training CPU-seconds side by side, so the curves
# compare with experiments/budget/results/taps5.jsonl. One five-tap feature cache with the
# teacher (float32, ~6.6 GB) serves both. Resumable: rerun after a kill. Workdirs and logs
# land in runs/budget/.
set -u
cd "$(dirname "$0")/../.."
source experiments/budget/recipe.sh
run() { run_budget "$@" "${TAPS5[@]}" --override=distill_weight=1.0; }
run taps5_distill &
# the second run shares the first's feature cache: start it once the first is training
until [ -s runs/budget/taps5_distill/budget_curve.jsonl ]; do sleep 20; done
run taps5_distill_rms --override=tap_rms_scaling=true &
wait
