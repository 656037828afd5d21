# Sourced (`STEPS=300 source experiments/budget/from_trunk.sh`) by the run scripts that
# train on from a trained K = 1 trunk (docs/research_log.md sections 4.7 and 4.8): it sources
# recipe.sh with those runs' defaults (lr 5e-4 unless LR is set, no CPU-seconds cap: the
# step schedule ends them), then provides section 4.6's K = 1 drafter as it was shipped in
# pretrained/ until section 4.7 replaced it (commit b96a34a; the bfloat16 export of
# runs/budget/taps5_distill_head4k), taken from git, and the settings every such run
# shares: five taps, distillation (distill_weight 1.0, top-64) and the sampled training
# head (4,096 frequent + 1,024 sampled tokens).
LR=${LR:-5e-4}
BUDGET_CPU_S=100000
source experiments/budget/recipe.sh
HEAD=(--override=train_head_tokens=4096 --override=train_head_sampled=1024)
TRUNK=runs/budget/trunk_s10
if [ ! -f $TRUNK/model.safetensors ]; then
  mkdir -p $TRUNK
  for f in config.json model.safetensors; do
    git show b96a34a:pretrained/smollm2-135m-instruct/smollm2-dflash-k1/$f > $TRUNK/$f.tmp \
      && mv $TRUNK/$f.tmp $TRUNK/$f
  done
fi
# from_trunk NAME [flags...]: the flags come last, so they override the shared ones
from_trunk() { local name=$1; shift; run_budget "$name" "${TAPS5[@]}" "${HEAD[@]}" \
  --override=distill_weight=1.0 --override=drafter_init=drafter:$TRUNK "$@"; }
