#!/usr/bin/env bash
# Does a flagship chain's current export decode faster than what ships? Its drafter
# (KEEP/drafter, the chain LAYERS and K name) beside the shipped K = 1 drafter, prompt lookup
# (`ngram`) and the export combined with prompt lookup, on the four benchmarks, batch 1:
# T = 0 / 0.7 with argmax drafts (greedy-branch) and T = 1.0 / 1.5 with drafts sampled from
# q (sampled-branch). Each `dblast eval` also decodes the same prompts with the same seeds
# without a drafter, so every speed-up is a ratio measured side by side in one run; gains
# are against the shipped drafter. Then the export drafting shorter blocks than it was
# trained with (@block=4/3/2: a cheaper verify pass per step, the only way a drafter that
# accepts ~1.5 tokens a step pays on this CPU), T = 0 / 0.7. The results (results.md,
# results.json, plots) land in KEEP/benchmarks/{argmax,sampled,blocks} and are committed
# with the chain. Resumable: a killed
# run picks up at the next unfinished (benchmark, temperature, drafter).
#
#     bash experiments/flagship/eval_export.sh               # ~50 min on an idle 2-core CPU
#     LAYERS=2 PROMPTS=2 bash experiments/flagship/eval_export.sh   # the depth chain, quicker
set -eu
cd "$(dirname "$0")/../.."
source experiments/flagship/chain.sh  # KEEP of the chain LAYERS and K pick
[ -f $KEEP/drafter/config.json ] || { echo "no export to evaluate: $KEEP/drafter/config.json" \
    "is missing (finish a leg of the chain first)" >&2; exit 1; }
OUT=${OUT:-$KEEP/benchmarks}
PROMPTS=${PROMPTS:-4}
NEW_TOKENS=${NEW_TOKENS:-96}
SHIPPED=pretrained:smollm2-dflash-k1
EXPORT=$KEEP/drafter
LABEL=flagship${NAME#k1}  # flagship, flagship_depth2, ...
dblast eval --drafter shipped=$SHIPPED --drafter $LABEL=$EXPORT --drafter ngram=ngram \
  --drafter $LABEL+ngram=$EXPORT+ngram --baseline shipped --temperatures 0 0.7 \
  --prompts-per-benchmark $PROMPTS --max-new-tokens $NEW_TOKENS --batch-size 1 \
  --no-progress --out $OUT/argmax "$@"
dblast eval --drafter shipped=$SHIPPED@mode=sampled-branch \
  --drafter $LABEL=$EXPORT@mode=sampled-branch --drafter ngram=ngram \
  --drafter $LABEL+ngram=$EXPORT+ngram@mode=sampled-branch --baseline shipped \
  --temperatures 1.0 1.5 --prompts-per-benchmark $PROMPTS --max-new-tokens $NEW_TOKENS \
  --batch-size 1 --no-progress --out $OUT/sampled "$@"
dblast eval --drafter $LABEL=$EXPORT --blocks 4 3 2 --baseline $LABEL --temperatures 0 0.7 \
  --prompts-per-benchmark $PROMPTS --max-new-tokens $NEW_TOKENS --batch-size 1 \
  --no-progress --out $OUT/blocks "$@"
