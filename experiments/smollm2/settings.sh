# Shared sizes of the SmolLM2-135M-Instruct runs (sourced by reproduce.sh and ablations.sh,
# so the ablation drafters train exactly like the main four). Every value can be set from
# the environment; TRAIN_OVERRIDES is the `dblast train --override` list they make.
# The recipes train with a mask token (SmolLM2: 16, <empty_output>) and five target taps
# (1, 7, 14, 20, 27; docs/research_log.md section 4.2). Sections 1.7-1.11 there used the
# learned mask embedding and the single middle tap: add mask_token_id=-1 and target_layer_ids=15 to the list to
# reproduce them.
CORPUS=${CORPUS:-corpora/smollm2_t1}
RUNS=${RUNS:-runs/smollm2}
SHARDS=${SHARDS:-36}          # training snapshot: the corpus's first N shards (32 prompts each)
STEPS=${STEPS:-150}           # optimizer steps per drafter
LAYERS=${LAYERS:-1}           # drafter layers
SEQ_LEN=${SEQ_LEN:-256}       # training window (prompt + start of the answer)
ANCHORS=${ANCHORS:-16}        # blocks per sequence per step
LR=${LR:-1e-3}
PROMPTS=${PROMPTS:-4}         # evaluation prompts per benchmark
NEW_TOKENS=${NEW_TOKENS:-128} # evaluation answer length per turn
VAL_SHARDS=${VAL_SHARDS:-2}   # held-out shards right after the snapshot (validation.jsonl)
VALIDATE_EVERY=${VALIDATE_EVERY:-100}
FEATURES=${FEATURES:-$RUNS/features}  # the frozen target's taps, computed once per record

TRAIN_OVERRIDES=()
for kv in num_steps=$STEPS batch_size=8 seq_len=$SEQ_LEN anchors_per_sequence=$ANCHORS \
          learning_rate=$LR drafter_layers=$LAYERS data_shards=$SHARDS checkpoint_every=25 \
          keep_checkpoints=2 feature_cache=$FEATURES validate_every=$VALIDATE_EVERY \
          validation_shards=$SHARDS:$((SHARDS + VAL_SHARDS)) \
          validation_batches=$((VAL_SHARDS * 32 / 8)); do
    TRAIN_OVERRIDES+=(--override "$kv")
done
