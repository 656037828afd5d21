#!/usr/bin/env bash
# Issue 14, the T = 0 column: the same 2,304 training-pool prompts as corpora/smollm2_t1
# (same order, so shards 68-71 stay the held-out prompts), answered greedily by the target
# (T = 0), with the target's log-probs stored at T_v = 0.7 / 1.0. Drafters trained on it
# learn the target's greedy text, which is what greedy verification at T = 0 accepts.
# ~2 h of this 2-core machine; resumable: rerun after a kill (finished shards are kept).
set -u
cd "$(dirname "$0")/../.."
nice -n 10 dblast data regenerate --out runs/corpora/smollm2_t0 \
    --prompts-from corpora/smollm2_t1:0:72 --gen-temperatures 0 \
    --verify-temperatures 0.7,1.0 --max-new-tokens 256 --max-prompt-tokens 512 \
    --batch-size 16 --shard-size 32 --seed 0 --no-progress "$@"
