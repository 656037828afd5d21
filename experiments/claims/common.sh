# Sourced by the scripts of experiments/claims/: the paper's claims re-tested at this
# project's level (docs/research_log.md section 4.8; RESULTS.md's claims table). Every
# drafter trains from the K = 1 trunk of the shipped drafters (experiments/budget/
# from_trunk.sh, which trains the trunk from the corpus first if it is absent) over the same
# 300-step schedule (lr 5e-4, distillation, the sampled head, held-out points every 50
# steps), and is scored by `dblast validate` on 16 held-out batches (exact expectations;
# the same batches for every drafter), paired against the K = 1 NLL + AL control trained
# alike. Provides:
#   control_pair     the control (k1al_from_head4k) and K = 4 NLL + AL (k4al_from_head4k)
#   shipped_pair     the same pair over a 1,000-step schedule: the shipped drafters' workdirs
#   validate OUT [dblast validate flags...]   once: skipped when OUT/validation.json exists
#   T10, T15         the held-out sets: answers sampled at T = 1.0 scored at T_v = 1.0, the
#                    same prompts answered at T = 1.5 scored at T_v = 1.5
# Finished training runs return at once, so the scripts share workdirs in runs/budget/.
STEPS=300 source experiments/budget/from_trunk.sh   # the recipe, the trunk, from_trunk NAME [flags]
R=runs/budget
control_pair() {
  from_trunk k4al_from_head4k --experiment=smollm2_dblast_k4_al
  from_trunk k1al_from_head4k --experiment=smollm2_k1_al; }
shipped_pair() {
  STEPS=1000 source experiments/budget/recipe.sh
  from_trunk k4al_from_head4k_1000 --experiment=smollm2_dblast_k4_al --segment_steps=100
  from_trunk k1al_from_head4k_1000 --experiment=smollm2_k1_al --segment_steps=100
  STEPS=300 source experiments/budget/recipe.sh; }
validate() { local out=$1; shift
  [ -f $out/validation.json ] || nice -n 10 dblast validate --batches 16 --baseline k1_al \
    --out $out "$@" >> $out.log 2>&1; }
T10=(--data corpora/smollm2_t1 --shards 68:72)
T15=(--data corpora/smollm2_heldout_t15 --shards 0:4 --verify-temperature 1.5)
