# The recipe every equal-budget run of docs/research_log.md section 4 shares, sourced by
# the scripts of experiments/recipe/ and experiments/claims/ so that their curves stay comparable: the 68-shard snapshot,
# batch 8 x 256, 16 anchors, held-out scoring every 50 steps on 8 fixed batches, two kept
# checkpoints and one feature cache folder. The sourcing script may set BUDGET_CPU_S
# (default 1,500 training CPU-seconds), STEPS (the schedule, 1,000) and LR (1e-3) first.
# The full LM head (train_head_tokens=0), as every run before section 4.6 trained, although
# the experiment now defaults to the sampled head; a run that wants it overrides it after.
# TAPS5 is section 4.2's drafter input: five taps over the depth, one drafter layer.
RECIPE=(--segment_steps=50 --budget_cpu_s=${BUDGET_CPU_S:-1500} --max_steps=${STEPS:-1000}
  --validation_batches=8 --override=data=corpora/smollm2_t1 --override=data_shards=68
  --override=batch_size=8 --override=seq_len=256 --override=anchors_per_sequence=16
  --override=learning_rate=${LR:-1e-3} --override=keep_checkpoints=2
  --override=feature_cache=runs/budget/features --override=train_head_tokens=0)
TAPS5=(--override=target_layer_ids=1,7,14,20,27 --override=drafter_layers=1)

# run_budget NAME [budget_curve.py flags...]: one curve in runs/budget/NAME (log NAME.log)
run_budget() { local name=$1; shift
  mkdir -p runs/budget
  nice -n 10 python experiments/budget/budget_curve.py --workdir=runs/budget/$name \
    "${RECIPE[@]}" "$@" >> runs/budget/$name.log 2>&1; }
