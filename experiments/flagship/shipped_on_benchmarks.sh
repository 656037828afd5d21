#!/usr/bin/env bash
# The reproduction with the drafters that ship (issue 29, item 3): how fast and how often
# accepted are pretrained:smollm2-dflash-k1 (K = 1) and pretrained:smollm2-dblast-k4
# (DBlast, K = 4, verified against the whole mixture) on the four benchmarks, beside plain
# decoding, prompt lookup (`ngram`) and the K = 1 combined with prompt lookup? PROMPTS
# prompts per benchmark, NEW_TOKENS tokens, T = 0 / 0.7 with argmax drafts (greedy-branch;
# `mixture` for K = 4) and T = 1.0 / 1.5 with drafts sampled from q (sampled-branch;
# `sampled-mixture` for K = 4), at each batch size of BATCHES. Each `dblast eval` decodes
# the same prompts with the same seeds without a drafter, so every speed-up is a ratio
# measured side by side in one run; gains are against the K = 1 (the K = 4 row's gain is
# DBlast's over DFlash). Results (results.md, results.json, plots) land in
# OUT/b{B}_{argmax,sampled} and are committed. Resumable, also on another machine once
# committed: a killed run picks up at the next unfinished (benchmark, temperature,
# drafter) from OUT/*/rows.jsonl, and a rerun into a folder that holds other weights under
# the same name is refused.
#
#     bash experiments/flagship/shipped_on_benchmarks.sh          # ~3 h of one core
#     BATCHES=1 bash experiments/flagship/shipped_on_benchmarks.sh   # batch 1 only
set -eu
cd "$(dirname "$0")/../.."
OUT=${OUT:-experiments/flagship/shipped_on_benchmarks}
PROMPTS=${PROMPTS:-8}
NEW_TOKENS=${NEW_TOKENS:-96}
BATCHES=${BATCHES:-1 8}
K1=pretrained:smollm2-dflash-k1
K4=pretrained:smollm2-dblast-k4
for B in $BATCHES; do
  dblast eval --drafter k1=$K1 --drafter k4=$K4@mode=mixture --drafter ngram=ngram \
    --drafter k1+ngram=$K1+ngram --baseline k1 --temperatures 0 0.7 \
    --prompts-per-benchmark $PROMPTS --max-new-tokens $NEW_TOKENS --batch-size $B \
    --no-progress --out $OUT/b${B}_argmax "$@"
  dblast eval --drafter k1=$K1@mode=sampled-branch --drafter k4=$K4@mode=sampled-mixture \
    --drafter ngram=ngram --drafter k1+ngram=$K1+ngram@mode=sampled-branch \
    --baseline k1 --temperatures 1.0 1.5 --prompts-per-benchmark $PROMPTS \
    --max-new-tokens $NEW_TOKENS --batch-size $B --no-progress --out $OUT/b${B}_sampled "$@"
done
