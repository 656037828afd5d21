#!/usr/bin/env bash
# The SmolLM2-135M-Instruct reproduction: does the dependent drafter (K = 4, NLL + AL) beat
# the independent one (K = 1 DFlash) at high temperature, and by how much?
#
#   bash experiments/smollm2/reproduce.sh            # every stage resumes: rerun after a kill
#   STEPS=400 PROMPTS=8 bash experiments/smollm2/reproduce.sh   # a bigger budget
#
# Stages: (1) the corpus (the target's own answers to the deduplicated training prompts,
# committed under corpora/ and grown by rerunning the same command), (2) the four main drafters on a
# fixed snapshot of it (data_shards), (3) evaluation on the four benchmarks at
# T = 0.7 / 1.0 / 1.5 against plain decoding, with the K = 4 AL drafter also under
# `mixture` verification. Results land in $EVAL (default $RUNS/eval: results.md / .json / .csv, PNGs);
# docs/research_log.md section 1 quotes them with these commands.
set -euo pipefail
cd "$(dirname "$0")/../.."

source experiments/smollm2/settings.sh  # CORPUS RUNS SHARDS STEPS ... TRAIN_OVERRIDES
EXPERIMENTS=${EXPERIMENTS:-"smollm2_dflash_baseline smollm2_k1_al smollm2_dblast_k4_nll smollm2_dblast_k4_al"}
EVAL=${EVAL:-$RUNS/eval}      # evaluation folder (resumes by drafter name: use a new one after
                              # training on, e.g. STEPS raised in existing workdirs)

# (1) corpus: all training prompts of <= 512 tokens, answered at T = 1.0 (<= 256 tokens),
# target log-probs stored at the three evaluation temperatures (the AL loss reads T_v = 1.0)
missing=$(python - "$CORPUS" "$((SHARDS + VAL_SHARDS))" <<'EOF'
import json, os, sys
folder, want = sys.argv[1], int(sys.argv[2])
path = os.path.join(folder, "manifest.json")
have = {s["index"] for s in json.load(open(path))["shards"]} if os.path.exists(path) else set()
print(len(set(range(want)) - have))
EOF
)
if (( missing > 0 )); then
    dblast data regenerate --out "$CORPUS" --gen-temperatures 1.0 \
        --verify-temperatures 0.7,1.0,1.5 --max-new-tokens 256 --max-prompt-tokens 512 \
        --batch-size 16 --shard-size 32 --seed 0 --max-shards "$missing"
fi

# (2) the four drafters: same sizes, same data snapshot, same seed
for exp in $EXPERIMENTS; do
    dblast train --experiment "$exp" --workdir "$RUNS/$exp" --data "$CORPUS" "${TRAIN_OVERRIDES[@]}"
done

# (3) evaluation: plain decoding + each drafter on the same prompts and seeds
drafters=()
for exp in $EXPERIMENTS; do drafters+=(--drafter "${exp#smollm2_}=$RUNS/$exp/export"); done
if [[ " $EXPERIMENTS " == *" smollm2_dblast_k4_al "* ]]; then
    drafters+=(--drafter "dblast_k4_al_mixture=$RUNS/smollm2_dblast_k4_al/export@mode=mixture")
fi
dblast eval "${drafters[@]}" --baseline dflash_baseline --prompts-per-benchmark "$PROMPTS" \
    --max-new-tokens "$NEW_TOKENS" --batch-size 4 --out "$EVAL"

# training curves of the drafters (loss, top-1 agreement, AL estimate vs step)
workdirs=()
for exp in $EXPERIMENTS; do workdirs+=("$RUNS/$exp"); done
python -m dblast_jax.train.curves "${workdirs[@]}" --out "$EVAL/training_curves.png"
