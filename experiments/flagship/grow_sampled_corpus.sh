#!/usr/bin/env bash
# The grown sampled corpus (issue 29): three more answers at T = 1.0 to each of the 2,176
# training prompts of corpora/smollm2_t1 (its shards 0-67; the held-out prompts of shards
# 68-71 are left out, so that held-out acceptance stays held out), with new sampling keys
# (seed 1; corpora/smollm2_t1 used seed 0), log-probs stored at T_v = 0.7 / 1.0 / 1.5 like
# the original. 204 shards of 32 answers: with the original's 68 that is 4x the training
# text. Why: the flagship K = 1 scores 1.04 accepted drafts per block on its training
# shards and 0.41 on the held-out ones (research log section 7): it has learnt its 2,176
# answers, not the target, and more steps on them cannot help.
#
# ~70 s a shard on an idle 2-core machine (~4 h in all), so it runs across working days:
# rerun the same command to resume (finished shards are kept). It writes into runs/corpora/
# (ignored by git: 30 MB of shards would not fit beside the tracked tree in one device
# call). Train on it with the original through a merged corpus:
#   dblast data merge --out runs/corpora/smollm2_t1_x4 corpora/smollm2_t1:0:68 \
#       runs/corpora/smollm2_t1_more:0:N --exclude-prompts-of corpora/smollm2_t1:68:72
# (the exclusion drops the few training records whose prompt repeats a held-out one).
set -u
cd "$(dirname "$0")/../.."
mkdir -p runs/corpora
nice -n 10 dblast data regenerate --out runs/corpora/smollm2_t1_more \
    --prompts-from corpora/smollm2_t1:0:68 --gen-temperatures 1.0,1.0,1.0 \
    --verify-temperatures 0.7,1.0,1.5 --max-new-tokens 256 --max-prompt-tokens 512 \
    --batch-size ${BATCH:-16} --shard-size 32 --seed 1 --no-progress "$@"
