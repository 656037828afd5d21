#!/usr/bin/env bash
# Does the acceptance-oriented (AL) loss beat the DFlash loss and plain likelihood? From the
# shipped drafters' trunk, 300 steps each (common.sh): K = 1 with the DFlash loss
# (dflash_from_head4k) and K = 4 with the mixture NLL alone (k4nll_from_head4k), against
# K = 1 and K = 4 with NLL + AL (the control pair), held out at T_v = 1.0 and 1.5.
# Recorded: the K = 1 DFlash loss -7.9% +- 0.4% at T_v = 1.5 (+2.6% at 1.0), K = 4 NLL
# -7.0% +- 0.5% against NLL + AL's +2.2% +- 0.3% (sampled-mixture; RESULTS.md, claims table).
# Resumable: rerun after a kill. Workdirs, logs and validations land in runs/budget/.
set -u
cd "$(dirname "$0")/../.."
source experiments/claims/common.sh
control_pair
from_trunk dflash_from_head4k --experiment=smollm2_dflash_baseline
from_trunk k4nll_from_head4k --experiment=smollm2_dblast_k4_nll
D=(--drafter k1_al=$R/k1al_from_head4k --drafter dflash=$R/dflash_from_head4k
  --drafter k4_nll=$R/k4nll_from_head4k --drafter k4_al=$R/k4al_from_head4k)
validate $R/validate_al_vs_nll_t1.0 "${D[@]}" "${T10[@]}"
validate $R/validate_al_vs_nll_heldout_t1.5 "${D[@]}" "${T15[@]}"
