#!/usr/bin/env bash
# DBlast against the other ways of making a block drafter dependent (issue 32), under the
# same exact verifier: every variant trains STEPS steps (default 10,000) from the same K = 1
# trunk (the flagship's latest export, experiments/flagship/k1/drafter) on the same data
# (the flagship's sampled + greedy answers, 384-token window, bfloat16 feature cache),
# with the flagship's recipe (distillation to the target's top-64, the sampled head, lr
# 5e-4 cosine), and is scored by `dblast validate` on the same held-out batches at
# T_v = 0.7 / 1.0 (answers sampled at T = 1.0) and 1.5 (answers sampled at T = 1.5),
# paired against the K = 1 control trained alike:
#
#   k1_control      K = 1, NLL + AL                      (the control)
#   dblast_k4       K = 4 latent mixture, NLL + AL       (DBlast)
#   correction      K = 1 + a serial previous-token correction head (Domino / DSpark style)
#   block_causal    K = 1, block-causal attention        (JetSpec style)
#   k4_correction   K = 4 + the correction head          (do the two stack?)
#
#     bash experiments/claims/dependent_drafters.sh                 # all, or resume
#     VARIANTS="k1_control correction" bash experiments/claims/dependent_drafters.sh
#     STEPS=2 BATCHES=1 DATA=... OUT=/tmp/dry bash experiments/claims/dependent_drafters.sh
#
# Each variant is a resumable run in $OUT/NAME (a finished one returns at once); a variant
# finished on a machine that is then lost must be trained again, so run one or two per
# working day (~1.2 h each at 10,000 steps on 2 cores, after a ~1 h feature cache) or all
# of them where an accelerator is lent. The validations land in $OUT/validate_t{0.7,1.0,1.5}
# (validation.md: the paired table for RESULTS.md).
set -u
cd "$(dirname "$0")/../.."
STEPS=${STEPS:-10000}
BATCHES=${BATCHES:-16}
OUT=${OUT:-runs/dependent}
TRUNK=${TRUNK:-experiments/flagship/k1/drafter}
VARIANTS=${VARIANTS:-"k1_control dblast_k4 correction block_causal k4_correction"}
mkdir -p "$OUT"
if [ -z "${DATA-}" ]; then  # the flagship's leg-3 data: sampled + greedy answers
  DATA=runs/corpora/smollm2_t1_t0
  [ -f $DATA/manifest.json ] || dblast data merge --out $DATA corpora/smollm2_t1:0:68 \
    corpora/smollm2_t0:0:68 --exclude-prompts-of corpora/smollm2_t1:68:72 >> "$OUT/data.log"
fi
[ -f "$TRUNK/config.json" ] || { echo "no trunk at $TRUNK (config.json)" >&2; exit 1; }

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

for v in $VARIANTS; do
  f=$(flags_of $v) || exit 1
  # shellcheck disable=SC2086  # $f is a list of flags
  nice -n 10 python experiments/budget/budget_curve.py --workdir="$OUT/$v" $f \
    --max_steps=$STEPS --segment_steps=$(( STEPS >= 2000 ? 2000 : STEPS )) \
    --checkpoint_every=$(( STEPS >= 250 ? 250 : STEPS )) --budget_cpu_s=1e9 \
    --validation_batches=8 --override=data=$DATA --override=data_shards=0 \
    --override=batch_size=8 --override=seq_len=384 --override=anchors_per_sequence=16 \
    --override=learning_rate=5e-4 --override=warmup_fraction=0.03 \
    --override=keep_checkpoints=2 --override=feature_cache=$OUT/features \
    --override=feature_cache_dtype=bfloat16 \
    --override=target_layer_ids=1,7,14,20,27 --override=drafter_layers=1 \
    --override=train_head_tokens=4096 --override=train_head_sampled=1024 \
    --override=distill_weight=1.0 --override=drafter_init=drafter:$TRUNK \
    >> "$OUT/$v.log" 2>&1 || { echo "variant $v stopped; see $OUT/$v.log" >&2; exit 1; }
done

D=()
for v in $VARIANTS; do D+=(--drafter "$v=$OUT/$v"); done
BASE=(--baseline k1_control)
case " $VARIANTS " in *" k1_control "*) ;; *) BASE=() ;; esac
validate() { local out=$1; shift
  [ -f "$out/validation.json" ] || nice -n 10 dblast validate --batches $BATCHES \
    --seq-len 384 "${D[@]}" "${BASE[@]}" --out "$out" --no-progress "$@" >> "$out.log" 2>&1 \
    || { echo "validation $out failed; see $out.log" >&2; exit 1; }; }
validate "$OUT/validate_t0.7" --data corpora/smollm2_t1 --shards 68:72 --verify-temperature 0.7
validate "$OUT/validate_t1.0" --data corpora/smollm2_t1 --shards 68:72 --verify-temperature 1.0
validate "$OUT/validate_t1.5" --data corpora/smollm2_heldout_t15 --shards 0:4 \
  --verify-temperature 1.5
for t in 0.7 1.0 1.5; do echo "## T_v = $t"; cat "$OUT/validate_t$t/validation.md"; done
