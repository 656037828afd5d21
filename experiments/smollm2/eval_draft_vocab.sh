#!/usr/bin/env bash
# What a draft-time vocabulary costs and saves (issue 30): the shipped K = 1 drafter with
# its full 49,152-token head against the same drafter drafting over its 4,096 / 8,192 /
# 16,384 most frequent response tokens (`@draft_vocab=N`: exact, cheaper draft passes,
# fewer acceptances) held out, then on the four benchmarks, batch 1, beside the n-gram
# drafter and the combined drafter with and without it. T = 0 / 0.7 with argmax drafts; T = 1.0 / 1.5 with drafts
# sampled from q (sampled-branch). Plain decoding runs in each command on the same prompts
# and seeds, so every speedup is a ratio measured side by side. Resumable (OUT/*/rows.jsonl).
set -eu
cd "$(dirname "$0")/../.."
OUT=${OUT:-experiments/smollm2/results_draft_vocab}
PROMPTS=${PROMPTS:-2}
NEW_TOKENS=${NEW_TOKENS:-96}
K1=pretrained:smollm2-dflash-k1
# held out first (corpora/smollm2_t1 shards 68-71, T_v = 1.0, 16 batches paired across
# drafters): the expected accepted drafts each vocabulary keeps
[ -f $OUT/validation_t1.0/validation.json ] || dblast validate --drafter k1=$K1 \
  --drafter k1_v4k=$K1@draft_vocab=4096 --drafter k1_v8k=$K1@draft_vocab=8192 \
  --drafter k1_v16k=$K1@draft_vocab=16384 --baseline k1 --data corpora/smollm2_t1 \
  --shards 68:72 --batches 16 --verify-temperature 1.0 --no-progress \
  --out $OUT/validation_t1.0
# the benchmarks: 8,192 tokens (the held-out sweet spot) against the full head, alone and
# combined with the n-gram drafter
dblast eval --drafter k1=$K1 --drafter k1_v8k=$K1@draft_vocab=8192 --drafter ngram=ngram \
  --drafter k1+ngram=$K1+ngram --drafter k1_v8k+ngram=$K1+ngram@draft_vocab=8192 \
  --baseline k1 --temperatures 0 0.7 --prompts-per-benchmark $PROMPTS \
  --max-new-tokens $NEW_TOKENS --batch-size 1 --no-progress --out $OUT/b1 "$@"
dblast eval --drafter k1_sampled=$K1@mode=sampled-branch \
  --drafter k1_v8k_sampled=$K1@mode=sampled-branch,draft_vocab=8192 \
  --drafter ngram=ngram --baseline k1_sampled --temperatures 1.0 1.5 \
  --prompts-per-benchmark $PROMPTS --max-new-tokens $NEW_TOKENS --batch-size 1 \
  --no-progress --out $OUT/b1_sampled "$@"
