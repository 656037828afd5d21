#!/usr/bin/env bash
# Ablations at SmolLM2-135M-Instruct scale, same sizes and data snapshot as reproduce.sh:
#   K = 1, 2, 4, 8 (all NLL + AL), and for the K = 4 drafter the category temperature Z_T
#   and the verification mode (greedy-branch vs mixture).
#   bash experiments/smollm2/ablations.sh     # resumable; run reproduce.sh first (corpus)
set -euo pipefail
cd "$(dirname "$0")/../.."

CORPUS=${CORPUS:-corpora/smollm2_t1}
RUNS=${RUNS:-runs/smollm2}
SHARDS=${SHARDS:-36}
STEPS=${STEPS:-150}
PROMPTS=${PROMPTS:-4}
NEW_TOKENS=${NEW_TOKENS:-128}

COMMON=(num_steps=$STEPS batch_size=8 seq_len=${SEQ_LEN:-256} anchors_per_sequence=${ANCHORS:-16}
        learning_rate=${LR:-1e-3} drafter_layers=${LAYERS:-1} data_shards=$SHARDS
        checkpoint_every=25 keep_checkpoints=2)
overrides=()
for kv in "${COMMON[@]}"; do overrides+=(--override "$kv"); done
for exp in smollm2_k1_al smollm2_dblast_k2_al smollm2_dblast_k4_al smollm2_dblast_k8_al; do
    dblast train --experiment "$exp" --workdir "$RUNS/$exp" --data "$CORPUS" "${overrides[@]}"
done

K4="$RUNS/smollm2_dblast_k4_al/export"
dblast eval --baseline k1_al \
    --drafter "k1_al=$RUNS/smollm2_k1_al/export" \
    --drafter "k2_al=$RUNS/smollm2_dblast_k2_al/export" \
    --drafter "k4_al=$K4" \
    --drafter "k8_al=$RUNS/smollm2_dblast_k8_al/export" \
    --drafter "k4_al_zt0.5=$K4@zt=0.5" --drafter "k4_al_zt2=$K4@zt=2.0" \
    --drafter "k4_al_mixture=$K4@mode=mixture" \
    --prompts-per-benchmark "$PROMPTS" --max-new-tokens "$NEW_TOKENS" --batch-size 4 \
    --out "$RUNS/eval_ablations"
