#!/usr/bin/env bash
# Run HERE (the CPU machine), before the two device calls of README.md: writes .device/
# (ignored by git) with everything the device job needs that the shrunk tree does not hold,
# sized so that each call sends under LIMIT_MIB (default 60; the tool refuses over 64):
#   .device/gguf.part1|2   the target's GGUF, gzipped and cut in two (call 1 | call 2)
#   .device/drafter/       the chain's latest export, the leg's starting point (call 1)
#   .device/wheels/        the packages setup.py needs that the device lacks (call 2)
#   .device/data/          tokens-only copies of corpora/smollm2_t1 (the training prompts,
#                          shards 0-67) and corpora/smollm2_t0 (the greedy answers) (call 2)
#   .device/meta/          gguf.json (part digests) and manifest.json (seed, commit, chain)
# then prints the sparse checkout, the two tool calls (command, carry, bytes sent) and the
# restore. Rerunning it redoes only what changed (drop-scores and wheels resume).
#
#     nice -n 19 bash experiments/flagship/accelerator/prepare.sh
#     SEED=4 INIT=experiments/flagship/k1/drafter nice -n 19 bash experiments/flagship/accelerator/prepare.sh
set -eu
cd "$(dirname "$0")/../../.."
HERE=experiments/flagship/accelerator
D=.device
LIMIT_MIB=${LIMIT_MIB:-60}
INIT=${INIT:-experiments/flagship/k1/drafter}
SEED=${SEED:-3}
git check-ignore -q $D/x || { echo "$D/ is not ignored by git: add the line /.device/ to" \
  ".gitignore (it must never be committed nor travel as an untracked file)" >&2; exit 1; }
case "$SEED" in [3-9]) ;; *) echo "SEED must be a new sampling seed 3-9 (0-2 made the" \
  "committed passes), not '$SEED'" >&2; exit 2 ;; esac
[ -e corpora/smollm2_t1_more_seed$SEED ] && { echo "corpora/smollm2_t1_more_seed$SEED" \
  "exists: its answers would not be new; pick another SEED" >&2; exit 1; }
[ -f $INIT/config.json ] || { echo "no drafter at $INIT" >&2; exit 1; }
GGUF=$(python -c "from dblast_jax.io.fetch import cached_path, lookup
print(cached_path(lookup('smollm2-135m-instruct')))")
[ -f "$GGUF" ] || { echo "$GGUF is missing: dblast fetch smollm2-135m-instruct" >&2; exit 1; }
mkdir -p $D/meta $D/data $D/wheels

echo "== drafter: $INIT -> $D/drafter"
rm -rf $D/drafter && cp -r $INIT $D/drafter

echo "== data: tokens-only copies (the device's trainer scores them with the live target)"
dblast data drop-scores corpora/smollm2_t1 --out $D/data/prompts_t1
dblast data drop-scores corpora/smollm2_t0 --out $D/data/greedy_t0
# PASSES (opt-in): committed sampled passes trained on beside the new answers, as ONE
# tokens-only merged folder, e.g. PASSES=".device/data/prompts_t1:0:68
# corpora/smollm2_t1_more:0:204 corpora/smollm2_t1_more_seed2:0:136" (pass 0 from the
# tokens-only copy: a scored source alone would keep its scores, 10x the bytes). Why: a GPU
# leg reads ~10^5 sequences; on 2,176 greedy + ~6,500 new answers that is ~15 reads of each,
# and a CPU leg memorised its pass at ~6 (research log 19). ~5 MiB more to carry.
rm -rf $D/data/passes
if [ -n "${PASSES:-}" ]; then
  dblast data merge --out $D/data/passes $PASSES --exclude-prompts-of corpora/smollm2_t1:68:72
fi
PASS_IDS=$(python -c '
import re, sys
ids = set()
for spec in sys.argv[1:]:  # pass ids as train_on_grown_corpus.sh numbers them
    folder, a, b = spec.rsplit(":", 2)
    name = folder.rstrip("/").rsplit("/", 1)[-1]
    if name in ("smollm2_t1", "prompts_t1"):
        ids.add(0)
        continue
    m = re.fullmatch(r"smollm2_t1_more(?:_seed(\d))?", name)
    if not m:
        sys.exit(f"PASSES: {spec} is not a sampled pass (smollm2_t1, smollm2_t1_more[_seedS])")
    s = int(m.group(1) or 1)
    ids.update(3 * (s - 1) + 1 + i // 68 for i in range(int(a), int(b)))
print(",".join(map(str, sorted(ids))))' ${PASSES:-})
python - <<EOF  # the copy's prompts are the originals': seed $SEED's corpus can resume here
from dblast_jax.data.regenerate import corpus_prompts
a, b = corpus_prompts("corpora/smollm2_t1", "0:68"), corpus_prompts("$D/data/prompts_t1", "0:68")
assert a == b and len(a) == 2176, "the tokens-only copy's prompts differ"
print(f"{len(a)} training prompts, identical in the copy")
EOF

echo "== wheels for Python 3.12 (what setup.py needs and the device image lacks)"
# install_requires against KINDS.md's list: grain (its array_record, portpicker), gguf and
# tensorboardX are missing there; tensorflow-datasets too, but only `dblast data tfds`
# imports it. jax there is 0.11.2 (setup.py asks <0.11): the package runs from the tree
# (PYTHONPATH), so pip never checks that.
WHEELS="grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 gguf==0.19.0 tensorboardX==2.6.5"
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d $D/wheels $WHEELS
ls $D/wheels
PY312=$(PYENV_VERSION=3.12.1 pyenv which python3.12 2> /dev/null || command -v python3.12 || true)
if [ -n "$PY312" ]; then  # they install for 3.12 (the device's python3), as there
  T=$(mktemp -d)
  $PY312 -m pip install -q --no-index --no-deps --no-compile --target $T $D/wheels/*.whl \
    && echo "wheels install with $($PY312 --version)" || { rm -rf $T; exit 1; }
  rm -rf $T
else
  echo "(no local python3.12: the wheels' install is checked on the device only)"
fi

echo "== sizes and the cut of the model"
mib() { python -c "print(f'{$1 / 2**20:.1f}')"; }
TREE=$(python $HERE/travel.py tree-size --patterns-file $HERE/sparse_patterns.txt \
  | python -c "import json, sys; print(json.load(sys.stdin)['bytes'])")
GZ=$(python -c "
import gzip, io, shutil
buf = io.BytesIO()
with open('$GGUF', 'rb') as f, gzip.GzipFile(fileobj=buf, mode='wb', compresslevel=1, mtime=0) as g:
    shutil.copyfileobj(f, g, 1 << 20)
print(len(buf.getvalue()))")
size() { python -c "import sys; sys.path.insert(0, '$HERE'); import travel
print(sum(travel.path_bytes(p) for p in sys.argv[1:]))" "$@"; }
CALL1=(.device/gguf.part1 .device/drafter)
CALL2=(.device/gguf.part2 .device/meta .device/wheels .device/data)
C1=$(( TREE + $(size .device/drafter) ))
C2=$(( TREE + $(size .device/wheels .device/data) + 8192 ))
CUT=$(python $HERE/travel.py balance $GZ $C1 $C2)
python $HERE/travel.py split "$GGUF" $D --first-bytes $CUT > /dev/null
mv $D/gguf.json $D/meta/gguf.json
CHAIN_AT=$(python -c "
import json, os
rows = [json.loads(l) for l in open('experiments/flagship/k1/legs.jsonl')] \
    if os.path.exists('experiments/flagship/k1/legs.jsonl') else []
print(2000 + sum(r['steps'] for r in rows), len(rows) + 1)")
read CHAIN_AT NEXT_LEG <<< "$CHAIN_AT"
python - <<EOF
import json, subprocess
g = json.load(open("$D/meta/gguf.json"))
meta = {"seed": $SEED, "drafter": "$INIT",
        "passes": [int(p) for p in "$PASS_IDS".split(",") if p], "next_leg": $NEXT_LEG, "chain_at": $CHAIN_AT,
        "chain_steps": int("${CHAIN_STEPS:-50000}"), "gguf_sha256": g["sha256"],
        "drafter_sha256": subprocess.run(["sha256sum", "$INIT/model.safetensors"],
                                         capture_output=True, text=True).stdout[:64],
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                 text=True).stdout.strip()}
json.dump(meta, open("$D/meta/manifest.json", "w"), indent=1)
EOF
S1=$(( TREE + $(size ${CALL1[@]}) ))
S2=$(( TREE + $(size ${CALL2[@]}) ))
LIMIT=$(( LIMIT_MIB * 1048576 ))
[ -d runs/flagship/k1_leg$NEXT_LEG ] && echo "NOTE: runs/flagship/k1_leg$NEXT_LEG exists: a CPU" \
  "leg $NEXT_LEG is under way; the device leg starts from $INIT as it is now (a sibling)."
cat <<EOF

== ready. The planned tree sends $(mib $TREE) MiB in each call; GGUF $(mib $GZ) MiB gzipped.
   call 1 would send $(mib $S1) MiB, call 2 $(mib $S2) MiB (limit $LIMIT_MIB MiB here, 64 MiB the tool's).

1. Shrink the checkout (no job may use it meanwhile; the helper refuses otherwise):
     bash $HERE/shrink_checkout.sh shrink

2. Call 1 (device tool run; nothing on the GPU yet, it only parks part 1 and the drafter):
     command: mkdir -p /tmp/dblast_device && cp -r .device/gguf.part1 .device/drafter /tmp/dblast_device/ && sha256sum /tmp/dblast_device/gguf.part1 && nvidia-smi -L
     carry:   $(printf '"%s" ' "${CALL1[@]}")
     timeout_s: 120

3. Call 2, AT ONCE after call 1 returns (the machine stays warm ~30 s; part 1 waits there):
     command: PYTHONUNBUFFERED=1 bash $HERE/run_on_accelerator.sh
     carry:   $(printf '"%s" ' "${CALL2[@]}")
     timeout_s: 600   (the script stops itself after BUDGET_S=520 s)

4. Restore the checkout at once (the same helper; then git status is as before):
     bash $HERE/shrink_checkout.sh restore

5. Unpack what came back (files_at of call 2) into the repository:
     python $HERE/unpack_results.py FILES_AT      # README.md says what it writes
EOF
[ $S1 -le $LIMIT ] && [ $S2 -le $LIMIT ] || { echo "a call would send over $LIMIT_MIB MiB:" \
  "shrink sparse_patterns.txt or carry less" >&2; exit 1; }
