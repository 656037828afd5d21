#!/usr/bin/env bash
# Rebuilds the shipped K = 4 drafter (pretrained/smollm2-135m-instruct/smollm2-dblast-k4)
# end to end from the committed corpus (corpora/smollm2_t1, shards 0-67; 68-71 held out):
#   1. the K = 1 trunk (experiments/budget/from_trunk.sh, trained if runs/budget/trunk_k1 is
#      absent; shared with train_dflash_k1.sh): five taps, one drafter layer, mask token 16,
#      1,000 steps of the DFlash loss + top-64 distillation with the sampled training head,
#      exported in bfloat16;
#   2. 1,000 steps from it of the K = 4 mixture with NLL + AL + distillation
#      (smollm2_dblast_k4_al, lr 5e-4, held-out points every 100 steps):
#      runs/budget/k4al_from_head4k_1000;
#   3. the bfloat16 export with the training shards' token counts (OUT, default
#      runs/budget/export/smollm2-dblast-k4).
# The arguments are those of the runs that made the shipped drafter
# (experiments/recipe/sampled_head.sh's taps5_distill_head4k, then
# experiments/recipe/k4_from_sampled_head_trunk.sh's k4al_from_head4k_1000): their workdirs
# are resumed, not retrained. Measured on this 2-core CPU (training + held-out scoring):
# the feature cache with the teacher ~0.9 CPU-h, the trunk ~1.0, stage 2 ~0.5. Resumable:
# rerun after a kill. Compare the result with the shipped one on held-out answers:
#   dblast validate --drafter shipped=pretrained:smollm2-dblast-k4 --drafter new=OUT \
#       --baseline shipped --data corpora/smollm2_t1 --shards 68:72 --batches 16 --out VAL
set -u
cd "$(dirname "$0")/../.."
STEPS=1000 source experiments/budget/from_trunk.sh   # the recipe, the trunk, from_trunk NAME [flags]
from_trunk k4al_from_head4k_1000 --experiment=smollm2_dblast_k4_al --segment_steps=100 \
  || { echo "training stopped: see runs/budget/k4al_from_head4k_1000.log" >&2; exit 1; }
OUT=${OUT:-runs/budget/export/smollm2-dblast-k4}
nice -n 10 dblast export runs/budget/k4al_from_head4k_1000 --out $OUT --dtype bfloat16 \
  --token-counts-from corpora/smollm2_t1:0:68
