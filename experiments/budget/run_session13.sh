#!/usr/bin/env bash
# Issue 14, the paper's claims at the new level (RESULTS.md section 4.8): the main drafters
# and ablations that section 4.7 did not train, each from the same K = 1 trunk
# (from_trunk.sh) over the same 300-step schedule (lr 5e-4, scored every 50 steps) as
# section 4.7's K = 4 NLL + AL (k4al_from_head4k) and its K = 1 NLL + AL control
# (k1al_from_head4k): the DFlash loss at K = 1 (does AL beat it at K = 1?), K = 4 with
# mixture NLL only (does AL help the mixture?), and K = 2 / K = 8 NLL + AL (is K = 4 the
# sweet spot?). Z_T and the gain against temperature are evaluation settings, scored on
# the finished drafters by `dblast validate`. Resumable: rerun after a kill (finished runs
# return at once). Workdirs and logs land in runs/budget/.
set -u
cd "$(dirname "$0")/../.."
LR=${LR:-5e-4}
BUDGET_CPU_S=100000
STEPS=300 source experiments/budget/recipe.sh
source experiments/budget/from_trunk.sh   # the trunk, and from_trunk NAME [flags]
from_trunk dflash_from_head4k --experiment=smollm2_dflash_baseline
from_trunk k4nll_from_head4k --experiment=smollm2_dblast_k4_nll
from_trunk k2al_from_head4k --experiment=smollm2_dblast_k2_al
from_trunk k8al_from_head4k --experiment=smollm2_dblast_k8_al
