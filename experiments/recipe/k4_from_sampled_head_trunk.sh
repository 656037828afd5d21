#!/usr/bin/env bash
# Issue 14, the mixture from the new trunk (docs/research_log.md section 4.7): K = 4 (NLL + AL) and
# its K = 1 control (NLL + AL) each start from section 4.6's K = 1 drafter (five taps,
# distillation, the sampled head, 1,000 steps; shipped until this section) and train more steps with distillation (distill_weight 1.0) and the sampled
# training head (4,096 frequent + 1,024 sampled tokens), same data, batch, anchors,
# feature cache and held-out blocks as every curve of section 4. Section 4.4 ran the same
# pair from the older trunk with the full head, where the K-fold head made the K = 4 step
# 3.3x the K = 1 step; the sampled head shrinks the part of the step that K multiplies.
# First the pair over section 4.4's 300-step schedule (lr 5e-4, scored every 50 steps),
# then the same pair over a 1,000-step schedule (scored every 100 steps): does the
# mixture's gain grow with a longer run? Resumable: rerun after a kill (finished runs
# return at once). Workdirs and logs land in runs/budget/.
set -u
cd "$(dirname "$0")/../.."
STEPS=300 source experiments/budget/from_trunk.sh   # the recipe, the trunk, from_trunk NAME [flags]
from_trunk k4al_from_head4k --experiment=smollm2_dblast_k4_al
from_trunk k1al_from_head4k --experiment=smollm2_k1_al
STEPS=1000 source experiments/budget/recipe.sh
from_trunk k4al_from_head4k_1000 --experiment=smollm2_dblast_k4_al --segment_steps=100
from_trunk k1al_from_head4k_1000 --experiment=smollm2_k1_al --segment_steps=100
# Last, the 300-step K = 4 again with the full LM head (train_head_tokens=0): the sampled
# head against the full one for the mixture, at equal steps and at equal CPU-seconds.
STEPS=300 source experiments/budget/recipe.sh
from_trunk k4al_from_head4k_fullhead --experiment=smollm2_dblast_k4_al \
  --override=train_head_tokens=0
