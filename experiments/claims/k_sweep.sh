#!/usr/bin/env bash
# Are K = 4 branches enough? From the shipped drafters' trunk, 300 steps each (common.sh):
# NLL + AL at K = 2 and K = 8 beside the K = 4 and the K = 1 control, held out at T_v = 1.0
# and 1.5. Recorded (sampled-mixture, T_v = 1.5): K = 2 / 4 / 8 +1.4% / +2.2% / +3.0% over
# K = 1, all level at T_v = 1.0; a K = 8 step costs 1.34x a K = 4 step (RESULTS.md, claims
# table). Resumable: rerun after a kill. Workdirs, logs and validations land in runs/budget/.
set -u
cd "$(dirname "$0")/../.."
source experiments/claims/common.sh
control_pair
from_trunk k2al_from_head4k --experiment=smollm2_dblast_k2_al
from_trunk k8al_from_head4k --experiment=smollm2_dblast_k8_al
D=(--drafter k1_al=$R/k1al_from_head4k --drafter k2_al=$R/k2al_from_head4k
  --drafter k4_al=$R/k4al_from_head4k --drafter k8_al=$R/k8al_from_head4k)
validate $R/validate_k_sweep_t1.0 "${D[@]}" "${T10[@]}"
validate $R/validate_k_sweep_heldout_t1.5 "${D[@]}" "${T15[@]}"
