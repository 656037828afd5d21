#!/usr/bin/env bash
# The K = 1 flagship: one long run instead of many short ones (issue 29). The recipe of the
# drafters shipped today (five taps, one drafter layer, NLL + AL + top-64 distillation,
# the sampled training head of 4,096 frequent + 1,024 sampled tokens, batch 8 x 256,
# 16 anchors per sequence) on a 50,000-step cosine schedule (~8 passes over every anchor
# position of the 68 training shards), warm-started from the shipped K = 1 drafter.
# Held-out acceptance (T_v = 1.0, shards 68-71, 8 fixed batches) is scored every 1,000
# steps into runs/flagship/k1/budget_curve.jsonl against the training CPU-seconds;
# checkpoints every 250 steps. One command resumes it after a kill, or in a later
# session once runs/flagship/k1 is restored (scripts/..., see experiments/README.md):
#     bash experiments/flagship/train_k1.sh
set -u
cd "$(dirname "$0")/../.."
mkdir -p runs/flagship
nice -n 10 python experiments/budget/budget_curve.py --experiment=smollm2_k1_al \
  --workdir=runs/flagship/k1 --max_steps=${STEPS:-50000} --segment_steps=1000 \
  --checkpoint_every=250 --budget_cpu_s=1e9 --validation_batches=8 \
  --override=data=corpora/smollm2_t1 --override=data_shards=68 \
  --override=batch_size=8 --override=seq_len=256 --override=anchors_per_sequence=16 \
  --override=learning_rate=${LR:-6e-4} --override=warmup_fraction=0.02 \
  --override=keep_checkpoints=2 --override=feature_cache=runs/flagship/features \
  --override=target_layer_ids=1,7,14,20,27 --override=drafter_layers=1 \
  --override=train_head_tokens=4096 --override=train_head_sampled=1024 \
  --override=distill_weight=1.0 \
  --override=drafter_init=drafter:pretrained/smollm2-135m-instruct/smollm2-dflash-k1 \
  "$@" >> runs/flagship/k1.log 2>&1
