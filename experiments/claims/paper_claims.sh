#!/usr/bin/env bash
# Issue 14, the paper's claims at the new level (docs/research_log.md section 4.8): the main drafters
# and ablations that section 4.7 did not train, each from the same K = 1 trunk
# (from_trunk.sh) over the same 300-step schedule (lr 5e-4, scored every 50 steps) as
# section 4.7's K = 4 NLL + AL (k4al_from_head4k) and its K = 1 NLL + AL control
# (k1al_from_head4k): the DFlash loss at K = 1 (does AL beat it at K = 1?), K = 4 with
# mixture NLL only (does AL help the mixture?), and K = 2 / K = 8 NLL + AL (is K = 4 the
# sweet spot?; K = 8 last, scored apart). Z_T and the gain against temperature are evaluation settings, scored on
# the finished drafters by `dblast validate` (16 held-out batches, paired against the
# K = 1 NLL + AL control). Resumable: rerun after a kill (finished runs return at once, a
# finished validation is skipped). Workdirs, logs and validations land in runs/budget/.
set -u
cd "$(dirname "$0")/../.."
STEPS=300 source experiments/budget/from_trunk.sh   # the recipe, the trunk, from_trunk NAME [flags]
from_trunk dflash_from_head4k --experiment=smollm2_dflash_baseline
from_trunk k4nll_from_head4k --experiment=smollm2_dblast_k4_nll
from_trunk k2al_from_head4k --experiment=smollm2_dblast_k2_al

R=runs/budget
# validate OUT [dblast validate flags...]: 16 held-out batches, once
validate() { local out=$1; shift
  [ -f $out/validation.json ] || nice -n 10 dblast validate --batches 16 --baseline k1_al \
    --out $out "$@" >> $out.log 2>&1; }
CLAIMS=(--drafter k1_al=$R/k1al_from_head4k --drafter dflash=$R/dflash_from_head4k
  --drafter k4_nll=$R/k4nll_from_head4k --drafter k2_al=$R/k2al_from_head4k
  --drafter k4_al=$R/k4al_from_head4k --drafter k4_al_zt0.5=$R/k4al_from_head4k@zt=0.5
  --drafter k4_al_zt2=$R/k4al_from_head4k@zt=2.0)
validate $R/validate_s13_t1.0 "${CLAIMS[@]}" --data corpora/smollm2_t1 --shards 68:72
validate $R/validate_s13_heldout_t1.5 "${CLAIMS[@]}" --data corpora/smollm2_heldout_t15 \
  --shards 0:4 --verify-temperature 1.5
# the gain against temperature: the same text scored at T_v = 0.7 (its stored log-probs),
# for the 300-step pair and the shipped 1,000-step pair
validate $R/validate_s13_t0.7 --drafter k1_al=$R/k1al_from_head4k --drafter k4_al=$R/k4al_from_head4k \
  --drafter k1_al_1000=$R/k1al_from_head4k_1000 --drafter k4_al_1000=$R/k4al_from_head4k_1000 \
  --data corpora/smollm2_t1 --shards 68:72 --verify-temperature 0.7
# Last (the costliest step: the K-fold head at K = 8), K = 8 NLL + AL, scored on the same
# batches beside the control and K = 4
from_trunk k8al_from_head4k --experiment=smollm2_dblast_k8_al
K8=(--drafter k1_al=$R/k1al_from_head4k --drafter k4_al=$R/k4al_from_head4k
  --drafter k8_al=$R/k8al_from_head4k)
validate $R/validate_s13_k8_t1.0 "${K8[@]}" --data corpora/smollm2_t1 --shards 68:72
validate $R/validate_s13_k8_heldout_t1.5 "${K8[@]}" --data corpora/smollm2_heldout_t15 \
  --shards 0:4 --verify-temperature 1.5
