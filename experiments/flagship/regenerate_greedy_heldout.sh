#!/usr/bin/env bash
# The greedy held-out set (issue 29): the 128 held-out prompts of corpora/smollm2_t1 (its
# shards 68-71, never trained on) answered greedily by the target (T = 0), with log-probs at
# T_v = 0.7 / 1.0, into corpora/smollm2_t0_heldout (4 shards, committed). On it
# `greedy_accepted` of the held-out scores is the drafts greedy verification accepts per
# block (greedy tau - 1), measured without generating. ~8 min of an idle 2-core machine;
# resumable: rerun after a kill.
set -u
cd "$(dirname "$0")/../.."
nice -n 10 dblast data regenerate --out corpora/smollm2_t0_heldout \
    --prompts-from corpora/smollm2_t1:68:72 --gen-temperatures 0 \
    --verify-temperatures 0.7,1.0 --max-new-tokens 256 --max-prompt-tokens 512 \
    --batch-size 16 --shard-size 32 --seed 0 --no-progress "$@"
