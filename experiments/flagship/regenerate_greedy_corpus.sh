#!/usr/bin/env bash
# The greedy corpus (issue 29): the same 2,304 training-pool prompts as corpora/smollm2_t1
# (same order, so shards 68-71 stay the held-out prompts, now also greedy held-out shards),
# answered greedily by the target (T = 0), with the target's log-probs stored at
# T_v = 0.7 / 1.0. Drafters trained on it learn the target's greedy text, which is what
# verification at T = 0 accepts, and the repetitions that prompt lookup copies.
# ~2 h of an idle 2-core machine (~95 s a shard of 32 answers). It writes into the
# repository's corpora/ so that the shards finished on one working day are committed and
# the next day resumes from them: rerun after a kill, or later with the same command.
set -u
cd "$(dirname "$0")/../.."
nice -n 10 dblast data regenerate --out corpora/smollm2_t0 \
    --prompts-from corpora/smollm2_t1:0:72 --gen-temperatures 0 \
    --verify-temperatures 0.7,1.0 --max-new-tokens 256 --max-prompt-tokens 512 \
    --batch-size 16 --shard-size 32 --seed 0 --no-progress "$@"
