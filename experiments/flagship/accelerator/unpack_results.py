"""Put what run_on_accelerator.sh sent back into the repository: the new answers as the
corpus folder of their sampling seed, and the trained drafter as the chain's next leg.

    python experiments/flagship/accelerator/unpack_results.py FILES_AT
    python experiments/flagship/accelerator/unpack_results.py FILES_AT --no_leg  # corpus only

- corpus_seedS.tar.gz (+ _2) -> corpora/smollm2_t1_more_seedS: a corpus folder like the
  ones grow_sampled_corpus.sh grows (same settings but the batch, 32), each shard checked
  against the manifest; `SEED=S BATCH=32 bash experiments/flagship/grow_sampled_corpus.sh`
  grows it on. train_on_grown_corpus.sh takes its passes once 68 shards are there.
- drafter.tar, train_curve.jsonl -> KEEP/drafter, KEEP/curve_legN.jsonl and a row of
  KEEP/legs.jsonl as finish_leg.py writes them (plus device, batch size, wall seconds), then
  the learning curve redrawn. Refused when KEEP/drafter is no longer the drafter the
  device leg started from (a CPU leg finished meanwhile): --no_leg keeps the corpus only.
  The row's data names the passes the leg read (..._t1passP), so the pass rotation counts
  them, and its steps count in the chain's schedule (train_k1.sh: CHAIN_AT).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "budget"))
sys.path.insert(0, os.path.join(HERE, ".."))
from curve_file import read_curve  # noqa: E402

from dblast_jax.io.fetch import sha256_file  # noqa: E402

METRICS = ("al_estimate", "al_estimate_mixture", "top1", "greedy_accepted", "block_nll")


def unpack_corpus(files: str, stem: str, dest: str) -> dict:
    """The corpus archives into `dest` (absent or empty), every shard's sha256 checked."""
    archives = sorted(n for n in os.listdir(files) if n == f"{stem}.tar.gz"
                      or (n.startswith(f"{stem}_") and n.endswith(".tar.gz")))
    if not archives:
        raise SystemExit(f"no {stem}.tar.gz in {files}")
    if os.path.exists(dest) and os.listdir(dest):
        raise SystemExit(f"{dest} exists and is not empty: not overwritten")
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(dest)))
    for name in archives:
        with tarfile.open(os.path.join(files, name)) as tar:
            for member in tar.getmembers():  # flat files only: nothing outside dest
                if not member.isfile() or "/" in member.name or member.name.startswith("."):
                    raise SystemExit(f"{name}: unexpected member {member.name!r}")
            tar.extractall(tmp)
    manifest = json.load(open(os.path.join(tmp, "manifest.json")))
    for e in manifest["shards"]:
        if sha256_file(os.path.join(tmp, e["file"])) != e["sha256"]:
            raise SystemExit(f"shard {e['file']} does not match its manifest's sha256")
    if os.path.exists(dest):
        os.rmdir(dest)
    os.replace(tmp, dest)
    return manifest


def check_leg(files: str, summary: dict, keep: str) -> tuple[dict, int, list[dict]]:
    """(where the leg started, its number in KEEP, its curve rows), or SystemExit when it
    cannot be KEEP's next leg; checked before anything is written."""
    start = summary["started_from"]
    leg = len(read_curve(os.path.join(keep, "legs.jsonl"))) + 1
    current = sha256_file(os.path.join(keep, "drafter", "model.safetensors"))
    if current != start["drafter_sha256"] or leg != start["next_leg"]:
        raise SystemExit(f"{keep}/drafter is no longer the drafter the device leg started "
                         f"from (leg {leg} would follow; it started before leg "
                         f"{start['next_leg']}): not recorded (--no_leg keeps the corpus)")
    rows = read_curve(os.path.join(files, "train_curve.jsonl"))
    if not summary.get("train") or not rows or rows[-1]["step"] != summary["train"]["steps"]:
        raise SystemExit("train_curve.jsonl does not end at the leg's last step")
    return start, leg, rows


def record_leg(files: str, summary: dict, keep: str, corpus: dict) -> dict:
    """The device leg as KEEP's next leg (finish_leg.py's files and row)."""
    start, leg, rows = check_leg(files, summary, keep)
    train = summary["train"]
    tmp = tempfile.mkdtemp(dir=keep)
    with tarfile.open(os.path.join(files, "drafter.tar")) as tar:
        names = {m.name.removeprefix("./") for m in tar.getmembers() if m.isfile()}
        if not {"config.json", "model.safetensors"} <= names:
            raise SystemExit(f"drafter.tar holds {sorted(names)}, not an export")
        tar.extractall(tmp)
    seed, shards = summary["seed"], len(corpus["shards"])
    passes = sorted({3 * (seed - 1) + 1 + i // 68 for i in range(shards)}
                    | set(start.get("passes") or ()))
    data = "runs/corpora/smollm2_t0_t1pass" + "_".join(map(str, passes)) if passes \
        else "corpora/smollm2_t0"
    settings = train.get("settings", {})
    keep_keys = lambda row: {k: row[k] for k in row if k.rsplit("/", 1)[-1] in METRICS}
    record = {"leg": leg, "init": start["drafter"], "steps": train["steps"], "data": data,
              "data_shards": 0, "seq_len": settings.get("seq_len", 384), "drafter_layers": 1,
              "k": 1, **{k: settings[k] for k in ("schedule_steps", "schedule_offset",
                                                  "learning_rate") if settings.get(k)},
              "training_cpu_s": rows[-1]["cpu_s"], "start": keep_keys(rows[0]),
              "end": keep_keys(rows[-1]),
              "finished": time.strftime("%Y-%m-%d", time.gmtime(rows[-1]["time"])),
              "device": summary["device"], "batch_size": settings.get("batch_size"),
              "wall_s": rows[-1].get("wall_s"), "new_answers_seed": seed,
              "new_answer_shards": shards}
    drafter = os.path.join(keep, "drafter")
    for name in ("config.json", "model.safetensors"):
        os.replace(os.path.join(tmp, name), os.path.join(drafter, name))
    shutil.rmtree(tmp)
    with open(os.path.join(keep, f"curve_leg{leg}.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    with open(os.path.join(keep, "legs.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"leg {leg}: held-out AL {record['start'].get('al_estimate'):.4f} -> "
          f"{record['end'].get('al_estimate'):.4f}; recorded in {keep}/legs.jsonl")
    # finish_leg.py in its own process: importing it here would define its absl flags in
    # whatever process imports this module (a test run that also loads finish_leg.py)
    subprocess.run([sys.executable, os.path.join(HERE, "..", "finish_leg.py"), f"--keep={keep}",
                    "--plot_only", "--prior_cpu_s=2100"], check=True)
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", help="the folder call 2's files came back into (files_at)")
    p.add_argument("--corpus_out", default="", help="default corpora/smollm2_t1_more_seedS")
    p.add_argument("--keep", default="experiments/flagship/k1")
    p.add_argument("--no_leg", action="store_true", help="unpack the corpus only")
    p.add_argument("--allow_dry_run", action="store_true", help="(tests) a DRY_RUN's files")
    a = p.parse_args(argv)
    summary = json.load(open(os.path.join(a.files, "summary.json")))
    if summary["dry_run"] and not a.allow_dry_run:
        raise SystemExit("these are a DRY_RUN's files (toy sizes): not unpacked")
    stem = "corpus_dry" if summary["dry_run"] else f"corpus_seed{summary['seed']}"
    dest = a.corpus_out or f"corpora/smollm2_t1_more_seed{summary['seed']}"
    if not a.no_leg:
        check_leg(a.files, summary, a.keep)
    corpus = unpack_corpus(a.files, stem, dest)
    print(f"{dest}: {len(corpus['shards'])} shards of {corpus['num_shards']} "
          f"({corpus['totals']['sequences']} answers)")
    if not a.no_leg:
        record_leg(a.files, summary, a.keep, corpus)
    return 0


if __name__ == "__main__":
    sys.exit(main())
