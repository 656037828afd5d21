#!/usr/bin/env bash
# Which way of decoding is fastest on this CPU, per temperature (issue 30's tables): plain
# decoding, prompt lookup (`ngram`), the shipped K = 1 drafter with its full 49,152-token
# head and over its 8,192 most frequent response tokens (`@draft_vocab=8192`), and the
# combined drafter (trained + n-gram) with and without that vocabulary. Four benchmarks,
# PROMPTS prompts each, NEW_TOKENS tokens, T = 0 / 0.7 (argmax drafts, greedy-branch) and
# T = 1.0 / 1.5 (drafts sampled from q, sampled-branch), at batch 1 and batch 8.
# Each `dblast eval` runs plain decoding on the same prompts and seeds, so every speedup
# is a ratio measured side by side in one run. Resumable: a killed run picks up at the
# next unfinished (benchmark, temperature, method) from OUT/*/rows.jsonl.
#
#     bash experiments/smollm2/eval_decoding_methods.sh            # ~70 min on an idle 2-core CPU
#     PROMPTS=2 BATCHES="1" bash experiments/smollm2/eval_decoding_methods.sh   # a quick look
set -eu
cd "$(dirname "$0")/../.."
OUT=${OUT:-experiments/smollm2/results_decoding_methods}
PROMPTS=${PROMPTS:-8}
NEW_TOKENS=${NEW_TOKENS:-96}
BATCHES=${BATCHES:-1 8}
K1=pretrained:smollm2-dflash-k1
for B in $BATCHES; do
  dblast eval --drafter k1=$K1 --drafter k1_v8k=$K1@draft_vocab=8192 --drafter ngram=ngram \
    --drafter k1+ngram=$K1+ngram --drafter k1_v8k+ngram=$K1+ngram@draft_vocab=8192 \
    --baseline ngram --temperatures 0 0.7 --prompts-per-benchmark $PROMPTS \
    --max-new-tokens $NEW_TOKENS --batch-size $B --no-progress --out $OUT/b${B}_argmax "$@"
  dblast eval --drafter k1=$K1@mode=sampled-branch \
    --drafter k1_v8k=$K1@mode=sampled-branch,draft_vocab=8192 --drafter ngram=ngram \
    --drafter k1+ngram=$K1+ngram@mode=sampled-branch \
    --drafter k1_v8k+ngram=$K1+ngram@mode=sampled-branch,draft_vocab=8192 \
    --baseline ngram --temperatures 1.0 1.5 --prompts-per-benchmark $PROMPTS \
    --max-new-tokens $NEW_TOKENS --batch-size $B --no-progress --out $OUT/b${B}_sampled "$@"
done
