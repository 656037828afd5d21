"""Evaluation: tau and speedup per (drafter, benchmark, temperature), tables and plots.

Two layers:

* Pure maths on plain rows (numpy only): `pool_rows`, `aggregate`, `build_table`,
  `table_markdown` / `table_csv`. A *row* is one finished unit of work (one prompt, or
  one batch of prompts when `batch_size > 1`) for one method ("plain" or a drafter name)
  on one benchmark at one temperature.
* `run_evaluation`, which produces the rows with `generate` / `speculative_generate`,
  appends each to `rows.jsonl` as soon as it finishes (so a rerun skips finished work)
  and writes results.json / .csv / .md, PNG plots and the same numbers as TensorBoard
  scalars (`write_scalar_summary`, out_dir/tensorboard) at the end. Several processes
  (one per host) share the units of work out; see `run_evaluation`.

Pooling convention: a cell's tau is total emitted tokens per step over all its steps,
sum_steps (accepted + 1) / n_steps, i.e. prompts are weighted by their number of steps
(a long answer counts more than a short one), which is what tokens per target pass
means. The expected tau is pooled the same way. The macro average is the unweighted
mean of the per-benchmark cell taus (every benchmark counts the same).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import zlib
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from dblast_jax import generation
from dblast_jax.config import SamplingConfig
from dblast_jax.data.sources import Prompt, load_prompts
from dblast_jax.data.templates import benchmark_turns, chat_messages
from dblast_jax.distributed import barrier, setup_error
from dblast_jax.io import paths
from dblast_jax.io.atomic import atomic_write_text
from dblast_jax.io.output_folder import check_output_folder
from dblast_jax.workdir_lock import FolderLock

__all__ = ["PLAIN", "pool_rows", "aggregate", "per_position_from_histogram", "macro_average",
           "relative_gain", "build_table", "table_markdown", "table_csv", "write_tables",
           "write_plots", "write_scalar_summary", "run_evaluation", "temperature_key"]

PLAIN = "plain"  # method name of the plain-decoding rows (reserved; no drafter may use it)


def temperature_key(t: float) -> str:
    """Stable text form of a temperature (JSONL keys, column names): 0.7 -> '0.7'."""
    return repr(float(t))


# ---- pure maths ----------------------------------------------------------------------------

def per_position_from_histogram(histogram: Sequence[int]) -> list[Optional[float]]:
    """P(draft i accepted | drafts 1..i-1 accepted), i = 1..b-1, from counts of accepted.

    `histogram[k]` = number of steps that accepted exactly k drafts (k = 0..b-1). Position
    i was reached by steps with >= i-1 accepted and passed by those with >= i; None where
    no step reached it.
    """
    h = np.asarray(histogram, dtype=np.int64)
    at_least = np.cumsum(h[::-1])[::-1]  # at_least[k] = #steps with accepted >= k
    out = []
    for i in range(1, len(h)):
        reached, passed = int(at_least[i - 1]), int(at_least[i])
        out.append(passed / reached if reached else None)
    return out


def _add_hist(a: Sequence[int], b: Sequence[int]) -> list[int]:
    n = max(len(a), len(b))
    return [int((a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0)) for i in range(n)]


def histogram_standard_error(histogram: Sequence[int]) -> Optional[float]:
    """Standard error of tau from the accepted-count histogram (steps treated as
    independent draws: a lower bound when steps within an answer are correlated). Two
    drafters whose tau differ by less than ~2 combined SEs are not told apart."""
    h = np.asarray(histogram, np.float64)
    n = h.sum()
    if n < 2:
        return None
    k = np.arange(h.size)
    mean = (h * k).sum() / n
    var = (h * (k - mean) ** 2).sum() / (n - 1)
    return float(np.sqrt(var / n))


def pool_rows(rows: Iterable[Mapping[str, Any]]) -> dict:
    """Pool rows of one cell: step-weighted tau / expected tau, summed histogram and timing.

    Plain rows carry no steps; their tau fields stay None.
    """
    steps = 0
    tau_sum = 0.0
    exp_sum = 0.0
    hist: list[int] = []
    new_tokens = 0
    seconds = 0.0
    prompts = 0
    for row in rows:
        prompts += len(row.get("prompt_ids", ())) or 1
        new_tokens += int(row.get("new_tokens", 0))
        seconds += float(row.get("seconds", 0.0))
        n = int(row.get("steps") or 0)
        if n:
            steps += n
            tau_sum += float(row["tau"]) * n
            exp_sum += float(row["tau_expected"]) * n
            hist = _add_hist(hist, row.get("histogram") or [])
    return {
        "prompts": prompts,
        "steps": steps,
        "tau": tau_sum / steps if steps else None,
        "tau_expected": exp_sum / steps if steps else None,
        "tau_se": histogram_standard_error(hist),
        "histogram": hist,
        "per_position_acceptance": per_position_from_histogram(hist) if hist else [],
        "new_tokens": new_tokens,
        "seconds": seconds,
        "tokens_per_s": new_tokens / seconds if seconds > 0 else None,
    }


def aggregate(rows: Iterable[Mapping[str, Any]]) -> list[dict]:
    """Cells, one per (method, benchmark, temperature), with speedup vs the plain cell.

    speedup = tokens/s of the method / tokens/s of plain decoding on the same benchmark
    and temperature (None when that plain cell is missing, and for plain itself = 1.0).
    """
    groups: dict[tuple, list] = {}
    for row in rows:
        key = (row["method"], row["benchmark"], float(row["temperature"]))
        groups.setdefault(key, []).append(row)
    cells = {}
    for (method, bench, temp), group in groups.items():
        cell = {"method": method, "benchmark": bench, "temperature": temp}
        cell.update(pool_rows(group))
        cells[(method, bench, temp)] = cell
    for (method, bench, temp), cell in cells.items():
        plain = cells.get((PLAIN, bench, temp))
        base = plain["tokens_per_s"] if plain else None
        own = cell["tokens_per_s"]
        cell["speedup"] = own / base if (own is not None and base) else None
    return [cells[k] for k in sorted(cells, key=lambda k: (k[1], k[2], k[0] != PLAIN, k[0]))]


def macro_average(values: Sequence[Optional[float]]) -> Optional[float]:
    """Unweighted mean over benchmarks; None if any benchmark is missing (no partial macro)."""
    if not values or any(v is None or (isinstance(v, float) and math.isnan(v)) for v in values):
        return None
    return float(np.mean(values))


def relative_gain(value: Optional[float], base: Optional[float]) -> Optional[float]:
    """(value / base - 1) * 100, in percent; None when either is missing or base is 0."""
    if value is None or base is None or base == 0:
        return None
    return (value / base - 1.0) * 100.0


def build_table(cells: Sequence[Mapping[str, Any]], baseline: Optional[str] = None,
                metric: str = "tau") -> dict:
    """Rows = drafters, columns = benchmark@T for each benchmark x temperature, then
    macro@T per temperature and (with a baseline) gain@T = relative macro gain in %.

    Returns {"metric", "baseline", "columns", "rows": [{"drafter", col: value, ...}]}.
    """
    drafters = sorted({c["method"] for c in cells if c["method"] != PLAIN})
    benchmarks = sorted({c["benchmark"] for c in cells})
    temps = sorted({float(c["temperature"]) for c in cells})
    if baseline is not None and baseline not in drafters:
        raise ValueError(f"baseline {baseline!r} is not among the drafters {drafters}")
    lookup = {(c["method"], c["benchmark"], float(c["temperature"])): c.get(metric)
              for c in cells}
    columns = [f"{b}@T{temperature_key(t)}" for b in benchmarks for t in temps]
    columns += [f"macro@T{temperature_key(t)}" for t in temps]
    if baseline is not None:
        columns += [f"gain@T{temperature_key(t)}" for t in temps]

    if metric == "tau_se":  # the SE of a macro average combines in quadrature, no gains
        baseline = None
        columns = [c for c in columns if not c.startswith("gain@")]

    def macro(d, t):
        values = [lookup.get((d, b, t)) for b in benchmarks]
        if metric == "tau_se":
            return (None if any(v is None for v in values) or not values
                    else math.sqrt(sum(v * v for v in values)) / len(values))
        return macro_average(values)

    rows = []
    for d in drafters:
        row: dict[str, Any] = {"drafter": d}
        for b in benchmarks:
            for t in temps:
                row[f"{b}@T{temperature_key(t)}"] = lookup.get((d, b, t))
        for t in temps:
            row[f"macro@T{temperature_key(t)}"] = macro(d, t)
        if baseline is not None:
            for t in temps:
                row[f"gain@T{temperature_key(t)}"] = relative_gain(macro(d, t), macro(baseline, t))
        rows.append(row)
    return {"metric": metric, "baseline": baseline, "columns": columns, "rows": rows}


def best_block_table(cells: Sequence[Mapping[str, Any]],
                     families: Mapping[str, Mapping[int, str]]) -> dict:
    """Per drafter (a family of one drafter evaluated at several blocks) and temperature:
    the block whose macro speedup over plain decoding was highest in this run, on this
    machine (the verify pass's cost per token differs between machines, so does the best
    block), with that speedup."""
    speed = {r["drafter"]: r for r in build_table(cells, None, "speedup")["rows"]}
    temps = sorted({float(c["temperature"]) for c in cells})
    columns = [f"{kind}@T{temperature_key(t)}" for t in temps
               for kind in ("best_block", "speedup")]
    rows = []
    for family, blocks in sorted(families.items()):
        row: dict[str, Any] = {"drafter": family}
        for t in temps:
            col = f"macro@T{temperature_key(t)}"
            scored = [(speed[m][col], int(b)) for b, m in blocks.items()
                      if m in speed and speed[m].get(col) is not None]
            if scored:
                value, block = max(scored)
                row[f"best_block@T{temperature_key(t)}"] = block
                row[f"speedup@T{temperature_key(t)}"] = value
        rows.append(row)
    return {"metric": "best_block", "baseline": None, "columns": columns, "rows": rows}


def _fmt(value: Any, column: str) -> str:
    if value is None:
        return "-"
    if column.startswith("gain@"):
        return f"{value:+.1f}%"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def table_markdown(table: Mapping[str, Any]) -> str:
    cols = ["drafter"] + list(table["columns"])
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for row in table["rows"]:
        lines.append("| " + " | ".join(_fmt(row.get(c), c) if c != "drafter" else row[c]
                                       for c in cols) + " |")
    return "\n".join(lines) + "\n"


def table_csv(table: Mapping[str, Any]) -> str:
    """CSV with raw numbers (empty cell = missing); gains in percent."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    cols = ["drafter"] + list(table["columns"])
    writer.writerow(cols)
    for row in table["rows"]:
        writer.writerow(["" if row.get(c) is None else row.get(c) for c in cols])
    return buf.getvalue()


def _local_out(out_dir: str | Path) -> Path:
    """The evaluation output folder as a local Path; an object-store URI (gs://...) is
    refused (rows are appended to, plots saved with matplotlib, event files streamed: all
    plain files). A gcsfuse mount is a local folder and works."""
    if not paths.is_local(out_dir):
        raise ValueError(f"evaluation output must be a local or fuse-mounted folder, got "
                         f"{str(out_dir)!r}")
    return Path(out_dir)


def write_tables(cells: Sequence[Mapping[str, Any]], out_dir: str | Path,
                 baseline: Optional[str] = None, meta: Optional[Mapping[str, Any]] = None) -> dict:
    """results.json (cells + tau / tau SE / expected-tau / speedup tables), results.csv
    (tau table), results.md (the tables as markdown). Returns the JSON object."""
    out = _local_out(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tables = {m: build_table(cells, baseline, m)
              for m in ("tau", "tau_se", "tau_expected", "speedup")}
    families = (meta or {}).get("block_families")
    if families:
        tables["best_block"] = best_block_table(cells, families)
    result = {"meta": dict(meta or {}), "baseline": baseline, "cells": list(cells),
              "tables": tables}
    (out / "results.json").write_text(json.dumps(result, indent=1, sort_keys=True))
    (out / "results.csv").write_text(table_csv(tables["tau"]))
    titles = {"tau": "Acceptance length tau (accepted + 1 per step, step-weighted)",
              "tau_se": "Standard error of tau (from the accepted-count histograms; macro: "
                        "combined in quadrature)",
              "tau_expected": "Expected tau (exact expectation of the same drafts)",
              "speedup": "Speedup vs plain decoding (tokens/s ratio)",
              "best_block": "The block with the most tokens/s per drafter (macro speedup "
                            "over plain decoding, this machine)"}
    md = []
    for m, table in tables.items():
        md += [f"## {titles[m]}\n", table_markdown(table)]
    if baseline is not None:
        md.append(f"\ngain@T = (macro / macro of `{baseline}` - 1) x 100, in %.\n")
    plain = [c for c in cells if c["method"] == PLAIN]
    if plain:
        md.append("\n## Plain decoding tokens/s\n")
        md += [f"- {c['benchmark']} @T{temperature_key(c['temperature'])}: "
               f"{_fmt(c.get('tokens_per_s'), '')}\n" for c in plain]
    (out / "results.md").write_text("\n".join(md))
    return result


# ---- plots ---------------------------------------------------------------------------------

def write_plots(cells: Sequence[Mapping[str, Any]], out_dir: str | Path) -> list[Path]:
    """tau_vs_temperature.png, acceptance_histograms.png, per_position_acceptance.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = _local_out(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = [c for c in cells if c["method"] != PLAIN and c.get("steps")]
    benchmarks = sorted({c["benchmark"] for c in spec})
    temps = sorted({float(c["temperature"]) for c in spec})
    drafters = sorted({c["method"] for c in spec})
    if not spec:
        return []
    by = {(c["method"], c["benchmark"], float(c["temperature"])): c for c in spec}
    paths = []

    fig, axes = plt.subplots(1, len(benchmarks), figsize=(4 * len(benchmarks), 3.2),
                             squeeze=False)
    for ax, b in zip(axes[0], benchmarks):
        for d in drafters:
            pts = [(t, by[(d, b, t)]["tau"]) for t in temps if (d, b, t) in by]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=d)
        ax.set_title(b)
        ax.set_xlabel("temperature")
        ax.set_ylabel("tau")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "tau_vs_temperature.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    for name, ylabel in (("acceptance_histograms", "fraction of steps"),
                         ("per_position_acceptance", "P(accept | reached)")):
        fig, axes = plt.subplots(len(benchmarks), len(temps),
                                 figsize=(3.6 * len(temps), 2.8 * len(benchmarks)),
                                 squeeze=False)
        for i, b in enumerate(benchmarks):
            for j, t in enumerate(temps):
                ax = axes[i][j]
                width = 0.8 / max(len(drafters), 1)
                for k, d in enumerate(drafters):
                    cell = by.get((d, b, t))
                    if cell is None:
                        continue
                    if name == "acceptance_histograms":
                        h = np.asarray(cell["histogram"], float)
                        x = np.arange(len(h)) + (k - (len(drafters) - 1) / 2) * width
                        ax.bar(x, h / max(h.sum(), 1), width=width, label=d)
                        ax.set_xlabel("accepted drafts")
                    else:
                        pp = [np.nan if v is None else v for v in cell["per_position_acceptance"]]
                        ax.plot(np.arange(1, len(pp) + 1), pp, marker="o", label=d)
                        ax.set_xlabel("draft position")
                ax.set_title(f"{b} @T{temperature_key(t)}", fontsize=9)
                ax.set_ylabel(ylabel, fontsize=8)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / f"{name}.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def write_scalar_summary(result: Mapping[str, Any], out_dir: str | Path) -> Path:
    """The numbers of `write_tables`' result as TensorBoard scalars in out_dir/tensorboard
    (`tensorboard --logdir OUT/tensorboard`), all at step 0 (an evaluation has no step):
    per cell `METRIC/METHOD/BENCHMARK/T<t>` for tau, tau_expected, tau_se, speedup and
    tokens_per_s, per drafter `METRIC/DRAFTER/macro/T<t>` (and `.../gain/T<t>` against
    the baseline); TensorBoard turns characters outside [A-Za-z0-9_.-/] into `_`. A
    rerun replaces the folder's event files, so each tag holds one value; a rerun with
    the same numbers (a resumed evaluation that had nothing left to run) leaves the event
    file as it is, so committed results do not change for nothing."""
    # startup: dblast_jax.train pulls in grain and orbax (the table maths need neither)
    from dblast_jax.train.metric_writers import TENSORBOARD_DIR, TensorBoardWriter
    logdir = _local_out(out_dir) / TENSORBOARD_DIR
    scalars: dict[str, Any] = {}
    for c in result.get("cells", ()):
        cell = f"{c['method']}/{c['benchmark']}/T{temperature_key(c['temperature'])}"
        for key in ("tau", "tau_expected", "tau_se", "speedup", "tokens_per_s"):
            scalars[f"{key}/{cell}"] = c.get(key)
    for metric, table in result.get("tables", {}).items():
        for row in table["rows"]:
            for col in table["columns"]:
                if col.startswith(("macro@", "gain@")):
                    tag = f"{metric}/{row['drafter']}/{col.replace('@', '/')}"
                    scalars[tag] = row.get(col)
    digest = hashlib.sha256(json.dumps(scalars, sort_keys=True, default=float)
                            .encode()).hexdigest()
    stamp = logdir / _SCALARS_DIGEST
    if (logdir.is_dir() and any(logdir.glob("events.out.tfevents.*")) and stamp.is_file()
            and stamp.read_text().strip() == digest):
        return logdir  # the same numbers: keep the event file
    writer = TensorBoardWriter(str(logdir))
    if writer.primary and logdir.is_dir():
        for old in logdir.glob("events.out.tfevents.*"):
            old.unlink()
    with writer:
        writer.write_scalars(0, scalars)  # None (a missing cell) is skipped
    if writer.primary:
        atomic_write_text(stamp, digest + "\n")
    return logdir


_SCALARS_DIGEST = ".scalars.sha256"  # what the event file holds (see write_scalar_summary)


# ---- running -------------------------------------------------------------------------------

def _items_from_benchmark(name: str, limit: Optional[int]) -> list[tuple[str, Any]]:
    prompts = load_prompts(name)
    return [(p.id, p) for p in (prompts[:limit] if limit else prompts)]


def _items_from_set(items: Sequence[Any], limit: Optional[int]) -> list[tuple[str, Any]]:
    items = list(items[:limit] if limit else items)
    return [(it.id if isinstance(it, Prompt) else str(i), it) for i, it in enumerate(items)]


def _turn_inputs(item: Any, answers: Sequence[str]) -> Any:
    """What to pass to generate for the next turn of `item` (a Prompt is templated)."""
    if isinstance(item, Prompt):
        return chat_messages(benchmark_turns(item), answers=answers)
    return item  # a message list or a token list: single turn


def _num_turns(item: Any) -> int:
    return len(benchmark_turns(item)) if isinstance(item, Prompt) else 1


def _merge_turn_stats(stats: Sequence[Mapping[str, Any]]) -> dict:
    pooled = pool_rows(dict(s, new_tokens=0, seconds=0.0) for s in stats)
    return {k: pooled[k] for k in ("steps", "tau", "tau_expected", "histogram")}


def _seed_for(seed: int, benchmark: str, temperature: float, prompt_ids: Sequence[str]) -> int:
    """Same key for every method on the same prompts (plain and drafters share it)."""
    text = f"{seed}|{benchmark}|{temperature_key(temperature)}|{','.join(prompt_ids)}"
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def _run_unit(target, drafter, items: Sequence[Any], sampling, rng_seed: int,
              warmup: bool) -> dict:
    """Generate every turn of a batch of items; one row's worth of numbers."""
    answers: list[list[str]] = [[] for _ in items]
    turns = max(_num_turns(it) for it in items)
    if turns > 1 and target.tokenizer is None:
        raise ValueError("multi-turn prompts need a target with a tokenizer (the first "
                         "answer is fed back as text)")
    seconds, new_tokens, stats = 0.0, 0, []
    for turn in range(turns):
        active = [i for i, it in enumerate(items) if _num_turns(it) > turn]
        inputs = [_turn_inputs(items[i], answers[i]) for i in active]
        rng = rng_seed + 7919 * turn
        if drafter is None:
            res = generation.generate(target, inputs, sampling, rng, warmup=warmup)
        else:
            res = generation.speculative_generate(target, drafter, inputs, sampling, rng,
                                                  warmup=warmup)
            stats.append(res.stats)
        seconds += float(res.timing["seconds"])
        new_tokens += int(res.timing["new_tokens"])
        for i, text in zip(active, res.text):
            answers[i].append(text if text is not None else "")
    row = {"seconds": seconds, "new_tokens": new_tokens, "turns": turns}
    if stats:
        row.update(_merge_turn_stats(stats))
    return row


def _overrides(drafter) -> dict:
    """SamplingConfig fields a drafter is evaluated with (verify mode / Z_T ablations)."""
    return dict(getattr(drafter, "sampling_overrides", None) or {})


def weights_digest(params: Any) -> Optional[str]:
    """sha256 (16 hex digits) of a parameter pytree's leaf paths, dtypes, shapes and bytes;
    None for a drafter without parameters (n-gram drafting). Recorded per drafter name so
    that a rerun into an output folder cannot take rows decoded by other weights under the
    same name (a chain's export retrained in place) as its own."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    if not leaves:
        return None
    digest = hashlib.sha256()
    for path, leaf in sorted(leaves, key=lambda item: jax.tree_util.keystr(item[0])):
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(f"{getattr(leaf, 'dtype', '')}{getattr(leaf, 'shape', '')}".encode())
        if getattr(leaf, "is_fully_addressable", True):  # a sharded leaf: by shape only
            digest.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return digest.hexdigest()[:16]


def _method_settings(drafter) -> dict:
    """What run_config.json records per drafter name: its sampling overrides, its
    `@block=N` when it drafts a shorter block than it was trained with, and the digest of
    its weights."""
    block = getattr(drafter, "block_override", None)
    settings = dict(_overrides(drafter), **(getattr(drafter, "ngram_settings", None) or {}))
    if getattr(drafter, "draft_vocab", None) is not None:  # a draft-time vocabulary
        settings["draft_vocab"] = drafter.draft_vocab
    weights = weights_digest(getattr(drafter, "params", None) or {})
    if weights is not None:
        settings["weights"] = weights
    return settings if block is None else dict(settings, block=block)


def _read_rows(path: Path, repair: bool = True) -> list[dict]:
    """Finished rows; a last line cut by an interrupted run is dropped (its unit is redone).
    repair: also fix the file so that the next append starts on a fresh line (only the
    file's one writer may: False reads another process's file as it is)."""
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if n != len(lines):
                raise ValueError(f"{path}: line {n} is not valid JSON (only the last line "
                                 "may be cut by an interrupted run)") from None
    if repair and text and not text.endswith("\n"):
        # the next append must start on a fresh line: drop a cut line, end a whole one
        whole = bool(lines[-1].strip()) and rows and _parses(lines[-1])
        path.write_text(text + "\n" if whole else text[:text.rfind("\n") + 1])
    return rows


def _parses(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except json.JSONDecodeError:
        return False


ROWS_FILE = "rows.jsonl"
_PROCESS_ROWS = "rows.process-{:05d}.jsonl"  # process i's rows during a multi-process run
_PROCESS_ROWS_GLOB = "rows.process-*.jsonl"


def _unit_key(row: Mapping[str, Any]) -> tuple:
    return (row["benchmark"], temperature_key(row["temperature"]), row["method"],
            tuple(row["prompt_ids"]))


def _merge_rows(out: Path) -> list[dict]:
    """(Process 0, while no other process writes) the rows of rows.jsonl and of the
    per-process files a multi-process run leaves (`rows.process-NNNNN.jsonl`), each unit
    once, in rows.jsonl (written atomically); the per-process files are then removed. A
    crash in between leaves rows that the next merge drops as duplicates."""
    main = out / ROWS_FILE
    rows = _read_rows(main)
    parts = sorted(out.glob(_PROCESS_ROWS_GLOB))
    if not parts:
        return rows
    seen = {_unit_key(r) for r in rows}
    for part in parts:
        for row in _read_rows(part, repair=False):  # a cut last line: its unit is redone
            if _unit_key(row) not in seen:
                seen.add(_unit_key(row))
                rows.append(row)
    atomic_write_text(main, "".join(json.dumps(r) + "\n" for r in rows))
    for part in parts:
        part.unlink(missing_ok=True)
    return rows


def run_evaluation(target, drafters: Mapping[str, Any], **kw) -> Optional[dict]:
    """Evaluate `drafters` against plain decoding of `target`; resumable (see
    `_run_evaluation` for the arguments). One run writes an `out_dir` at a time
    (`out_dir/.lock`, held by process 0; a second run is refused, naming the first).

    With `jax.process_count() > 1` every process calls this with the same arguments (and
    the same `out_dir`, one folder shared by all hosts): the unfinished units are dealt
    round-robin, each process decodes its own on its own devices (no cross-process
    traffic while decoding) and appends them to its own `rows.process-NNNNN.jsonl`;
    after a barrier process 0 merges them into rows.jsonl and writes the tables, plots
    and TensorBoard summary, and returns the results; the other processes return None.
    The tables equal a 1-process run's apart from the timing numbers (speedup,
    tokens_per_s, seconds): a unit's sampling seed depends on the unit alone."""
    _local_out(kw.get("out_dir", "eval_out"))  # every process refuses gs:// alike, at once
    pid, nproc = jax.process_index(), jax.process_count()
    lock, error = None, None
    if pid == 0:
        try:  # absent, empty or an evaluation folder (io/output_folder.py); then the lock
            check_output_folder(kw.get("out_dir", "eval_out"), "evaluation", "--out")
            lock = FolderLock(str(kw.get("out_dir", "eval_out")), "evaluation",
                              log=print if kw.get("progress", True) else None).acquire()
        except Exception as e:  # noqa: BLE001 -- the other processes must hear of it too
            if nproc == 1:
                raise
            error = e
    try:
        return _run_evaluation(target, drafters, _setup_error=error, **kw)
    finally:
        if lock is not None:
            lock.release()


def _run_evaluation(target, drafters: Mapping[str, Any], *,
                   benchmarks: Sequence[str] = ("humaneval", "mt-bench", "gsm8k",
                                                "creative-writing"),
                   temperatures: Sequence[float] = (0.7, 1.0, 1.5),
                   prompts_per_benchmark: Optional[int] = None,
                   max_new_tokens: int = 256,
                   out_dir: str | Path = "eval_out",
                   baseline: Optional[str] = None,
                   seed: int = 0,
                   verify_mode: str = "greedy-branch",
                   batch_size: int = 1,
                   progress: bool = True,
                   prompt_sets: Optional[Mapping[str, Sequence[Any]]] = None,
                   warmup: bool = True,
                   plots: bool = True,
                   tensorboard: bool = True,
                   block_families: Optional[Mapping[str, Mapping[int, str]]] = None,
                   _setup_error: Optional[Exception] = None) -> Optional[dict]:
    """Evaluate `drafters` against plain decoding of `target`; resumable.

    For each benchmark and temperature: plain `generate` once (the speed reference), then
    `speculative_generate` per drafter on the same prompts with the same seeds. Each
    finished unit (one prompt, or one batch with `batch_size > 1`) is appended to
    `out_dir/rows.jsonl` at once; a rerun with the same settings skips it. Multi-turn
    prompts (MT-Bench) send turn 2 after the model's own first answer, and the row pools
    both turns.

    `verify_mode` is the default verification mode; a drafter carrying
    `sampling_overrides` (`NAME=DIR@mode=mixture,zt=0.5` specs) is run with those fields
    changed, so one trained drafter can appear under several settings (ablations).

    `prompt_sets` (name -> items) replaces loading `benchmarks` by name; an item is a
    `Prompt`, a message list or a token-id list (ids are the item indices). `warmup`
    compiles each jitted call's shapes ahead of time, once per process (tokens/s then
    excludes compilation, and no answer is generated twice).
    `tensorboard` also writes the tables' numbers to out_dir/tensorboard
    (`write_scalar_summary`). Returns the results.json object (meta, cells, tables).
    """
    pid, nproc = jax.process_index(), jax.process_count()
    if PLAIN in drafters:
        raise ValueError(f"{PLAIN!r} names the plain-decoding rows; rename that drafter")
    if baseline is not None and baseline not in drafters:
        raise ValueError(f"baseline {baseline!r} is not among the drafters {sorted(drafters)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out = _local_out(out_dir)

    if prompt_sets is not None:
        sets = {name: _items_from_set(items, prompts_per_benchmark)
                for name, items in prompt_sets.items()}
    else:
        sets = {name: _items_from_benchmark(name, prompts_per_benchmark) for name in benchmarks}
    temps = [float(t) for t in temperatures]

    meta = {"target": getattr(target, "name", "target"), "seed": seed,
            "max_new_tokens": max_new_tokens, "verify_mode": verify_mode,
            "batch_size": batch_size}
    method_settings = {name: _method_settings(d) for name, d in drafters.items()}
    # Process 0 (holding the lock) checks and records the settings and merges the rows
    # of earlier runs; the others hear the outcome before anyone decodes.
    error = _setup_error
    if pid == 0 and error is None:
        try:
            out.mkdir(parents=True, exist_ok=True)
            meta_path = out / "run_config.json"
            if meta_path.exists():
                old = json.loads(meta_path.read_text())
                diff = {k: (old.get(k), v) for k, v in meta.items() if old.get(k) != v}
                old_methods = old.get("method_settings", {})
                diff.update({f"method {n}": (old_methods[n], v)
                             for n, v in method_settings.items()
                             if n in old_methods and old_methods[n] != v})
                if diff:
                    raise ValueError(f"{out} holds rows from a run with other settings "
                                     f"(setting: (old, new)) {diff}; use another out_dir")
                method_settings = {**old_methods, **method_settings}
            meta_path.write_text(json.dumps(dict(meta, method_settings=method_settings),
                                            indent=1, sort_keys=True))
            _merge_rows(out)
        except Exception as e:  # noqa: BLE001 -- the other processes must hear of it too
            if nproc == 1:
                raise
            error = e
    if nproc > 1:
        error = setup_error(error, "evaluation", out / "run_config.json")
    if error is not None:
        raise error

    rows_path = out / ROWS_FILE
    rows = _read_rows(rows_path, repair=False)  # merged and whole: process 0 just wrote it
    done = {(r["benchmark"], temperature_key(r["temperature"]), r["method"], pid_)
            for r in rows for pid_ in r["prompt_ids"]}
    methods: list[tuple[str, Any]] = [(PLAIN, None)] + list(drafters.items())

    # the units of work still to do, in a fixed order; process i takes units i, i + n, ...
    units = []
    for bench, items in sets.items():
        for temp in temps:
            for method, drafter in methods:
                todo = [(p, it) for p, it in items
                        if (bench, temperature_key(temp), method, p) not in done]
                units += [(bench, temp, method, drafter, todo[start:start + batch_size])
                          for start in range(0, len(todo), batch_size)]
    mine = units[pid::nproc]
    if nproc == 1:  # the whole selection, finished prompts included
        total = sum(len(items) for items in sets.values()) * len(temps) * len(methods)
        initial = total - sum(len(u[-1]) for u in units)
        sink_path = rows_path
    else:  # this process's share of this run
        total, initial = sum(len(u[-1]) for u in mine), 0
        sink_path = out / _PROCESS_ROWS.format(pid)
        if progress:
            print(f"evaluation: process {pid} of {nproc} decodes {len(mine)} of the "
                  f"{len(units)} unfinished units", flush=True)
    bar = tqdm(total=total, initial=initial, disable=not progress or pid != 0, desc="eval",
               unit="prompt")
    sampling_of = {}
    with sink_path.open("a") as sink:
        for bench, temp, method, drafter, batch in mine:
            if temp not in sampling_of:
                sampling_of[temp] = SamplingConfig(temperature=temp,
                                                   max_new_tokens=max_new_tokens,
                                                   verify_mode=verify_mode)
            method_sampling = sampling_of[temp].replace(**_overrides(drafter))
            ids = [p for p, _ in batch]
            bar.set_postfix_str(f"{bench} T={temp} {method}")
            unit = _run_unit(target, drafter, [it for _, it in batch], method_sampling,
                             _seed_for(seed, bench, temp, ids), warmup)
            row = {"benchmark": bench, "temperature": temp, "method": method,
                   "prompt_ids": ids, **unit}
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            rows.append(row)
            bar.update(len(ids))
    bar.close()
    if nproc > 1:
        barrier("dblast_evaluation_rows")
        if pid != 0:
            return None
        rows = _merge_rows(out)

    # only the rows of this run's selection (a wider earlier run may share out_dir)
    wanted_ids = {b: {p for p, _ in items} for b, items in sets.items()}
    names = {PLAIN, *drafters}
    kept = [r for r in rows if r["benchmark"] in wanted_ids and r["method"] in names
            and float(r["temperature"]) in temps
            and set(r["prompt_ids"]) <= wanted_ids[r["benchmark"]]]
    # in the order of the units (bench, temperature, method, prompts), whatever order the
    # rows were written in: a resumed or multi-process run pools its floats the same way
    pos = {b: {p: i for i, (p, _) in enumerate(items)} for b, items in sets.items()}
    order = {m: i for i, (m, _) in enumerate(methods)}
    kept.sort(key=lambda r: (list(sets).index(r["benchmark"]), temps.index(
        float(r["temperature"])), order[r["method"]],
        min(pos[r["benchmark"]][p] for p in r["prompt_ids"])))
    cells = aggregate(kept)
    if block_families:  # one drafter at several blocks (generation.block_variants)
        meta["block_families"] = {f: {str(b): m for b, m in blocks.items()}
                                  for f, blocks in block_families.items()}
    meta = dict(meta, benchmarks=list(sets), temperatures=temps, drafters=list(drafters),
                method_settings={n: method_settings.get(n, {}) for n in drafters})
    result = write_tables(cells, out, baseline, meta)
    if plots:
        write_plots(cells, out)
    if tensorboard:
        write_scalar_summary(result, out)
    return result
