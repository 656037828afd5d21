# Sourced (`STEPS=300 source experiments/budget/from_trunk.sh`) by the scripts that train on
# from the K = 1 trunk of the shipped drafters (docs/research_log.md sections 4.7 and 4.8:
# experiments/smollm2/train_*.sh, experiments/claims/, experiments/recipe/
# k4_from_sampled_head_trunk.sh). It provides the trunk, trained from the corpus first if it
# is not there yet, sources recipe.sh with the from-trunk defaults (lr 5e-4 unless LR is
# set, no CPU-seconds cap: the step schedule STEPS ends each run), and defines
# from_trunk NAME [flags...] with the settings every such run shares: five taps,
# distillation (distill_weight 1.0, top-64) and the sampled training head (4,096 frequent +
# 1,024 sampled tokens).
#
# The trunk, runs/budget/trunk_k1: the bfloat16 export of runs/budget/taps5_distill_head4k,
# 1,000 steps of the DFlash loss + distillation with the sampled head at lr 1e-3 (the run
# of experiments/recipe/sampled_head.sh, with its arguments; ~1 CPU-hour with its held-out
# scoring, after a ~1 CPU-hour feature cache with the teacher). The runs of sections 4.7 and
# 4.8 started from that export as it shipped in pretrained/ until 2026-12-02; for those
# exact bytes instead of a retrained trunk, put config.json and model.safetensors of
# `git show b96a34a:pretrained/smollm2-135m-instruct/smollm2-dflash-k1/FILE` into
# runs/budget/trunk_k1 first. (A runs/budget/trunk_s10 from before 2026-12-03 is that copy:
# `mv runs/budget/trunk_s10 runs/budget/trunk_k1`.)
HEAD=(--override=train_head_tokens=4096 --override=train_head_sampled=1024)
TRUNK=runs/budget/trunk_k1
if [ ! -f $TRUNK/model.safetensors ]; then
  LR=1e-3 STEPS=1000 BUDGET_CPU_S=100000 source experiments/budget/recipe.sh
  run_budget taps5_distill_head4k "${HEAD[@]}" "${TAPS5[@]}" --override=distill_weight=1.0 \
    && nice -n 10 dblast export runs/budget/taps5_distill_head4k --out $TRUNK \
      --dtype bfloat16 >> runs/budget/trunk_k1.log 2>&1 \
    || { echo "the trunk did not finish: see runs/budget/taps5_distill_head4k.log and" \
              "runs/budget/trunk_k1.log" >&2; exit 1; }
fi
LR=${LR:-5e-4}
BUDGET_CPU_S=100000
source experiments/budget/recipe.sh
# from_trunk NAME [flags...]: the flags come last, so they override the shared ones
from_trunk() { local name=$1; shift; run_budget "$name" "${TAPS5[@]}" "${HEAD[@]}" \
  --override=distill_weight=1.0 --override=drafter_init=drafter:$TRUNK "$@"; }
