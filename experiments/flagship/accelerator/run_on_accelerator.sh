#!/usr/bin/env bash
# One call on a lent accelerator (call 2 of README.md): more T = 1.0 answers to the
# training prompts, a flagship K = 1 leg on them, its export and held-out score, all inside
# BUDGET_S seconds of wall clock, results in $OUT. Runs from the repository root of the
# device's copy of the working tree, made by prepare.sh (.device/) and a sparse checkout.
#
# Stages (each timed; SKIP=regen,train skips any; a rerun on the same warm machine resumes:
# the model and wheels are not redone, regeneration keeps its shards, training its
# checkpoint):
#   model   join the two gzip parts of the GGUF (call 1 left part 1) into $DBLAST_CACHE_DIR,
#           sha256 checked against the original's
#   wheels  the packages the device lacks (grain, gguf, ...) into /tmp/site
#   regen   `dblast data regenerate` of the 2,176 training prompts at T = 1.0, seed SEED
#           (corpora/smollm2_t1_more_seedSEED's settings: 3 answers each, 32 per shard),
#           cut off after REGEN_FRACTION of the budget (finished shards are kept)
#   train   the greedy corpus (68 shards) + the new answers, merged without the held-out
#           prompts; train_until_deadline.py from the chain's latest export with the
#           flagship recipe at batch BATCH, live target (no feature cache), scored on the
#           held-out shards 68-71 before and after; bfloat16 export
#   pack    $OUT: drafter.tar, corpus_seedSEED.tar.gz (+ _2), train_curve.jsonl,
#           metrics.jsonl.gz, summary.json, run.log (8 files at most, 16 MiB each)
#
#     PYTHONUNBUFFERED=1 bash experiments/flagship/accelerator/run_on_accelerator.sh
#     DRY_RUN=1 nice -n 19 bash experiments/flagship/accelerator/run_on_accelerator.sh  # CPU
# DRY_RUN=1: the same chain at toy sizes (1 shard of 4 prompts x 16 tokens, 3 steps at
# seq_len 64, 1 validation batch), into /tmp/dblast_accelerator_dry, $OUT there too.
set -u
cd "$(dirname "$0")/../../.."
HERE=experiments/flagship/accelerator
T0=$(date +%s)
DRY_RUN=${DRY_RUN:-0}
if [ "$DRY_RUN" = 1 ]; then
  WORK=${WORK:-/tmp/dblast_accelerator_dry}
  OUT=${OUT:-$WORK/out}
  BUDGET_S=${BUDGET_S:-1500}
else
  WORK=${WORK:-/tmp/dblast_accelerator}
  : "${OUT:?OUT is unset: on the device the tool sets it; here use DRY_RUN=1}"
  BUDGET_S=${BUDGET_S:-520}
fi
DEADLINE=$(( T0 + BUDGET_S ))
PACK_S=${PACK_S:-20}  # kept at the end for packing $OUT
META=.device/meta
PART1_COPY=/tmp/dblast_device  # call 1 copies its carried paths here too
mkdir -p "$WORK" "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
export DBLAST_CACHE_DIR=${DBLAST_CACHE_DIR:-$WORK/cache} PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}:/tmp/site  # the wheels (stage wheels)
PY=${PYTHON:-python3}
DBLAST="$PY -m dblast_jax.cli"
meta() { $PY -c "import json, sys; print(json.load(open('$META/manifest.json')).get('$1', '${2-}'))"; }
SEED=${SEED:-$(meta seed 3)}
skipped() { case ",${SKIP:-}," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
stage() {  # stage NAME COMMAND...: run, time, record in $WORK/stages.jsonl
  local name=$1 t=$(date +%s.%N) rc
  shift
  if skipped "$name"; then echo "[$name] skipped (SKIP)"; return 0; fi
  echo "[$name] start at +$(( $(date +%s) - T0 )) s"
  "$@"; rc=$?
  local s=$(python3 -c "print(round($(date +%s.%N) - $t, 1))")
  echo "{\"stage\": \"$name\", \"seconds\": $s, \"rc\": $rc}" >> "$WORK/stages.jsonl"
  echo "[$name] done in $s s (rc $rc)"
  return $rc
}
echo "run_on_accelerator: budget $BUDGET_S s, work $WORK, out $OUT, dry run $DRY_RUN," \
  "seed $SEED, $(nproc) cores, $(date -u +%FT%TZ)"
command -v nvidia-smi > /dev/null && nvidia-smi -L

wheels() {  # the packages setup.py needs that the device's image lacks
  if $PY -c "import grain, gguf, tensorboardX" 2> /dev/null; then
    echo "grain, gguf, tensorboardX already importable: nothing to install"; return 0
  fi
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .device/wheels/*.whl || return 1
  $PY -c "import grain, gguf, tensorboardX, jax; print('jax', jax.__version__, jax.devices())"
}

model() {  # the GGUF where dblast_jax looks for it, byte-exact
  local dest part1
  dest=$($PY -c "from dblast_jax.io.fetch import cached_path, lookup
print(cached_path(lookup('smollm2-135m-instruct')))") || return 1
  if [ -f "$dest" ] && [ "$(sha256sum < "$dest" | cut -c1-64)" = "$(meta gguf_sha256)" ]; then
    echo "$dest is in place (sha256 checked)"; return 0
  fi
  part1=.device/gguf.part1
  [ -f $part1 ] || part1=$PART1_COPY/gguf.part1
  $PY $HERE/travel.py join $META/gguf.json "$dest" $part1 .device/gguf.part2 || return 1
  echo "joined $dest: sha256 $(sha256sum < "$dest" | cut -c1-64) (expected $(meta gguf_sha256))"
}

CORPUS=$WORK/corpus_seed$SEED
REGEN=(--gen-temperatures 1.0,1.0,1.0 --max-new-tokens 256 --shard-size 32
       --batch-size ${REGEN_BATCH:-32})
[ "$DRY_RUN" = 1 ] && CORPUS=$WORK/corpus_dry && REGEN=(--gen-temperatures 1.0
  --max-new-tokens 16 --shard-size 4 --batch-size 4 --max-shards ${DRY_SHARDS:-1})
regen() {
  [ -f "$WORK/regen.done" ] && { echo "regeneration done in an earlier run"; return 0; }
  local cap=$(python3 -c "print(int(${REGEN_FRACTION:-0.4} * $BUDGET_S - ($(date +%s) - $T0)))")
  [ "$cap" -lt 30 ] && { echo "only $cap s left for regeneration: skipped"; return 0; }
  echo "regenerating for at most $cap s"
  timeout -s INT -k 30 "$cap" $DBLAST data regenerate --out "$CORPUS" \
    --prompts-from .device/data/prompts_t1:0:68 --verify-temperatures none \
    --max-prompt-tokens 512 --seed "$SEED" --no-progress "${REGEN[@]}"
  local rc=$?
  case $rc in 0|124|130) touch "$WORK/regen.done"; return 0 ;; *) return $rc ;; esac
}

INIT=.device/drafter
[ -f $INIT/config.json ] || INIT=$PART1_COPY/drafter
TRAIN=(--override=batch_size=${BATCH:-64} --override=seq_len=384
       --override=anchors_per_sequence=16 --validation_batches=8 --probe_steps=20
       --extra_validation=hot=corpora/smollm2_t1:68:72@1.5
       --extra_validation=greedy=corpora/smollm2_t0_heldout:0:4 --reserve_s=${RESERVE_S:-60})
[ "$DRY_RUN" = 1 ] && TRAIN=(--override=batch_size=2 --override=seq_len=64
  --override=anchors_per_sequence=4 --validation_batches=1 --probe_steps=1 --max_steps=3
  --checkpoint_every=1 --reserve_s=0 --extra_validation=hot=corpora/smollm2_t1:68:72@1.5
  --extra_validation=greedy=corpora/smollm2_t0_heldout:0:4)
if [ "${SCHEDULE:-own}" = chain ]; then  # follow the chain's one cosine (train_k1.sh)
  AT=$(meta chain_at) CHAIN=$(meta chain_steps 50000)
  TRAIN+=(--override=schedule_steps=$CHAIN --override=schedule_offset=$AT
          --max_steps=$(( CHAIN - AT )))
fi
train() {
  local shards data
  shards=$($PY -c "import json
try: print(len(json.load(open('$CORPUS/manifest.json'))['shards']))
except OSError: print(0)")
  data=$WORK/train_data_n$shards  # one merge per number of new shards
  echo "training data: greedy corpus (68 shards) + $shards new shards -> $data"
  local new=(); [ "$shards" -gt 0 ] && new=("$CORPUS")
  [ -f .device/data/passes/manifest.json ] && new=(.device/data/passes "${new[@]}") \
    && echo "with the committed passes $(meta passes) (prepare.sh PASSES)"
  $DBLAST data merge --out "$data" .device/data/greedy_t0:0:68 "${new[@]}" \
    --exclude-prompts-of corpora/smollm2_t1:68:72 || return 1
  echo "$data" > "$WORK/train_data"
  $PY $HERE/train_until_deadline.py --workdir="$WORK/leg" \
    --deadline=$(( DEADLINE - PACK_S )) --export="$WORK/export" \
    --override=data="$data" --override=data_shards=0 --override=drafter_layers=1 \
    --override=target_layer_ids=1,7,14,20,27 --override=train_head_tokens=4096 \
    --override=train_head_sampled=1024 --override=distill_weight=1.0 \
    --override=learning_rate=${LR:-1e-3} --override=warmup_fraction=0.03 \
    --override=keep_checkpoints=2 --override=tensorboard=false \
    --override=drafter_init=drafter:$INIT "${TRAIN[@]}"
}

pack() {  # $OUT: at most 8 files, 16 MiB each (travel.py check-out says if not)
  local stem=corpus_seed$SEED
  [ "$DRY_RUN" = 1 ] && stem=corpus_dry
  if [ -f "$CORPUS/manifest.json" ]; then
    $PY $HERE/travel.py pack-corpus "$CORPUS" "$OUT" --stem $stem --max-archives 2 \
      > "$WORK/pack_corpus.json" && cat "$WORK/pack_corpus.json"
  fi
  if [ -f "$WORK/export/config.json" ]; then
    tar -C "$WORK/export" -cf "$OUT/drafter.tar" .
  fi
  [ -f "$WORK/leg/budget_curve.jsonl" ] && cp "$WORK/leg/budget_curve.jsonl" "$OUT/train_curve.jsonl"
  [ -f "$WORK/leg/metrics.jsonl" ] && gzip -c "$WORK/leg/metrics.jsonl" > "$OUT/metrics.jsonl.gz"
  WORK=$WORK CORPUS=$CORPUS SEED=$SEED DRY_RUN=$DRY_RUN T0=$T0 OUT=$OUT $PY - <<'EOF'
import glob, json, os
w, out = os.environ["WORK"], os.environ["OUT"]
load = lambda p: json.load(open(p)) if os.path.exists(p) else None
stages = {}
for line in open(os.path.join(w, "stages.jsonl")) if os.path.exists(os.path.join(w, "stages.jsonl")) else []:
    r = json.loads(line)
    stages[r["stage"]] = stages.get(r["stage"], 0) + r["seconds"]
corpus = load(os.path.join(os.environ["CORPUS"], "manifest.json")) or {}
meta = load(".device/meta/manifest.json") or {}
import jax
summary = {
    "device": jax.devices()[0].device_kind, "jax": jax.__version__,
    "dry_run": os.environ["DRY_RUN"] == "1", "seed": int(os.environ["SEED"]),
    "started_from": {k: meta.get(k) for k in ("commit", "drafter", "drafter_sha256", "next_leg",
                                              "passes")},
    "stage_seconds": stages,
    "corpus": {"shards": len(corpus.get("shards", [])), "num_shards": corpus.get("num_shards"),
               "totals": corpus.get("totals"), "settings": corpus.get("settings")},
    "packed": load(os.path.join(w, "pack_corpus.json")),
    "train": load(os.path.join(w, "leg", "train_summary.json")),
    "train_data": open(os.path.join(w, "train_data")).read().strip()
    if os.path.exists(os.path.join(w, "train_data")) else None,
    "out_files": sorted(os.listdir(out)),
}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps({k: summary[k] for k in ("device", "stage_seconds", "train")}, indent=1))
EOF
}

FAILED=
stage wheels wheels || FAILED="$FAILED wheels"
[ -z "$FAILED" ] && { stage model model || FAILED="$FAILED model"; }
[ -z "$FAILED" ] && { stage regen regen || FAILED="$FAILED regen"; }
[ -z "$FAILED" ] && { stage train train || FAILED="$FAILED train"; }
stage pack pack || FAILED="$FAILED pack"
$PY $HERE/travel.py check-out "$OUT" || FAILED="$FAILED out-limits"
echo "run_on_accelerator: $(( $(date +%s) - T0 )) s of $BUDGET_S;" \
  "${FAILED:+FAILED:$FAILED; }files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
[ -z "$FAILED" ]
