"""Training curves of one or more runs (their `metrics.jsonl`) in one PNG.

    python -m dblast_jax.train.curves runs/a runs/b --out curves.png

The unweighted mixture NLL per block (comparable across losses), top-1 agreement with
the data and the AL estimate (expected accepted drafts under
`sampled-branch` verification at T_v) against the step, one line per run, smoothed
with a trailing mean so that short noisy runs can be compared by eye. Runs that
validated (`validate_every`) add their held-out points (validation.jsonl) as dashed
lines with markers in the same colour.
"""

from __future__ import annotations

import argparse
import io
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from dblast_jax.io import paths  # local or gs://
from dblast_jax.train.checkpoint import read_log_rows
from dblast_jax.train.validation import read_validation

PANELS = (("block_nll", "mixture NLL per block (nats)"), ("top1_mean", "top-1 agreement"),
          ("al_estimate", "AL estimate (accepted drafts)"))
# runs logged before `block_nll` existed show their objective in that panel instead
FALLBACK = {"block_nll": "loss"}


def read_metrics(workdir: str | Path) -> list[dict]:
    """The rows of `workdir/metrics.jsonl` (a cut last line is ignored; a corrupt line
    before it is an error naming the line)."""
    path = paths.join(os.fspath(workdir), "metrics.jsonl")
    if not paths.exists(path):
        raise FileNotFoundError(f"{path} not found: is {workdir} a training workdir?")
    return read_log_rows(path)[0]


def smooth(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean over up to `window` values (the first points average fewer)."""
    v = np.asarray(values, np.float64)
    if window <= 1 or v.size == 0:
        return v
    c = np.cumsum(np.insert(v, 0, 0.0))
    idx = np.arange(1, v.size + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def run_series(workdir: str | Path) -> dict[str, tuple[list, list]]:
    """{panel key: ([(step, training value)], [(step, held-out value)])} of one run."""
    rows, held = read_metrics(workdir), read_validation(os.fspath(workdir))
    out = {}
    for key, _ in PANELS:
        src = key if any(key in r for r in rows) else FALLBACK.get(key, key)
        out[key] = ([(r["step"], r[src]) for r in rows if src in r],
                    [(r["step"], r[src]) for r in held if src in r])
    return out


def plot_curves(workdirs: Sequence[str | Path], out: str | Path, window: int = 20,
                labels: Optional[Sequence[str]] = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(labels) if labels else [Path(w).name for w in workdirs]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    for workdir, label in zip(workdirs, labels):
        series = run_series(workdir)
        for ax, (key, title) in zip(axes, PANELS):
            pts, vpts = series[key]
            color = None
            if pts:
                steps, vals = zip(*pts)
                (line,) = ax.plot(steps, smooth(vals, window), label=label)
                color = line.get_color()
            if vpts:
                steps, vals = zip(*vpts)
                ax.plot(steps, vals, "o--", color=color, markersize=3,
                        label=f"{label} (held-out)")
            ax.set_title(title)
            ax.set_xlabel("step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    if not paths.is_local(out):  # gs://...: the PNG rendered in memory, one object write
        buf = io.BytesIO()
        fig.savefig(buf, dpi=100, format="png")
        plt.close(fig)
        paths.atomic_write_bytes(out, buf.getvalue())
        return paths.as_path(out)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workdirs", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--window", type=int, default=20, help="trailing-mean window (steps)")
    args = p.parse_args(argv)
    print(plot_curves(args.workdirs, args.out, args.window))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
