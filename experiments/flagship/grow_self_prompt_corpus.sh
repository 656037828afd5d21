#!/usr/bin/env bash
# A sampled pass on NEW prompts: the target writes user queries itself (`dblast data
# self-prompts`: its chat template up to a user turn, sampled at T = 1.0; queries it did not
# end, that hold special tokens, repeat one another or overlap any evaluation or pool prompt
# are dropped), then answers each once at T = 1.0 into an unscored corpus, 68 shards of 32
# like every sampled pass of grow_sampled_corpus.sh.
#
#     bash experiments/flagship/grow_self_prompt_corpus.sh            # round 0: start / resume
#     ROUND=1 bash experiments/flagship/grow_self_prompt_corpus.sh    # the next 2,176 prompts
#
# Why: new prompts are the one kind of fresh data the pinned pools cannot give (they are
# used up). Research log section 19 found that at today's scale the drafters accept as
# much on fresh answers to their training prompts as on held-out prompts, so a round here
# is expected to be worth about as much as a sampled pass (grow_sampled_corpus.sh), at
# ~25% more CPU; it is the recipe for when the prompts, not the answers, run out. Each
# round is one sampling seed: corpora/smollm2_self_prompts_rR (prompts.jsonl, ~0.4 MB) and
# corpora/smollm2_self_t1_rR (its answers). Both steps resume after a kill, keeping every
# finished batch / shard; commit the folders as they grow. Cost on one niced core beside
# training: ~1.4 s per kept query (about 60% of samples end within 128 tokens) and
# ~2.7 min per shard of answers, ~4 h a round.
set -eu
cd "$(dirname "$0")/../.."
ROUND=${ROUND:-0}
case "$ROUND" in
  [0-9]) ;;
  *) echo "ROUND must be 0-9 (a sampling seed of its own), not '$ROUND'" >&2; exit 2 ;;
esac
PROMPTS=corpora/smollm2_self_prompts_r$ROUND
OUT=corpora/smollm2_self_t1_r$ROUND
nice -n 19 dblast data self-prompts --out $PROMPTS --count 2176 --seed $ROUND \
    --max-query-tokens 128 --no-progress
nice -n 19 dblast data regenerate --out $OUT --prompts-file $PROMPTS \
    --gen-temperatures 1.0 --verify-temperatures none --max-new-tokens 256 \
    --max-prompt-tokens 512 --batch-size ${BATCH:-16} --shard-size 32 --seed $ROUND \
    --no-progress "$@"
