#!/usr/bin/env bash
# The next flagship K = 1 leg (train_k1.sh) on the grown corpus: the 68 training shards of
# the greedy corpus corpora/smollm2_t0 (the training prompts answered at T = 0) plus ONE
# sampled pass, one T = 1.0 answer to each training prompt: pass 0 is the 68 training
# shards of corpora/smollm2_t1, passes 1-3 the shards 68(p-1) .. 68p-1 of
# corpora/smollm2_t1_more, passes 4-6 those of corpora/smollm2_t1_more_seed2, and so on
# (grow_sampled_corpus.sh, SEED=1, 2, ...). The leg takes the complete pass the
# finished legs (experiments/flagship/k1/legs.jsonl) used least (on a tie: the newest of
# those never used, else the one used longest ago), so that every leg trains on the
# answers the drafter has seen least, and least recently. Records whose prompt
# repeats a held-out prompt are left out. The held-out shards at T_v = 1.5 and greedy
# agreement on the greedy held-out answers are scored beside the main held-out set
# (T_v = 1.0) at every segment.
#
#     bash experiments/flagship/train_on_grown_corpus.sh   # start, or resume, the next leg
#     STEPS=5000 bash experiments/flagship/train_on_grown_corpus.sh   # another length
#
# Why one pass per leg, not every pass: a leg must finish within one working day, because
# runs/ (its checkpoints and its feature cache) does not survive the machine. The feature
# cache costs ~1 s of two cores a record at 384 tokens: 4,250 records (greedy + one pass)
# take ~70 min, every pass at once (~11,000 records) ~3 h, which leaves no day for
# training. Rotating passes keeps each leg at ~70 min of cache + ~80 min of 8,000 steps,
# and feeds it answers it has not memorised (legs 1-2 memorised pass 0, research log
# section 7).
#
# Records are read through a 384-token window (SEQ_LEN; legs 1-2: 256), which holds 92% of
# the answers' tokens instead of 68%. Every corpus is committed (corpora/), so a leg that
# starts on a fresh machine needs nothing but a merge; the sampled passes are unscored
# (tokens only) and the feature cache computes the log-probs at T_v that the AL tracking
# reads, in the pass that writes the taps.
#
# Self-prompt passes (grow_self_prompt_corpus.sh: one T = 1.0 answer to each of 2,176
# prompts the target wrote itself, round R in corpora/smollm2_self_t1_rR) join the rotation
# as pass sR once their 68 shards are finished; among passes never used they come after
# the sampled ones (newest first). USE_PASS=s0 (or 5, ...) picks a complete pass by hand,
# USE_PASS=0,1,2,3,4 several at once (USE_PASS=all: every complete pass): the leg then
# reads each answer fewer times for the same steps (research log 19: a one-pass leg reads
# each ~5.6 times and memorises its pass), and the feature cache copies every record an
# earlier leg's cache holds, so only passes never cached cost a target pass. What moves the
# chain is many distinct answers in one leg, not fewer reads alone (research log 20, 22:
# legs on 3 and 5 passes gained, one fresh pass read as rarely did not), so USE_PASS=all
# is the recipe wherever its cache (~1.7 CPU-s a record not yet cached) fits.
#
# A leg keeps the corpus it started on (its leg.json), so a killed leg resumes on the same
# data. The merged folders are named by what they hold (smollm2_t0_t1pass1, ...).
#
# LAYERS=2 (or 3) runs the depth chain's next leg instead (train_k1.sh says how it starts);
# it rotates passes by its own legs plus the 1-layer legs it grew from, so its first leg
# takes the pass the 1-layer leg it pairs with takes (when started before that leg ends). Start
# it once the 1-layer leg on the same pass has begun training: both read one feature cache
# (runs/flagship/features), and a training process uses about one of the two cores.
# K=4 runs the mixture chain's next leg the same way (experiments/flagship/k4: DBlast's
# K-way mixture with NLL + AL from the 1-layer chain's export), paired with the 1-layer
# leg on the newest pass.
set -eu
cd "$(dirname "$0")/../.."
source experiments/flagship/chain.sh  # KEEP, LEG and WORK of the chain LAYERS picks
# scored beside the main held-out set (T_v = 1.0) at every segment: the same shards at
# T_v = 1.5, and greedy agreement on the greedy held-out answers. The feature cache is kept
# in bfloat16: at 384 tokens and five taps a record's taps are 4.4 MB in float32, ~19 GB
# for a leg's 4,250 records, ~10 GB in bfloat16.
EXTRA=(--extra_validation=hot=corpora/smollm2_t1:68:72@1.5
       --extra_validation=greedy=corpora/smollm2_t0_heldout:0:4
       --override=feature_cache_dtype=bfloat16)
export LAYERS SEGMENT=${SEGMENT:-2000}  # held-out scoring every SEGMENT steps (not in leg.json)
if [ -f $WORK/leg.json ]; then
  echo "resuming leg $LEG of $KEEP on $(python -c "import json; print(json.load(open('$WORK/leg.json'))['data'])")"
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
GDONE=$(finished $GREEDY)
if [ $GDONE -lt 68 ]; then
  echo "the greedy corpus is not finished: $GREEDY has $GDONE of 68 training shards (run" \
       "experiments/flagship/regenerate_greedy_corpus.sh)" >&2
  exit 1
fi
# The sampled passes: pass 0 is corpora/smollm2_t1:0:68; the grown folder of sampling seed
# s (grow_sampled_corpus.sh: corpora/smollm2_t1_more for seed 1, ..._more_seedS after it)
# holds passes 3(s-1)+1 .. 3s, 68 shards each. Complete passes only, as "PASS SOURCE" lines.
PASSES=$(echo "0 corpora/smollm2_t1:0:68"
  for s in 1 2 3 4 5 6 7 8 9; do
    folder=corpora/smollm2_t1_more; [ $s -gt 1 ] && folder=${folder}_seed$s
    [ -d $folder ] || continue
    n=$(finished $folder)
    for j in 0 1 2; do
      if [ $n -ge $(( 68 * (j + 1) )) ]; then
        echo "$(( 3 * (s - 1) + j + 1 )) $folder:$(( 68 * j )):$(( 68 * (j + 1) ))"
      fi
    done
  done
  for r in 0 1 2 3 4 5 6 7 8 9; do
    folder=corpora/smollm2_self_t1_r$r
    if [ -d $folder ] && [ $(finished $folder) -ge 68 ]; then
      echo "s$r $folder:0:68"
    fi
  done)
# the least used complete sampled pass; on a tie the one used longest ago, and among passes
# never used the newest (after leg 8 on pass 4, passes 2-4 had one leg each, and "the
# newest on a tie" would have given pass 4 again at once); a finished leg's corpus names
# its pass (..._t1passP); legs on the original corpora (smollm2_t1, smollm2_t1_t0) used
# pass 0 and legs on every pass merged (..._moreN) used passes 0 .. N. A chain grown from
# the 1-layer K = 1 chain (depth, mixture) counts the 1-layer legs its weights hold too:
# those its first leg recorded (trunk_legs), or, before its first leg, every finished one.
# Its depth leg 2 took a pass its trunk had used twice, and lost 3.3% (research log 13).
PASS=$(PASSES="$PASSES" USE_PASS="${USE_PASS:-}" python -c "
import json, os, re, sys
passes = [line.split()[0] for line in os.environ['PASSES'].splitlines()]
if os.environ['USE_PASS'] == 'all':
    print(' '.join(passes))
    sys.exit()
if os.environ['USE_PASS']:
    asked = os.environ['USE_PASS'].split(',')
    bad = [p for p in asked if p not in passes]
    if bad or len(set(asked)) < len(asked):
        sys.exit(f\"USE_PASS={os.environ['USE_PASS']}: \" + (
            f\"{','.join(bad)} not a complete pass; complete: {' '.join(passes)}\" if bad
            else 'a pass named twice'))
    print(' '.join(asked))
    sys.exit()
# sampled passes 0, 1, ... then self-prompt passes s0, s1, ...: the later, the newer
newness = lambda p: (1, int(p[1:])) if p.startswith('s') else (0, int(p))
used = dict.fromkeys(passes, 0)
read = lambda path: [json.loads(l) for l in open(path)] if os.path.exists(path) else []
last = dict.fromkeys(passes, -1)  # the index of the last leg that used each pass
rows = read('$KEEP/legs.jsonl')
if '$KEEP' != 'experiments/flagship/k1':  # the trunk's legs came first
    trunk = read('experiments/flagship/k1/legs.jsonl')
    rows = (trunk[:rows[0].get('trunk_legs', 0)] if rows else trunk) + rows
for i, row in enumerate(rows):
    data = row.get('data', 'corpora/smollm2_t1')
    some, every = re.search(r't1pass(s?\d+(?:_s?\d+)*)$', data), re.search(r'_more(\d+)$', data)
    for p in (some.group(1).split('_') if some else
              [str(i) for i in range(1 + int(every.group(1)) if every else 1)]):
        if p in used:
            used[p] += 1
            last[p] = i
print(min(passes, key=lambda p: (used[p], last[p], [-x for x in newness(p)])))")
SAMPLED=$(for p in $PASS; do echo "$PASSES" | awk -v p=$p '$1 == p {print $2}'; done)
SAMPLED=$(echo $SAMPLED)
DATA=runs/corpora/smollm2_t0_t1pass$(echo $PASS | tr ' ' _)
echo "leg $LEG of $KEEP: merging $GREEDY:0:68 $SAMPLED into $DATA"
dblast data merge --out $DATA $GREEDY:0:68 $SAMPLED --exclude-prompts-of corpora/smollm2_t1:68:72
export DATA DATA_SHARDS=0 STEPS=${STEPS:-8000} SEQ_LEN=${SEQ_LEN:-384}
exec bash experiments/flagship/train_k1.sh "${EXTRA[@]}"
