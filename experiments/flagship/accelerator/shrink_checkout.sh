#!/usr/bin/env bash
# The working tree shrunk to what the device job needs, for the two device calls, and back.
# The tool sends the tracked files present in the tree, so a sparse checkout
# (sparse_patterns.txt, ~2.5 MB) is what lets the model and the drafter travel: the whole
# tree is ~99 MB, over the tool's 64 MiB per call. Files with local changes and untracked
# files stay (and travel): `measure` counts them.
#
#     bash experiments/flagship/accelerator/shrink_checkout.sh shrink    # then the calls
#     bash experiments/flagship/accelerator/shrink_checkout.sh measure   # what each sends
#     bash experiments/flagship/accelerator/shrink_checkout.sh restore   # right after
#
# shrink refuses while another process works in the checkout (its files would vanish under
# a training leg or a corpus growth, which would then redo or break them): stop them, or
# FORCE=1 if you know they touch nothing of it.
set -eu
cd "$(dirname "$0")/../../.."
HERE=experiments/flagship/accelerator
ROOT=$PWD
CALL1=(.device/gguf.part1 .device/drafter)
CALL2=(.device/gguf.part2 .device/meta .device/wheels .device/data)
others() {  # processes with their working folder in the checkout, but this script, its
  # ancestors and its own children
  local me=$BASHPID mine=" " p=$BASHPID
  while [ "$p" -gt 1 ]; do mine="$mine$p "; p=$(awk '/^PPid:/ {print $2}' /proc/$p/status); done
  for d in /proc/[0-9]*; do
    local pid=${d#/proc/} cwd parent
    cwd=$(readlink $d/cwd 2> /dev/null) || continue
    parent=$(awk '/^PPid:/ {print $2}' $d/status 2> /dev/null) || continue
    case "$mine" in *" $pid "*) continue ;; esac
    [ "$parent" = "$me" ] && continue
    case "$cwd/" in "$ROOT"/*) echo "$pid $(tr '\0' ' ' < $d/cmdline | cut -c1-100)" ;; esac
  done
}
measure() {
  python $HERE/travel.py measure --carry "${CALL1[@]}" > /tmp/dblast_call1.json \
    && echo "call 1: $(python -c "import json; r = json.load(open('/tmp/dblast_call1.json')); print(f\"{r['total_bytes'] / 2**20:.1f} MiB (tree {r['tree_bytes'] / 2**20:.1f})\")")" \
    || return 1
  python $HERE/travel.py measure --carry "${CALL2[@]}" > /tmp/dblast_call2.json \
    && echo "call 2: $(python -c "import json; r = json.load(open('/tmp/dblast_call2.json')); print(f\"{r['total_bytes'] / 2**20:.1f} MiB (tree {r['tree_bytes'] / 2**20:.1f})\")")"
}
case "${1:-}" in
  shrink)
    busy=$(others)
    if [ -n "$busy" ] && [ "${FORCE:-0}" != 1 ]; then
      echo "processes work in $ROOT; a sparse checkout would remove files under them:" >&2
      echo "$busy" >&2
      exit 1
    fi
    [ -f .device/meta/manifest.json ] || { echo "run prepare.sh first" >&2; exit 1; }
    grep -v '^#' $HERE/sparse_patterns.txt | git sparse-checkout set --no-cone --stdin
    echo "checkout shrunk to $HERE/sparse_patterns.txt ($(git ls-files -t | grep -c '^S') files" \
      "left out); restore with: bash $HERE/shrink_checkout.sh restore"
    measure || { echo "over the limit: restore, then commit / move what travels" >&2; exit 1; }
    ;;
  measure) measure ;;
  restore)
    git sparse-checkout disable
    echo "checkout restored: $(git ls-files -t | grep -c '^S') files left out (0 expected)"
    git status --short | head -20
    ;;
  *) echo "usage: $0 shrink|measure|restore" >&2; exit 2 ;;
esac
