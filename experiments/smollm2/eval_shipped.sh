#!/usr/bin/env bash
# The reproduction's benchmark tables for the drafters shipped in pretrained/ (RESULTS.md's
# opening tables; docs/research_log.md section 4.8): the K = 1 DFlash drafter and the K = 4 DBlast drafter (greedy-branch and
# mixture verification) on the four benchmarks at T = 0 / 0.7 / 1.0 / 1.5, batch 1; drafts
# sampled from q (sampled-branch / sampled-mixture) at T = 1.0 / 1.5; and batch 8 at
# T = 0 / 0.7; and the K = 1 drafting shorter blocks than it was trained with (@block=N:
# a cheaper verify pass per step), batch 1, T = 0 / 0.7 (argmax drafts) and T = 1.0 / 1.5
# (sampled drafts). Plain decoding of the same prompts with the same seeds runs in each command,
# so every speedup is a ratio measured side by side. Resumable: every finished unit is kept
# in OUT/rows.jsonl, a rerun skips it.
set -eu
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/smollm2/eval_shipped}
PROMPTS=${PROMPTS:-2}
NEW_TOKENS=${NEW_TOKENS:-96}
K1=pretrained:smollm2-dflash-k1
K4=pretrained:smollm2-dblast-k4
dblast eval --drafter k1=$K1 --drafter k4=$K4 --drafter k4_mixture=$K4@mode=mixture \
  --baseline k1 --temperatures 0 0.7 1.0 1.5 --prompts-per-benchmark $PROMPTS \
  --max-new-tokens $NEW_TOKENS --batch-size 1 --no-progress --out $OUT/b1
dblast eval --drafter k1_sampled=$K1@mode=sampled-branch \
  --drafter k4_sampled_mixture=$K4@mode=sampled-mixture \
  --baseline k1_sampled --temperatures 1.0 1.5 --prompts-per-benchmark $PROMPTS \
  --max-new-tokens $NEW_TOKENS --batch-size 1 --no-progress --out $OUT/b1_sampled
dblast eval --drafter k1=$K1 --drafter k4_mixture=$K4@mode=mixture \
  --baseline k1 --temperatures 0 0.7 --prompts-per-benchmark 8 \
  --max-new-tokens $NEW_TOKENS --batch-size 8 --no-progress --out $OUT/b8
dblast eval --drafter k1=$K1 --drafter k1_block4=$K1@block=4 --drafter k1_block3=$K1@block=3 \
  --drafter k1_block2=$K1@block=2 --baseline k1 --temperatures 0 0.7 \
  --prompts-per-benchmark $PROMPTS --max-new-tokens $NEW_TOKENS --batch-size 1 --no-progress \
  --out $OUT/b1_blocks
dblast eval --drafter k1_sampled=$K1@mode=sampled-branch \
  --drafter k1_sampled_block4=$K1@mode=sampled-branch,block=4 \
  --drafter k1_sampled_block3=$K1@mode=sampled-branch,block=3 --baseline k1_sampled \
  --temperatures 1.0 1.5 --prompts-per-benchmark $PROMPTS --max-new-tokens $NEW_TOKENS \
  --batch-size 1 --no-progress --out $OUT/b1_sampled_blocks
