#!/usr/bin/env bash
# The grown sampled corpus (issue 29): three more answers at T = 1.0 to each of the 2,176
# training prompts of corpora/smollm2_t1 (its shards 0-67; the held-out prompts of shards
# 68-71 are left out, so that held-out acceptance stays held out), with new sampling keys
# (seed 1; corpora/smollm2_t1 used seed 0). 204 shards of 32 answers: with the original's
# 68 that is 4x the training text. Why: the flagship K = 1 scored 1.04 accepted drafts
# per block on its training shards and 0.41 on the held-out ones after leg 2 (research
# log section 7): it had learnt its 2,176 answers, not the target.
#
# The corpus is unscored (tokens only, ~17 KB a shard instead of ~170 KB), so that it is
# committed as it grows (corpora/smollm2_t1_more) and a new machine resumes it where the
# last one stopped: a machine's runs/ folder does not outlive it. The trainer's feature
# cache computes the log-probs the AL terms need in the pass that writes the taps.
#
# ~80 s a shard on a 2-core machine (~4.5 h in all), so it runs across working days:
# rerun the same command to resume (finished shards are kept). Each flagship leg
# (train_on_grown_corpus.sh) trains on the greedy corpus plus one complete 68-shard pass:
# the one the finished legs used least.
#
# SEED=2 (3, ...) grows three further passes with new sampling keys into
# corpora/smollm2_t1_more_seed2 (...): passes 4-6 (7-9, ...) of train_on_grown_corpus.sh,
# each usable as soon as its 68 shards are finished. Legs on a fresh pass gained up to leg
# 6 (research log sections 11-13) and a pass trained on twice has not; since leg 6 the
# 1-layer chain is flat on fresh and repeated passes alike (section 18), so the next fresh
# pass, with a 1-layer and a 2-layer leg on it, tells whether data or capacity limits it.
#
#     bash experiments/flagship/grow_sampled_corpus.sh           # seed 1 (complete)
#     SEED=2 bash experiments/flagship/grow_sampled_corpus.sh    # passes 4-6, or resume
set -u
cd "$(dirname "$0")/../.."
SEED=${SEED:-1}
case "$SEED" in
  1) OUT=corpora/smollm2_t1_more ;;
  [2-9]) OUT=corpora/smollm2_t1_more_seed$SEED ;;
  *) echo "SEED must be a sampling seed from 1 to 9 (seed 0 made corpora/smollm2_t1), not '$SEED'" >&2
     exit 2 ;;
esac
nice -n 10 dblast data regenerate --out $OUT \
    --prompts-from corpora/smollm2_t1:0:68 --gen-temperatures 1.0,1.0,1.0 \
    --verify-temperatures none --max-new-tokens 256 --max-prompt-tokens 512 \
    --batch-size ${BATCH:-16} --shard-size 32 --seed $SEED --no-progress "$@"
