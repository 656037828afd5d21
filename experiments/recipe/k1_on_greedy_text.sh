#!/usr/bin/env bash
# Issue 14, the T = 0 column: does training on the target's own greedy text raise greedy
# acceptance? K = 1 from the finished five-tap DFlash drafter (runs/budget/taps5, 1,000
# steps on answers sampled at T = 1.0) trains STEPS more steps on the T = 0 corpus
# (runs/corpora/smollm2_t0: the same prompts answered greedily; its first T0_SHARDS shards),
# with the DFlash loss and the recipe of k4_from_taps5_trunk.sh. The greedy corpus is now
# built into corpora/smollm2_t0 by experiments/flagship/regenerate_greedy_corpus.sh (its
# shards 68-71 are the held-out prompts); this script still reads the runs/corpora/ paths
# where it was first written. Held out: the T = 0 answers to the held-out prompts (shards
# 68-71 of corpora/smollm2_t1 answered greedily, built by
#   dblast data regenerate --out runs/corpora/smollm2_t0_heldout \
#       --prompts-from corpora/smollm2_t1:68:72 --gen-temperatures 0 ...
# ), scored every 50 steps; `greedy_accepted` there is greedy verification's accepted
# drafts per block (the leading drafts equal to the target's argmax), i.e. greedy tau - 1.
# Resumable: rerun after a kill. The workdir and log land in runs/budget/.
set -u
cd "$(dirname "$0")/../.."
STEPS=${STEPS:-300}
LR=${LR:-5e-4}
T0_SHARDS=${T0_SHARDS:?set T0_SHARDS: how many shards of runs/corpora/smollm2_t0 to train on}
mkdir -p runs/budget
nice -n 10 python experiments/budget/budget_curve.py --workdir=runs/budget/k1_t0_from_taps5 \
  --segment_steps=50 --budget_cpu_s=100000 --max_steps=$STEPS --validation_batches=8 \
  --validation_data=runs/corpora/smollm2_t0_heldout --validation_shards=0:4 \
  --override=data=runs/corpora/smollm2_t0 --override=data_shards=$T0_SHARDS \
  --override=batch_size=8 --override=seq_len=256 --override=anchors_per_sequence=16 \
  --override=learning_rate=$LR --override=keep_checkpoints=2 \
  --override=feature_cache=runs/budget/features_t0 \
  --override=target_layer_ids=1,7,14,20,27 --override=drafter_layers=1 \
  --override=drafter_init=drafter:runs/budget/taps5 \
  >> runs/budget/k1_t0_from_taps5.log 2>&1
