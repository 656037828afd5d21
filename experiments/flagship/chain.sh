# Sourced by train_k1.sh, train_on_grown_corpus.sh and eval_export.sh: which flagship
# chain LAYERS (the drafter's layers, default 1) and K (the latent mixture's size, default
# 1) name, its recipe and its next leg. The 1-layer K = 1 chain keeps its historical names
# (experiments/flagship/k1, runs/flagship/k1_legN); every other chain (the depth run
# k1_depthN, the mixture run k4, ...) grows from that chain's latest export.
LAYERS=${LAYERS:-1}
K=${K:-1}
case "$LAYERS" in
  [1-9]) ;;
  *) echo "LAYERS must be a drafter depth from 1 to 9, not '$LAYERS'" >&2; exit 2 ;;
esac
case "$K" in
  1) EXPERIMENT=smollm2_k1_al ;;
  2|4|8) EXPERIMENT=smollm2_dblast_k${K}_al ;;  # the mixture with NLL + AL
  *) echo "K must be the mixture's size: 1, 2, 4 or 8, not '$K'" >&2; exit 2 ;;
esac
NAME=k$K
[ "$LAYERS" != 1 ] && NAME=${NAME}_depth$LAYERS
KEEP=experiments/flagship/$NAME
LEG=$(( $( [ -f $KEEP/legs.jsonl ] && wc -l < $KEEP/legs.jsonl || echo 0 ) + 1 ))
WORK=runs/flagship/${NAME}_leg$LEG
