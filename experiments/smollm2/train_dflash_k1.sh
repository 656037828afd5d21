#!/usr/bin/env bash
# Rebuilds the K = 1 drafter shipped until 2026-12-05 as pretrained:smollm2-dflash-k1, the
# starting point of the K = 1 flagship run that ships now (experiments/flagship/train_k1.sh),
# end to end from the committed corpus (corpora/smollm2_t1, shards 0-67; 68-71 held out):
#   1. the K = 1 trunk (experiments/budget/from_trunk.sh, trained if runs/budget/trunk_k1 is
#      absent): five taps, one drafter layer, mask token 16, 1,000 steps of the DFlash loss
#      + top-64 distillation with the sampled training head, exported in bfloat16;
#   2. 1,000 more steps from it of NLL + AL + distillation (smollm2_k1_al, lr 5e-4, held-out
#      points every 100 steps): runs/budget/k1al_from_head4k_1000;
#   3. the bfloat16 export with the training shards' token counts (OUT, default
#      runs/budget/export/smollm2-dflash-k1).
# The arguments are those of the runs that made the shipped drafter
# (experiments/recipe/sampled_head.sh's taps5_distill_head4k, then
# experiments/recipe/k4_from_sampled_head_trunk.sh's k1al_from_head4k_1000): their workdirs
# are resumed, not retrained. Measured on this 2-core CPU (training + held-out scoring):
# the feature cache with the teacher ~0.9 CPU-h, the trunk ~1.0, stage 2 ~0.3. Resumable:
# rerun after a kill. Compare the result with the shipped one on held-out answers:
#   dblast validate --drafter shipped=pretrained:smollm2-dflash-k1 --drafter new=OUT \
#       --baseline shipped --data corpora/smollm2_t1 --shards 68:72 --batches 16 --out VAL
set -u
cd "$(dirname "$0")/../.."
STEPS=1000 source experiments/budget/from_trunk.sh   # the recipe, the trunk, from_trunk NAME [flags]
from_trunk k1al_from_head4k_1000 --experiment=smollm2_k1_al --segment_steps=100 \
  || { echo "training stopped: see runs/budget/k1al_from_head4k_1000.log" >&2; exit 1; }
OUT=${OUT:-runs/budget/export/smollm2-dflash-k1}
nice -n 10 dblast export runs/budget/k1al_from_head4k_1000 --out $OUT --dtype bfloat16 \
  --token-counts-from corpora/smollm2_t1:0:68
