#!/usr/bin/env bash
# Copying against learning (issue 30's tables): plain decoding, the n-gram drafter (prompt
# lookup inside the loop: ngram, min_n 2, max_n 4, 7 drafts), the shipped K = 1 drafter and
# the two combined (K1+ngram: n-gram drafts where the text's suffix matched >= 2 tokens,
# else the K = 1's) on the four benchmarks, batch 1, 128 new tokens. T = 0 / 0.7 with argmax
# drafts; T = 1.0 / 1.5 with the trained drafts sampled from q (sampled-branch), where they
# are accepted most. Plain decoding runs in each command on the same prompts and seeds, so
# every speedup is a ratio measured side by side. Resumable (OUT/*/rows.jsonl).
set -eu
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/smollm2/eval_ngram}
PROMPTS=${PROMPTS:-4}
NEW_TOKENS=${NEW_TOKENS:-128}
K1=pretrained:smollm2-dflash-k1
dblast eval --drafter ngram=ngram --drafter k1=$K1 --drafter k1+ngram=$K1+ngram \
  --baseline k1 --temperatures 0 0.7 --prompts-per-benchmark $PROMPTS \
  --max-new-tokens $NEW_TOKENS --batch-size 1 --no-progress --out $OUT/b1
dblast eval --drafter ngram=ngram --drafter k1_sampled=$K1@mode=sampled-branch \
  --drafter k1+ngram_sampled=$K1+ngram@mode=sampled-branch --baseline k1_sampled \
  --temperatures 1.0 1.5 --prompts-per-benchmark $PROMPTS --max-new-tokens $NEW_TOKENS \
  --batch-size 1 --no-progress --out $OUT/b1_sampled
