#!/usr/bin/env bash
# Which category temperature Z_T (z ~ softmax(prior / Z_T)) suits the mixture? An evaluation
# setting of the trained K = 4 NLL + AL drafter (`NAME=DIR@zt=X` applies it to both
# acceptance estimates), scored at Z_T = 0.5 / 1 / 2 against the K = 1 control (common.sh),
# held out at T_v = 1.0 and 1.5. Recorded (sampled-mixture, T_v = 1.5): +3.0% / +2.2% /
# +1.3% over K = 1, no effect at T_v = 1.0 (RESULTS.md, claims table). Resumable: rerun after
# a kill. Workdirs, logs and validations land in runs/budget/.
set -u
cd "$(dirname "$0")/../.."
source experiments/claims/common.sh
control_pair
D=(--drafter k1_al=$R/k1al_from_head4k --drafter k4_al=$R/k4al_from_head4k
  --drafter k4_al_zt0.5=$R/k4al_from_head4k@zt=0.5 --drafter k4_al_zt2=$R/k4al_from_head4k@zt=2.0)
validate $R/validate_category_temperature_t1.0 "${D[@]}" "${T10[@]}"
validate $R/validate_category_temperature_heldout_t1.5 "${D[@]}" "${T15[@]}"
