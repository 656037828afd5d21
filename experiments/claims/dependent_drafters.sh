#!/usr/bin/env bash
# DBlast against the other ways of making a block drafter dependent (issue 32), under the
# same exact verifier: every variant trains STEPS steps (default 10,000) from the same K = 1
# trunk (the flagship's export as committed at TRUNK_AT: leg 9's, held out 0.507, 32,000
# steps) on the same data (the flagship's greedy answers + sampled pass 3, 384-token window,
# bfloat16 feature cache, shared with the flagship's legs in FEATURES) with the flagship's
# recipe (distillation to the target's top-64, the sampled head, lr 5e-4 cosine), and is
# scored by `dblast validate` on the same held-out batches at T_v = 0.7 / 1.0 (answers
# sampled at T = 1.0) and 1.5 (answers sampled at T = 1.5), paired against the K = 1
# control trained alike:
#
#   k1_control      K = 1, NLL + AL                      (the control)
#   dblast_k4       K = 4 latent mixture, NLL + AL       (DBlast)
#   correction      K = 1 + a serial previous-token correction head (Domino / DSpark style)
#   block_causal    K = 1, block-causal attention        (JetSpec style)
#   k4_correction   K = 4 + the correction head          (do the two stack?)
#
# Each variant is then run alone on the four benchmarks (BENCH_PROMPTS prompts each, batch
# 1, plain decoding side by side): T = 0.7 with argmax drafts, T = 1.5 with drafts sampled
# from q (sampled-branch; sampled-mixture for K = 4): tau, speed and milliseconds per step.
#
#     bash experiments/claims/dependent_drafters.sh                 # all, or resume
#     VARIANTS="k1_control correction" bash experiments/claims/dependent_drafters.sh
#     VARIANTS=dblast_k4 bash experiments/claims/dependent_drafters.sh &  # side by side:
#         one invocation per variant, each on its own core (a variant already being
#         trained by another invocation is refused)
#     STEPS=2 BATCHES=1 DATA=... OUT=/tmp/dry KEEP=/tmp/dry/keep \
#         bash experiments/claims/dependent_drafters.sh
#
#     PACK=1 bash experiments/claims/dependent_drafters.sh   # before the machine goes:
#         the newest checkpoint of each unfinished variant -> $KEEP/NAME/unfinished (commit
#         it); the next machine's invocation unpacks it and resumes at that step, exactly
#
# The comparison is built one variant at a time, across machines: a variant trains as a
# resumable run in $OUT/NAME (runs/, lost with the machine; `PACK=1` carries its newest
# checkpoint, ~56-62 MB, in $KEEP/NAME/unfinished to the next machine, where `dblast carry
# unpack` checks it by sha256 and the run resumes from it), is validated and benchmarked
# alone, and its results are committed to $KEEP/NAME (training.json: steps, training
# CPU-s, the trunk's sha256; validate_t{0.7,1.0,1.5}.json; bench_t{0.7,1.5}.json). A
# variant with its results in $KEEP is never trained again. Every variant is scored on the
# same held-out batches, so dependent_table.py pairs the committed per-batch numbers as
# one joint run would; it writes $KEEP/table.md once the variants asked for are all in.
# The feature cache is the flagship's (built once, ~70 min where it is missing); a
# variant's 10,000 steps then take ~3 h (K = 1) and more for K = 4 on the one core a
# flagship leg leaves free, and its benchmarks ~15 min, so the comparison spans sessions,
# or one sitting where an accelerator is lent. The trunk is pinned by commit (TRUNK_AT),
# not by path, so that later flagship legs do not change it under a half-finished
# comparison; a different trunk is refused.
set -u
cd "$(dirname "$0")/../.."
STEPS=${STEPS:-10000}
BATCHES=${BATCHES:-16}
BENCH_PROMPTS=${BENCH_PROMPTS:-2}  # per benchmark, batch 1, at T = 0.7 and 1.5
BENCH_TOKENS=${BENCH_TOKENS:-96}
OUT=${OUT:-runs/dependent}
KEEP=${KEEP:-experiments/claims/dependent}
TRUNK_AT=${TRUNK_AT:-31571e0}  # holds flagship leg 9's export (experiments/flagship/k1/drafter)
FEATURES=${FEATURES:-runs/flagship/features}  # keyed by corpus digest: shared safely
VARIANTS=${VARIANTS:-"k1_control dblast_k4 correction block_causal k4_correction"}
mkdir -p "$OUT" "$KEEP"
TRUNK_GIVEN=${TRUNK-}
if [ -z "$TRUNK_GIVEN" ]; then  # the flagship's export as committed at TRUNK_AT
  TRUNK=$OUT/trunk_$TRUNK_AT
  if [ ! -f "$TRUNK/config.json" ]; then
    files=$(git ls-tree --name-only "$TRUNK_AT" experiments/flagship/k1/drafter/ 2>/dev/null)
    [ -n "$files" ] || { echo "no experiments/flagship/k1/drafter at commit $TRUNK_AT" \
      "(a shallow clone? git fetch --unshallow, or set TRUNK to a drafter folder)" >&2; exit 1; }
    rm -rf "$TRUNK.tmp" && mkdir -p "$TRUNK.tmp"
    for f in $files; do git show "$TRUNK_AT:$f" > "$TRUNK.tmp/$(basename "$f")" || exit 1; done
    mv "$TRUNK.tmp" "$TRUNK"
  fi
fi
[ -f "$TRUNK/config.json" ] || { echo "no trunk at $TRUNK (config.json)" >&2; exit 1; }
TRUNK_SHA=$(cat "$TRUNK"/*.safetensors | sha256sum | cut -d' ' -f1)
if [ -z "${DATA-}" ]; then  # the flagship's leg-10 data: greedy answers + sampled pass 3
  DATA=runs/corpora/smollm2_t0_t1pass3
  [ -f $DATA/manifest.json ] || dblast data merge --out $DATA corpora/smollm2_t0:0:68 \
    corpora/smollm2_t1_more:136:204 --exclude-prompts-of corpora/smollm2_t1:68:72 \
    >> "$OUT/data.log"
fi

flags_of() {  # the experiment and overrides that make variant $1
  case $1 in
    k1_control) echo --experiment=smollm2_k1_al ;;
    dblast_k4) echo --experiment=smollm2_dblast_k4_al ;;
    correction) echo --experiment=smollm2_k1_al --override=correction=previous-token ;;
    block_causal) echo --experiment=smollm2_k1_al --override=drafter.block_attention=causal ;;
    k4_correction) echo --experiment=smollm2_dblast_k4_al --override=correction=previous-token ;;
    *) echo "unknown variant $1 (known: k1_control dblast_k4 correction block_causal" \
            "k4_correction)" >&2; return 1 ;;
  esac
}
for v in $VARIANTS; do flags_of $v > /dev/null || exit 1; done
if [ -n "${PACK-}" ]; then  # carry each unfinished variant's newest checkpoint in $KEEP
  for v in $VARIANTS; do
    [ -f "$KEEP/$v/training.json" ] && continue
    [ -d "$OUT/$v/checkpoints" ] || { echo "$v: no checkpoint in $OUT/$v to carry"; continue; }
    dblast carry pack "$OUT/$v" "$KEEP/$v/unfinished" || exit 1
  done
  exit 0
fi
for f in "$KEEP"/*/training.json; do  # results of another trunk are never mixed in
  [ -f "$f" ] || continue
  grep -q "\"trunk_sha256\": \"$TRUNK_SHA\"" "$f" || { echo "$f was trained from another" \
    "trunk than $TRUNK (sha256 $TRUNK_SHA): move $KEEP aside or set TRUNK_AT to its" \
    "commit" >&2; exit 1; }
done

# dblast validate of variant $1 alone at T_v = $2 on data $3 shards $4 -> $KEEP/$1
validate() {
  local out=$OUT/$1.validate_t$2
  [ -f "$out/validation.json" ] || nice -n 10 dblast validate --batches $BATCHES \
    --seq-len 384 --drafter "$1=$OUT/$1" --data $3 --shards $4 --verify-temperature $2 \
    --out "$out" --no-progress >> "$out.log" 2>&1 \
    || { echo "validation $out failed; see $out.log" >&2; exit 1; }
  cp "$out/validation.json" "$KEEP/$1/validate_t$2.json"
}

modes_of() {  # verify modes at T = 0.7 (argmax drafts) and T = 1.5 (drafts sampled from q)
  case $1 in
    dblast_k4|k4_correction) echo mixture sampled-mixture ;;
    *) echo greedy-branch sampled-branch ;;
  esac
}

# dblast eval of variant $1 alone on the four benchmarks at T = $2, verify mode $3, batch 1,
# plain decoding of the same prompts side by side -> $KEEP/$1/bench_t$2.json
bench() {
  local out=$OUT/$1.bench_t$2
  [ -f "$out/results.json" ] || nice -n 10 dblast eval --drafter "$1=$OUT/$1@mode=$3" \
    --temperatures $2 --prompts-per-benchmark $BENCH_PROMPTS --max-new-tokens $BENCH_TOKENS \
    --batch-size 1 --no-progress --out "$out" >> "$out.log" 2>&1 \
    || { echo "benchmark $out failed; see $out.log" >&2; exit 1; }
  cp "$out/results.json" "$KEEP/$1/bench_t$2.json"
}

for v in $VARIANTS; do
  [ -f "$KEEP/$v/training.json" ] && { echo "$v: finished ($KEEP/$v)"; continue; }
  exec 9> "$OUT/$v.lock"  # one invocation per variant (side-by-side runs share $OUT)
  flock -n 9 || { echo "variant $v is being trained by another invocation" \
    "($OUT/$v.lock is held)" >&2; exit 1; }
  if [ -f "$KEEP/$v/unfinished/carried_run.json" ]; then  # carried from another machine
    dblast carry unpack "$KEEP/$v/unfinished" "$OUT/$v" >> "$OUT/$v.log" 2>&1 \
      || { echo "the run carried in $KEEP/$v/unfinished was not unpacked; see $OUT/$v.log" \
           >&2; exit 1; }
  fi
  f=$(flags_of $v)
  # shellcheck disable=SC2086  # $f is a list of flags
  nice -n 10 python experiments/budget/budget_curve.py --workdir="$OUT/$v" $f \
    --max_steps=$STEPS --segment_steps=$(( STEPS >= 2000 ? 2000 : STEPS )) \
    --checkpoint_every=$(( STEPS >= 250 ? 250 : STEPS )) --budget_cpu_s=1e9 \
    --validation_batches=8 --override=data=$DATA --override=data_shards=0 \
    --override=batch_size=8 --override=seq_len=384 --override=anchors_per_sequence=16 \
    --override=learning_rate=5e-4 --override=warmup_fraction=0.03 \
    --override=keep_checkpoints=2 --override=feature_cache=$FEATURES \
    --override=feature_cache_dtype=bfloat16 \
    --override=target_layer_ids=1,7,14,20,27 --override=drafter_layers=1 \
    --override=train_head_tokens=4096 --override=train_head_sampled=1024 \
    --override=distill_weight=1.0 --override=drafter_init=drafter:$TRUNK \
    >> "$OUT/$v.log" 2>&1 || { echo "variant $v stopped; see $OUT/$v.log" >&2; exit 1; }
  mkdir -p "$KEEP/$v"
  validate $v 0.7 corpora/smollm2_t1 68:72
  validate $v 1.0 corpora/smollm2_t1 68:72
  validate $v 1.5 corpora/smollm2_heldout_t15 0:4
  read -r mode_cool mode_hot <<< "$(modes_of $v)"
  bench $v 0.7 $mode_cool
  bench $v 1.5 $mode_hot
  # written last: a kill before it trains nothing again (the run has finished) but
  # repeats the validations and benchmarks
  python - "$OUT/$v/budget_curve.jsonl" "$KEEP/$v/training.json" "$TRUNK_AT" "$TRUNK_SHA" \
      "$TRUNK_GIVEN" <<'PY' || exit 1
import json, os, sys, time
curve, out, at, sha, given = sys.argv[1:]
last = [json.loads(line) for line in open(curve) if line.strip()][-1]
record = {"steps": last["step"], "cpu_s": last["cpu_s"],
          "setup_cpu_s": last.get("setup_cpu_s"), "trunk": given or at,
          "trunk_sha256": sha, "date": time.strftime("%Y-%m-%d")}
with open(out + ".tmp", "w") as f:
    json.dump(record, f, indent=1)
os.replace(out + ".tmp", out)
PY
  rm -rf "$KEEP/$v/unfinished"  # finished: nothing left to carry
  echo "$v: finished and recorded in $KEEP/$v"
done
python experiments/claims/dependent_table.py --keep="$KEEP" --variants="$(echo $VARIANTS | tr ' ' ,)"
