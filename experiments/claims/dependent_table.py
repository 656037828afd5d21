"""The comparison table of experiments/claims/dependent_drafters.sh (issue 32), from the
per-variant results it commits, so that variants trained on different machines and days
are compared as if validated together.

Each finished variant leaves KEEP/NAME/training.json (steps, training CPU-s, the trunk's
sha256), KEEP/NAME/validate_t{0.7,1.0,1.5}.json (`dblast validate` of that variant
alone) and KEEP/NAME/bench_t{0.7,1.5}.json (`dblast eval` of it alone on the benchmarks). Every variant is scored on the same held-out batches and anchors (the batches
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
BENCH_TEMPERATURES = ("0.7", "1.5")  # `dblast eval` of each variant alone, batch 1
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
               ["training.json"] + [f"validate_t{t}.json" for t in VERIFY_TEMPERATURES]
               + [f"bench_t{t}.json" for t in BENCH_TEMPERATURES])


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable ({e})") from None


def _same_settings(path: str, mine: dict, first: dict | None, what: str) -> dict:
    """`mine`, once it equals the first file's settings (None: this is the first); else
    a one-line error naming `path` and the keys that differ."""
    if first is not None and mine != first:
        diff = sorted(k for k in set(mine) | set(first) if mine.get(k) != first.get(k))
        raise ValueError(f"{path}: {what}: {diff})")
    return mine


def comparison(keep: str, variants: list[str], baseline: str) -> str:
    """Markdown: the training cost of each variant, then one paired table per T_v."""
    variants = variants or finished_variants(keep)
    missing = [v for v in variants if not _finished(keep, v)]
    if missing:
        raise ValueError(f"not finished in {keep}: {missing} (training.json, "
                         f"validate_t{{{','.join(VERIFY_TEMPERATURES)}}}.json and "
                         f"bench_t{{{','.join(BENCH_TEMPERATURES)}}}.json each)")
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
            settings = _same_settings(path, batches, settings, "validated on other batches "
                                      f"than {variants[0]} (settings differ")
            results[v] = record["results"][v]
        lines += ["", f"T_v = {temp} ({settings.get('data')} shards "
                  f"{settings.get('shards')}, {settings.get('batches')} batches):", "",
                  validation_table(results, base)]
    lines += ["", benchmark_table(keep, variants, base)]
    return "\n".join(lines) + "\n"


# `dblast eval` settings that name the drafters, not the prompts and decoding they share
_PER_EVAL = ("drafters", "method_settings", "verify_mode", "temperatures")


def _bench_cell(path: str, record: dict[str, Any], variant: str, temp: str) -> dict:
    """Macro tau, its SE and the speedup of `variant` at `temp`; ms per speculative step
    and per plain token pooled over the four benchmarks."""
    column = f"macro@T{float(temp)}"
    try:
        macro = {m: next(r for r in record["tables"][m]["rows"]
                         if r["drafter"] == variant)[column]
                 for m in ("tau", "tau_se", "speedup")}
        cells = [c for c in record["cells"] if c["temperature"] == float(temp)]
        mine = [c for c in cells if c["method"] == variant]
        plain = [c for c in cells if c["method"] == "plain"]
        step_ms = 1e3 * sum(c["seconds"] for c in mine) / sum(c["steps"] for c in mine)
        plain_ms = 1e3 * sum(c["seconds"] for c in plain) / sum(c["new_tokens"] for c in plain)
    except (KeyError, StopIteration, TypeError, ZeroDivisionError):
        raise ValueError(f"{path}: holds no T = {temp} benchmark results for {variant!r}"
                         ) from None
    return {**macro, "step_ms": step_ms, "plain_ms": plain_ms}


def _ratio(a: float, sa: float, b: float, sb: float) -> str:
    """100 (a / b - 1) with the SE of two independent estimates (delta method)."""
    r = a / b
    return f"{100 * (r - 1):+.1f}% ± {100 * r * ((sa / a) ** 2 + (sb / b) ** 2) ** 0.5:.1f}%"


def benchmark_table(keep: str, variants: list[str], base: str | None) -> str:
    """Markdown: macro tau (± SE), speed and the cost of a step on the four benchmarks at
    each T, every variant run alone with plain decoding beside it. Runs on other prompts
    or decoding settings are refused; tau gains over `base` are unpaired (other runs)."""
    cells, settings = {}, None
    for v in variants:
        for temp in BENCH_TEMPERATURES:
            path = os.path.join(keep, v, f"bench_t{temp}.json")
            record = _read(path)
            shared = {k: x for k, x in record.get("meta", {}).items() if k not in _PER_EVAL}
            shared["prompts_per_benchmark"] = sorted(  # not in meta: from the plain cells
                {c.get("prompts") for c in record.get("cells", [])
                 if c.get("method") == "plain"})
            settings = _same_settings(path, shared, settings, "benchmarked on other prompts "
                                      f"or settings than {variants[0]} (differ")
            cells[v, temp] = _bench_cell(path, record, v, temp)
    head = "| variant |"
    rule = "|---|"
    for temp in BENCH_TEMPERATURES:
        head += (f" tau T = {temp} | speed T = {temp} | ms / step T = {temp} |"
                 + (f" tau gain vs {base} T = {temp} |" if base else ""))
        rule += "---|---|---|" + ("---|" if base else "")
    lines = [f"Benchmarks ({', '.join(settings.get('benchmarks', []))}; "
             f"{'/'.join(map(str, settings['prompts_per_benchmark']))} prompts each, "
             f"{settings.get('max_new_tokens')} new tokens, batch "
             f"{settings.get('batch_size')}; macro tau ± SE, speed = tokens/s over plain "
             "decoding in the same run, ms per speculative step; plain decoding ms per "
             "token in brackets):", "", head, rule]
    for v in variants:
        row = f"| {v} |"
        for temp in BENCH_TEMPERATURES:
            c = cells[v, temp]
            row += (f" {c['tau']:.3f} ± {c['tau_se']:.3f} | {c['speedup']:.2f}x | "
                    f"{c['step_ms']:.0f} ({c['plain_ms']:.0f}) |")
            if base:
                b = cells[base, temp]
                row += " — |" if v == base else (
                    f" {_ratio(c['tau'], c['tau_se'], b['tau'], b['tau_se'])} |")
        lines.append(row)
    return "\n".join(lines)


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
