#!/usr/bin/env bash
# The K = 1 flagship (issue 29): one long run made of legs of STEPS steps, each starting
# from where the previous leg ended, so that the run goes on across working days although
# runs/ does not survive between them. The legs follow ONE cosine of CHAIN_STEPS steps
# (default 50,000, peak LR): a leg warms up (3% of its steps; its Adam moments start
# afresh) to the rate that cosine has reached at the chain's step and follows it from
# there, so the chain anneals once. Legs 1-7 of the 1-layer chain (and the depth / mixture
# legs started before it) each restarted a whole warmup + cosine at the peak instead, and
# lost the first half of each leg to it (research log sections 14 and 16).
# LR (default 5e-4) sets that cosine's peak for a new leg; leg.json keeps it, so a resumed
# leg goes on at the rate it began with (a different LR on resume is refused).
#
# Recipe: that of the shipped K = 1 drafter (five taps, one drafter layer, NLL + AL + top-64
# distillation, the sampled training head of 4,096 frequent + 1,024 sampled tokens, batch
# 8 x 256, 16 anchors per sequence) on the 68 training shards of corpora/smollm2_t1.
# Held-out acceptance (T_v = 1.0, shards 68-71, 8 fixed batches) is scored at the leg's
# start and every SEGMENT steps into the leg's budget_curve.jsonl (against training
# CPU-seconds); checkpoints every 250 steps.
#
# What survives a working day lives in experiments/flagship/k1/ (committed):
#   drafter/      the latest finished leg's export (bfloat16): the next leg's starting point
#   legs.jsonl    one row per finished leg (steps, training CPU-s, held-out scores, date)
#   curve_leg*.jsonl  each leg's raw held-out points
# The first leg starts from the shipped K = 1 drafter.
#
#     bash experiments/flagship/train_k1.sh          # start or resume the current leg
#     STEPS=3000 bash experiments/flagship/train_k1.sh
#     DATA=runs/corpora/smollm2_t1_x4 DATA_SHARDS=0 bash experiments/flagship/train_k1.sh
# DATA / DATA_SHARDS choose a new leg's training corpus (default: the first 68 shards of
# corpora/smollm2_t1; a merged corpus from `dblast data merge` with 0 = all its shards).
# SEQ_LEN (default 256) is the record window a leg trains and validates on: a record enters
# a batch as its first SEQ_LEN tokens, so at 256 only 67.6% of the corpus's response tokens
# can ever be an anchor (prompts average 96 tokens, answers 186), at 384 92.2%. A leg scores
# its starting drafter on its own window first, so gains within a leg stay paired.
# Legs 1-2 trained on the original 2,176 answers and memorised them (research log section
# 7): later legs train on the grown corpus. Held out stays shards 68-71 of smollm2_t1.
# Extra arguments go to budget_curve.py (repeat them when resuming), e.g. greedy agreement
# on the greedy held-out answers, scored beside the main held-out set at every segment:
#     DATA=runs/corpora/smollm2_t1_x4 DATA_SHARDS=0 STEPS=20000 SEGMENT=2000 \
#         bash experiments/flagship/train_k1.sh \
#         --extra_validation=greedy=corpora/smollm2_t0_heldout:0:4
# (refused while the training data still hold the 5 held-out prompts that repeat training
# prompts, i.e. on corpora/smollm2_t1 itself: merge with --exclude-prompts-of first).
# A killed leg resumes from its checkpoint in runs/flagship/k1_legN (same command); a
# finished leg is exported and recorded, and the next call starts the next leg.
#
# The depth run (LAYERS=2, or 3): the same recipe with a deeper drafter, in its own chain
# experiments/flagship/k1_depthN (legs in runs/flagship/k1_depthN_legM). Its first leg grows
# the 1-layer chain's latest export in depth (drafter_init=drafter:..., new top layers
# start as the identity, so leg 1 starts from the 1-layer drafter's acceptance), so that a
# depth leg and the 1-layer leg on the same pass are a paired comparison at equal data:
#     LAYERS=2 bash experiments/flagship/train_on_grown_corpus.sh
# Every leg copies its starting drafter into its workdir first (init/), so a resumed leg
# starts from the same weights even if the chain it grew from has finished a leg since.
#
# The mixture run (K=4; or 2, 8): DBlast's K-way latent mixture with NLL + AL + top-64
# distillation, in its own chain experiments/flagship/k4. Like the depth run, its first
# leg starts from the 1-layer K = 1 chain's latest export (section 4.7: K = 4 from the
# K = 1 trunk) and takes the newest complete pass, so that it pairs with the K = 1 leg on
# the same pass, from the same weights, on the same schedule:
#     K=4 bash experiments/flagship/train_on_grown_corpus.sh
set -u
cd "$(dirname "$0")/../.."
source experiments/flagship/chain.sh  # KEEP, LEG and WORK of the chain LAYERS picks
mkdir -p runs/flagship "$KEEP"
INIT=pretrained/smollm2-135m-instruct/smollm2-dflash-k1
[ "$NAME" != k1 ] && INIT=experiments/flagship/k1/drafter  # grown in depth or into a mixture
[ -f $KEEP/drafter/config.json ] && INIT=$KEEP/drafter
PRIOR_CPU_S=2100  # training CPU-s of the chain's starting drafter (the shipped K = 1) ...
TRUNK_LEGS=0  # ... and how many 1-layer K = 1 legs it holds (a grown chain's branch point)
# rows of a chain's legs.jsonl, or a clear error naming the file and line it cannot read
LEG_ROWS="
import json, os, sys
def rows(path):
    if not os.path.exists(path):
        return []
    out = []
    for n, line in enumerate(open(path), 1):
        try:
            out.append(json.loads(line))
        except ValueError as e:
            sys.exit(f'{path} line {n} is not a JSON row ({e}): restore it from git '
                     f'(git checkout -- {path}) before the next leg')
    return out
"
if [ $LEG != 1 ]; then  # a later leg: what the chain's first leg recorded
  FIRST=$(python -c "$LEG_ROWS
first = rows('$KEEP/legs.jsonl')[0]
print(round(first.get('prior_cpu_s', 2100)), first.get('trunk_legs', 0))") || exit 1
  read PRIOR_CPU_S TRUNK_LEGS <<< "$FIRST"
elif [ "$NAME" != k1 ]; then  # ... + every 1-layer leg a grown chain started from
  FIRST=$(python -c "$LEG_ROWS
trunk = rows('experiments/flagship/k1/legs.jsonl')
print(round(2100 + sum(r['training_cpu_s'] for r in trunk)), len(trunk))") || exit 1
  read PRIOR_CPU_S TRUNK_LEGS <<< "$FIRST"
fi
CHAIN_STEPS=${CHAIN_STEPS:-50000}  # the length of the chain's one cosine
# the chain's step at this leg's start: the shipped K = 1's 2,000 + the 1-layer legs a
# grown chain holds + the chain's own finished legs
CHAIN_AT=$(python -c "$LEG_ROWS
trunk = rows('experiments/flagship/k1/legs.jsonl')[:$TRUNK_LEGS] if '$NAME' != 'k1' else []
print(2000 + sum(r['steps'] for r in trunk + rows('$KEEP/legs.jsonl')))") || exit 1
if [ ! -f $WORK/leg.json ] && [ $(( CHAIN_AT + ${STEPS:-3000} )) -gt $CHAIN_STEPS ]; then
  echo "leg $LEG of $KEEP would run steps $CHAIN_AT .. $(( CHAIN_AT + ${STEPS:-3000} )) of a" \
    "chain schedule of CHAIN_STEPS=$CHAIN_STEPS: raise CHAIN_STEPS or shorten STEPS" >&2
  exit 1  # before anything of the leg is written
fi
# the peak rate of the chain's cosine (LR, default 5e-4): a number, kept in leg.json
PEAK_LR=$(python -c "
import math, sys
try:
    lr = float('${LR:-5e-4}')
except ValueError:
    lr = float('nan')
if not (math.isfinite(lr) and lr > 0):
    sys.exit('LR=${LR:-} is not a positive learning rate (e.g. LR=1e-3)')
print(repr(lr))") || exit 1
mkdir -p $WORK  # the leg's settings, fixed at its start so that a resume keeps them
if [ ! -f $WORK/leg.json ]; then
  [ -f $INIT/config.json ] || { echo "no drafter to start leg $LEG of $KEEP from: $INIT/config.json" \
      "is missing (the $NAME run grows the 1-layer chain's export: run a 1-layer leg first)" >&2
      exit 1; }
  rm -rf $WORK/init && cp -r $INIT $WORK/init.partial && mv $WORK/init.partial $WORK/init
  printf '{"leg": %d, "init": "%s", "init_copy": "%s", "steps": %d, "data": "%s", "data_shards": %d, "seq_len": %d, "drafter_layers": %d, "k": %d, "prior_cpu_s": %d, "trunk_legs": %d, "schedule_steps": %d, "schedule_offset": %d, "learning_rate": %s}\n' \
      $LEG "$INIT" "$WORK/init" ${STEPS:-3000} "${DATA:-corpora/smollm2_t1}" ${DATA_SHARDS:-68} \
      ${SEQ_LEN:-256} $LAYERS $K $PRIOR_CPU_S $TRUNK_LEGS $CHAIN_STEPS $CHAIN_AT $PEAK_LR > $WORK/leg.json
fi
leg() { python -c "import json; print(json.load(open('$WORK/leg.json')).get('$1', '${2-}'))"; }
STEPS=$(leg steps) INIT=$(leg init_copy "$(leg init)") DATA=$(leg data corpora/smollm2_t1)
DATA_SHARDS=$(leg data_shards 68) SEQ_LEN=$(leg seq_len 256) LAYERS=$(leg drafter_layers 1)
# a resumed leg keeps the peak rate it began with (legs begun before it was kept: 5e-4)
LEG_LR=$(leg learning_rate 5e-4)
if [ -n "${LR:-}" ] && ! python -c "import sys; sys.exit(float('$LR') != float('$LEG_LR'))"; then
  echo "leg $LEG of $KEEP began with LR=$LEG_LR ($WORK/leg.json) and resumes with it:" \
    "unset LR (or LR=$LEG_LR) to resume it" >&2
  exit 1
fi
# the chain's cosine (legs started before it: 0, their own warm restart)
SCHEDULE=(--override=schedule_steps=$(leg schedule_steps 0)
          --override=schedule_offset=$(leg schedule_offset 0))
nice -n 10 python experiments/budget/budget_curve.py --experiment=$EXPERIMENT \
  --workdir=$WORK --max_steps=$STEPS --segment_steps=${SEGMENT:-500} \
  --checkpoint_every=250 --budget_cpu_s=1e9 --validation_batches=8 \
  --override=data=$DATA --override=data_shards=$DATA_SHARDS \
  --override=batch_size=8 --override=seq_len=$SEQ_LEN --override=anchors_per_sequence=16 \
  --override=learning_rate=$LEG_LR --override=warmup_fraction=0.03 \
  --override=keep_checkpoints=2 --override=feature_cache=runs/flagship/features \
  --override=target_layer_ids=1,7,14,20,27 --override=drafter_layers=$LAYERS \
  --override=train_head_tokens=4096 --override=train_head_sampled=1024 \
  --override=distill_weight=1.0 --override=drafter_init=drafter:$INIT "${SCHEDULE[@]}" \
  "$@" >> $WORK.log 2>&1 || { echo "leg $LEG stopped; see $WORK.log" >&2; exit 1; }
REFERENCE=()  # a grown chain's learning curve shows the 1-layer K = 1 run beside it
[ "$NAME" != k1 ] && REFERENCE=(--reference=experiments/flagship/k1)
python experiments/flagship/finish_leg.py --leg_dir=$WORK --keep=$KEEP --leg=$LEG \
  "${REFERENCE[@]}" >> $WORK.log 2>&1
