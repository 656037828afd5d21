#!/usr/bin/env bash
# Does the mixture's gain over K = 1 grow with temperature? K = 4 NLL + AL against its K = 1
# control, trained alike from the shipped drafters' trunk over 300 steps (common.sh) and
# over 1,000 (the shipped pair), scored on the same held-out text at T_v = 0.7 and 1.0
# (answers sampled at T = 1.0, whose stored log-probs cover both) and on the answers
# sampled at T = 1.5 at T_v = 1.5. The tables pair everything against the 300-step control;
# the 1,000-step pair's own gain comes from the per-batch columns of validation.json.
# Recorded (sampled-mixture): +1.0% / +0.8% / +2.2% at T_v = 0.7 / 1.0 / 1.5 after 300
# steps, a flat +1.8% after 1,000 (RESULTS.md, claims table). Resumable: rerun after a kill.
# Workdirs, logs and validations land in runs/budget/.
set -u
cd "$(dirname "$0")/../.."
source experiments/claims/common.sh
control_pair
shipped_pair
D=(--drafter k1_al=$R/k1al_from_head4k --drafter k4_al=$R/k4al_from_head4k
  --drafter k1_al_1000=$R/k1al_from_head4k_1000 --drafter k4_al_1000=$R/k4al_from_head4k_1000)
validate $R/validate_claims_t0.7 "${D[@]}" "${T10[@]}" --verify-temperature 0.7
validate $R/validate_temperature_gain_t1.0 "${D[@]}" "${T10[@]}"
validate $R/validate_temperature_gain_heldout_t1.5 "${D[@]}" "${T15[@]}"
