#!/usr/bin/env bash
# The next flagship K = 1 leg (train_k1.sh) on as much of the grown corpus as is finished:
# the 68 training shards of corpora/smollm2_t1, then the 68 training shards of the greedy
# corpus corpora/smollm2_t0 (the same prompts answered at T = 0) once all are written,
# then every complete pass (68 shards: one more T = 1.0 answer to each training prompt) of
# corpora/smollm2_t1_more where one exists, merged with the records whose prompt
# repeats a held-out prompt left out. The held-out shards at T_v = 1.5 and greedy agreement
# on the greedy held-out answers are scored beside the main held-out set (T_v = 1.0) at
# every segment.
#
#     bash experiments/flagship/train_on_grown_corpus.sh   # start, or resume, the next leg
#     STEPS=10000 bash experiments/flagship/train_on_grown_corpus.sh   # another length
#
# Records are read through a 384-token window (SEQ_LEN; legs 1-2: 256), which holds 92% of
# the answers' tokens instead of 68%: more distinct anchors from the same corpus, for a
# drafter that memorised its data.
#
# Every corpus is committed (corpora/), so a leg that starts on a fresh machine needs
# nothing but a merge. The sampled passes are unscored (tokens only, small enough to
# commit): their merge is unscored too, and the feature cache computes the log-probs at
# T_v that the AL tracking reads, in the pass that writes the taps. Greedy answers come
# first because they are what verification at T = 0 accepts, where prompt lookup beats the
# drafters today; the distillation term still teaches the target's whole top-64 at every
# position of them.
#
# A leg keeps the corpus it started on (its leg.json), so a killed leg resumes on the same
# data; the next leg takes what is finished by then. The merged folders are named by what
# they hold (smollm2_t1_t0, smollm2_t1_t0_more2, ...); each is a prefix of the next, so the
# feature cache of a bigger one starts from the rows of the smaller (feature_cache.py).
set -eu
cd "$(dirname "$0")/../.."
KEEP=experiments/flagship/k1
# scored beside the main held-out set (T_v = 1.0) at every segment: the same shards at
# T_v = 1.5, and greedy agreement on the greedy held-out answers. The feature cache is kept
# in bfloat16: at 384 tokens and five taps a record's taps are 4.4 MB in float32, and the
# caches of the x2 and x4 corpora (the second starts from the first's rows) would not fit
# on this machine's disk together (~19 + ~57 GB); in bfloat16 they take ~10 + ~29 GB.
EXTRA=(--extra_validation=hot=corpora/smollm2_t1:68:72@1.5
       --extra_validation=greedy=corpora/smollm2_t0_heldout:0:4
       --override=feature_cache_dtype=bfloat16)
LEG=$(( $( [ -f $KEEP/legs.jsonl ] && wc -l < $KEEP/legs.jsonl || echo 0 ) + 1 ))
export SEGMENT=${SEGMENT:-2000}  # held-out scoring every SEGMENT steps (not in leg.json)
if [ -f runs/flagship/k1_leg$LEG/leg.json ]; then
  echo "resuming leg $LEG on $(python -c "import json; print(json.load(open('runs/flagship/k1_leg$LEG/leg.json'))['data'])")"
  exec bash experiments/flagship/train_k1.sh "${EXTRA[@]}"
fi
# finished shards 0 .. n-1 of a corpus folder (0 when it has no manifest yet)
finished() { python -c "
import json, sys
try:
    m = json.load(open('$1/manifest.json'))
except OSError:
    print(0); sys.exit()
done = {s['index'] for s in m['shards']}
n = 0
while n in done:
    n += 1
print(n)"; }
GREEDY=corpora/smollm2_t0
MORE=corpora/smollm2_t1_more
SOURCES=(corpora/smollm2_t1:0:68)
DATA=runs/corpora/smollm2_t1
GDONE=$(finished $GREEDY)
if [ $GDONE -ge 68 ]; then
  SOURCES+=($GREEDY:0:68) DATA+=_t0
fi
PASSES=$(( $(finished $MORE) / 68 ))
[ $PASSES -ge 3 ] && PASSES=3
if [ $PASSES -gt 0 ]; then
  SOURCES+=($MORE:0:$(( 68 * PASSES ))) DATA+=_more$PASSES
fi
if [ ${#SOURCES[@]} -eq 1 ]; then
  echo "nothing grown yet: $GREEDY has $GDONE of 68 training shards (run" \
       "experiments/flagship/regenerate_greedy_corpus.sh), $MORE no complete pass" \
       "(experiments/flagship/grow_sampled_corpus.sh)" >&2
  exit 1
fi
echo "leg $LEG: merging ${SOURCES[*]} into $DATA"
dblast data merge --out $DATA "${SOURCES[@]}" --exclude-prompts-of corpora/smollm2_t1:68:72
# A leg on a corpus that is still growing is kept short (8,000 steps): its cosine schedule
# has annealed by the time the next sampled pass is finished, and the next leg takes that
# pass (each leg is a warm restart from the last one's export). Once all three passes are
# in, the leg is the long one (20,000 steps).
[ $PASSES -ge 3 ] && LONG=20000 || LONG=8000
export DATA DATA_SHARDS=0 STEPS=${STEPS:-$LONG} SEQ_LEN=${SEQ_LEN:-384}
exec bash experiments/flagship/train_k1.sh "${EXTRA[@]}"
