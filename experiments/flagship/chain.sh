# Sourced by train_k1.sh and train_on_grown_corpus.sh: which flagship chain LAYERS (the
# drafter's layers, default 1) names, and its next leg. The 1-layer chain keeps its
# historical names (experiments/flagship/k1, runs/flagship/k1_legN).
LAYERS=${LAYERS:-1}
case "$LAYERS" in
  1) NAME=k1 ;;
  [2-9]) NAME=k1_depth$LAYERS ;;
  *) echo "LAYERS must be a drafter depth from 1 to 9, not '$LAYERS'" >&2; exit 2 ;;
esac
KEEP=experiments/flagship/$NAME
LEG=$(( $( [ -f $KEEP/legs.jsonl ] && wc -l < $KEEP/legs.jsonl || echo 0 ) + 1 ))
WORK=runs/flagship/${NAME}_leg$LEG
