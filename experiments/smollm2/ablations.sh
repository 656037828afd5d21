#!/usr/bin/env bash
# Ablations at SmolLM2-135M-Instruct scale, trained exactly like reproduce.sh's drafters
# (settings.sh; run reproduce.sh first: corpus, feature cache, k1_al and dblast_k4_al):
#   * K = 1, 2, 4, 8 (all NLL + AL): K = 2 / 8 are trained here;
#   * the K = 4 drafter's category temperature Z_T (0.5, 2) and verification mode.
# Measured on the held-out shards (`dblast validate`: exact expected acceptance, paired,
# ~1% SE) -> $RUNS/validate_ablations; ABLATION_EVAL=1 also runs the benchmarks (slow:
# ~15 min of this CPU per drafter at 8 prompts) -> $RUNS/eval_ablations.
#   RUNS=runs/smollm2_full SHARDS=68 VAL_SHARDS=4 STEPS=1000 bash experiments/smollm2/ablations.sh
#   ABLATIONS=smollm2_dblast_k2_al ...    # only K = 2 (K = 8 costs ~2x a K = 4 step)
set -euo pipefail
cd "$(dirname "$0")/../.."

source experiments/smollm2/settings.sh  # CORPUS RUNS SHARDS STEPS ... TRAIN_OVERRIDES
ABLATIONS=${ABLATIONS:-"smollm2_dblast_k2_al smollm2_dblast_k8_al"}

for exp in $ABLATIONS; do
    dblast train --experiment "$exp" --workdir "$RUNS/$exp" --data "$CORPUS" "${TRAIN_OVERRIDES[@]}"
done

K4="$RUNS/smollm2_dblast_k4_al/export"
drafters=(--drafter "k1_al=$RUNS/smollm2_k1_al/export")
for exp in $ABLATIONS; do drafters+=(--drafter "${exp#smollm2_dblast_}=$RUNS/$exp/export"); done
drafters+=(--drafter "k4_al=$K4" --drafter "k4_al_zt0.5=$K4@zt=0.5" --drafter "k4_al_zt2=$K4@zt=2.0")
dblast validate "${drafters[@]}" --data "$CORPUS" --shards "$SHARDS:$((SHARDS + VAL_SHARDS))" \
    --batches $((VAL_SHARDS * 32 / 8)) --baseline k1_al --out "$RUNS/validate_ablations"

if [[ "${ABLATION_EVAL:-0}" == 1 ]]; then
    dblast eval "${drafters[@]}" --drafter "k4_al_mixture=$K4@mode=mixture" --baseline k1_al \
        --prompts-per-benchmark "$PROMPTS" --max-new-tokens "$NEW_TOKENS" --batch-size 4 \
        --out "$RUNS/eval_ablations"
fi
