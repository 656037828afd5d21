#!/usr/bin/env bash
# Issue 14's equal-budget runs (RESULTS.md section 4): the current recipe, + distillation
# from the target's top-64 distribution, + warm start from the target's layers, each to
# 1,500 training CPU-seconds, side by side. Resumable: rerun after a kill (raise
# --budget_cpu_s to train on). Workdirs and logs land in runs/budget/.
set -u
cd "$(dirname "$0")/../.."
mkdir -p runs/budget
COMMON=(--segment_steps=50 --budget_cpu_s=1500 --max_steps=1000 --validation_batches=8
  --override=data=corpora/smollm2_t1 --override=data_shards=68 --override=batch_size=8
  --override=seq_len=256 --override=anchors_per_sequence=16 --override=learning_rate=1e-3
  --override=drafter_layers=1 --override=keep_checkpoints=2
  --override=feature_cache=runs/budget/features)
run() { name=$1; shift
  nice -n 10 python experiments/budget/budget_curve.py --workdir=runs/budget/$name "${COMMON[@]}" "$@" \
    > runs/budget/$name.log 2>&1; }
run baseline &
run distill --override=distill_weight=1.0 &
# C shares B's feature cache (teacher top-k): start it once B is training
until [ -s runs/budget/distill/budget_curve.jsonl ]; do sleep 20; done
run distill_warm --override=distill_weight=1.0 --override=drafter_init=target &
wait
