#!/usr/bin/env bash
# Issue 14, two levers on the five-tap recipe (RESULTS.md section 4.5): distillation from
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
mkdir -p runs/budget
COMMON=(--segment_steps=50 --budget_cpu_s=1500 --max_steps=1000 --validation_batches=8
  --override=data=corpora/smollm2_t1 --override=data_shards=68 --override=batch_size=8
  --override=seq_len=256 --override=anchors_per_sequence=16 --override=learning_rate=1e-3
  --override=keep_checkpoints=2 --override=feature_cache=runs/budget/features
  --override=target_layer_ids=1,7,14,20,27 --override=drafter_layers=1
  --override=distill_weight=1.0)
run() { name=$1; shift
  nice -n 10 python experiments/budget/budget_curve.py --workdir=runs/budget/$name "${COMMON[@]}" "$@" \
    >> runs/budget/$name.log 2>&1; }
run taps5_distill &
# the second run shares the first's feature cache: start it once the first is training
until [ -s runs/budget/taps5_distill/budget_curve.jsonl ]; do sleep 20; done
run taps5_distill_rms --override=tap_rms_scaling=true &
wait
