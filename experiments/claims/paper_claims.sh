#!/usr/bin/env bash
# The paper's four claims at this project's level, in one run (docs/research_log.md section
# 4.8, whose tables experiments/budget/results/validation_claims_*.md are this script's
# validations). From the shipped drafters' trunk over the same 300-step schedule
# (common.sh): besides the K = 4 NLL + AL drafter and its K = 1 NLL + AL control, the DFlash
# loss at K = 1 (does AL beat it?), K = 4 with mixture NLL only (does AL help the
# mixture?), and K = 2 / K = 8 NLL + AL (is K = 4 enough?; K = 8 last, scored apart on the
# same batches); Z_T = 0.5 / 2 on the trained K = 4; and the gain against temperature (the
# same text scored at T_v = 0.7, for the 300-step pair and the shipped 1,000-step pair).
# The per-claim scripts beside it (al_vs_nll.sh, k_sweep.sh, category_temperature.sh,
# temperature_gain.sh) each train and score one claim's drafters alone. Resumable: rerun
# after a kill (finished runs return at once, a finished validation is skipped). Workdirs,
# logs and validations land in runs/budget/ (validate_claims_*; validate_s13_* before
# 2026-12-03: rename them so that they are skipped).
set -u
cd "$(dirname "$0")/../.."
source experiments/claims/common.sh   # the trunk, from_trunk, control_pair, shipped_pair, validate
control_pair   # trained by experiments/recipe/k4_from_sampled_head_trunk.sh when the tables were made
from_trunk dflash_from_head4k --experiment=smollm2_dflash_baseline
from_trunk k4nll_from_head4k --experiment=smollm2_dblast_k4_nll
from_trunk k2al_from_head4k --experiment=smollm2_dblast_k2_al

CLAIMS=(--drafter k1_al=$R/k1al_from_head4k --drafter dflash=$R/dflash_from_head4k
  --drafter k4_nll=$R/k4nll_from_head4k --drafter k2_al=$R/k2al_from_head4k
  --drafter k4_al=$R/k4al_from_head4k --drafter k4_al_zt0.5=$R/k4al_from_head4k@zt=0.5
  --drafter k4_al_zt2=$R/k4al_from_head4k@zt=2.0)
validate $R/validate_claims_t1.0 "${CLAIMS[@]}" "${T10[@]}"
validate $R/validate_claims_heldout_t1.5 "${CLAIMS[@]}" "${T15[@]}"
# the gain against temperature: the same text scored at T_v = 0.7 (its stored log-probs),
# for the 300-step pair and the shipped 1,000-step pair
shipped_pair
validate $R/validate_claims_t0.7 --drafter k1_al=$R/k1al_from_head4k --drafter k4_al=$R/k4al_from_head4k \
  --drafter k1_al_1000=$R/k1al_from_head4k_1000 --drafter k4_al_1000=$R/k4al_from_head4k_1000 \
  "${T10[@]}" --verify-temperature 0.7
# Last (the costliest step: the K-fold head at K = 8), K = 8 NLL + AL, scored on the same
# batches beside the control and K = 4
from_trunk k8al_from_head4k --experiment=smollm2_dblast_k8_al
K8=(--drafter k1_al=$R/k1al_from_head4k --drafter k4_al=$R/k4al_from_head4k
  --drafter k8_al=$R/k8al_from_head4k)
validate $R/validate_claims_k8_t1.0 "${K8[@]}" "${T10[@]}"
validate $R/validate_claims_k8_heldout_t1.5 "${K8[@]}" "${T15[@]}"
