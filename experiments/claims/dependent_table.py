"""The comparison table of experiments/claims/dependent_drafters.sh (issue 32), from the
per-variant results it commits, so that variants trained on different machines and days
are compared as if validated together.

Each finished variant leaves KEEP/NAME/training.json (steps, training CPU-s, the trunk's
sha256) and KEEP/NAME/validate_t{0.7,1.0,1.5}.json (`dblast validate` of that variant
alone). Every variant is scored on the same held-out batches and anchors (the batches
depend on the data, shards, seed and window, never on the other drafters), so the
per-batch numbers pair across files exactly as they would in one run: the gains over
the K = 1 control are paired by batch, each with its SE. Files whose settings or trunk
differ are refused, not mixed.

    python experiments/claims/dependent_table.py --keep=experiments/claims/dependent
"""

from __future__ import annotations

import json
import os
from typing import Any

from absl import app, flags

from dblast_jax.train.validation import validation_table

FLAGS = flags.FLAGS
flags.DEFINE_string("keep", "experiments/claims/dependent", "the committed results folder")
flags.DEFINE_list("variants", [], "variants in table order (default: every finished one)")
flags.DEFINE_string("baseline", "k1_control", "the variant the gains are paired against "
                    "(left out of the gain columns when it has not finished)")

VERIFY_TEMPERATURES = ("0.7", "1.0", "1.5")
# settings of `dblast validate` that name the drafters or the output, not the target and
# batches they are scored on
_PER_DRAFTER = ("drafter", "out", "baseline", "debug")


def finished_variants(keep: str) -> list[str]:
    """Variants with a training record and all three validations, sorted by name."""
    if not os.path.isdir(keep):
        return []
    return sorted(v for v in os.listdir(keep) if _finished(keep, v))


def _finished(keep: str, variant: str) -> bool:
    folder = os.path.join(keep, variant)
    return all(os.path.exists(os.path.join(folder, f)) for f in
               ["training.json"] + [f"validate_t{t}.json" for t in VERIFY_TEMPERATURES])


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable ({e})") from None


def comparison(keep: str, variants: list[str], baseline: str) -> str:
    """Markdown: the training cost of each variant, then one paired table per T_v."""
    variants = variants or finished_variants(keep)
    missing = [v for v in variants if not _finished(keep, v)]
    if missing:
        raise ValueError(f"not finished in {keep}: {missing} (training.json and "
                         f"validate_t{{{','.join(VERIFY_TEMPERATURES)}}}.json each)")
    if not variants:
        raise ValueError(f"no finished variant in {keep}")
    training = {v: _read(os.path.join(keep, v, "training.json")) for v in variants}
    trunks = {t["trunk_sha256"] for t in training.values()}
    if len(trunks) > 1:
        raise ValueError(f"{keep}: variants trained from different trunks "
                         f"({ {v: t['trunk_sha256'][:12] for v, t in training.items()} }): "
                         "their gains would not be paired")
    lines = ["| variant | steps | training CPU-s | trunk |", "|---|---|---|---|"]
    for v, t in training.items():
        lines.append(f"| {v} | {t['steps']:,} | {t['cpu_s']:,.0f} | {t['trunk']} |")
    base = baseline if baseline in variants else None
    for temp in VERIFY_TEMPERATURES:
        results, settings = {}, None
        for v in variants:
            path = os.path.join(keep, v, f"validate_t{temp}.json")
            record = _read(path)
            if v not in record.get("results", {}):
                raise ValueError(f"{path}: holds no results for {v!r}")
            batches = {k: x for k, x in record.get("settings", {}).items()
                       if k not in _PER_DRAFTER}
            if settings is not None and batches != settings:
                diff = sorted(k for k in set(batches) | set(settings)
                              if batches.get(k) != settings.get(k))
                raise ValueError(f"{path}: validated on other batches than "
                                 f"{variants[0]} (settings differ: {diff})")
            settings = batches
            results[v] = record["results"][v]
        lines += ["", f"T_v = {temp} ({settings.get('data')} shards "
                  f"{settings.get('shards')}, {settings.get('batches')} batches):", "",
                  validation_table(results, base)]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    del argv
    try:
        table = comparison(FLAGS.keep, FLAGS.variants, FLAGS.baseline)
    except ValueError as e:  # a missing, unreadable or unpairable result: one line
        raise SystemExit(f"dependent_table.py: {e}") from None
    path = os.path.join(FLAGS.keep, "table.md")
    with open(path + ".tmp", "w") as f:
        f.write(table)
    os.replace(path + ".tmp", path)
    print(table, end="")
    print(f"written to {path}")


if __name__ == "__main__":
    app.run(main)
