"""One table from the four `dblast eval` folders (b{1,8}_{argmax,sampled}) that
eval_decoding_methods.sh and flagship/shipped_on_benchmarks.sh write: per decoding
method, macro tau (± SE) and speed against plain decoding at T = 0 / 0.7 / 1.0 / 1.5, at
batch 1 and batch 8, and the per-benchmark speeds at batch 1. A folder not finished yet
(no results.json) is named and left out.

    python experiments/smollm2/decoding_methods_table.py \\
        [experiments/smollm2/results_decoding_methods] > TABLE.md
    python experiments/smollm2/decoding_methods_table.py \\
        experiments/flagship/shipped_on_benchmarks > TABLE.md
"""

from __future__ import annotations

import json
import os
import sys

ORDER = ["ngram", "k1", "k1_v8k", "k4", "k1+ngram", "k1_v8k+ngram"]  # others follow
FOLDERS = {1: ("b1_argmax", "b1_sampled"), 8: ("b8_argmax", "b8_sampled")}


def tables(root: str, batch: int, say_missing: bool = True) -> tuple[dict, list[str]]:
    """{(method, column): value} of the tau, tau_se and speedup tables, and the Ts."""
    cells, temps = {}, []
    for sub in FOLDERS[batch]:
        path = os.path.join(root, sub, "results.json")
        if not os.path.exists(path):
            if say_missing:
                print(f"\n({sub}: not finished yet; rerun the script that writes "
                      f"{root} to resume it)")
            continue
        with open(path) as f:
            result = json.load(f)["tables"]
        for metric in ("tau", "tau_se", "speedup"):
            for row in result[metric]["rows"]:
                for column, value in row.items():
                    if column != "drafter":
                        cells[(metric, row["drafter"], column)] = value
        temps += [c.split("@T")[1] for c in result["tau"]["columns"] if c.startswith("macro@")]
    return cells, temps


def methods_of(cells: dict) -> list[str]:
    """The methods present, in ORDER first, then the others as they came."""
    present = list(dict.fromkeys(method for (_, method, _) in cells))
    return [m for m in ORDER if m in present] + [m for m in present if m not in ORDER]


def main(root: str) -> None:
    for batch in (1, 8):
        cells, temps = tables(root, batch)
        if not temps:
            continue
        print(f"\n**Batch {batch}** (macro over the four benchmarks; tau ± SE, then speed "
              "against plain decoding in the same command)\n")
        print("| method | " + " | ".join(f"T = {t}" for t in temps) + " |")
        print("|---|" + "---|" * len(temps))
        print("| plain | " + " | ".join("1 / 1.00x" for _ in temps) + " |")
        for method in methods_of(cells):
            row = []
            for t in temps:
                tau = cells.get(("tau", method, f"macro@T{t}"))
                se = cells.get(("tau_se", method, f"macro@T{t}"))
                speed = cells.get(("speedup", method, f"macro@T{t}"))
                row.append("-" if tau is None else f"{tau:.2f} ± {se:.2f} / {speed:.2f}x")
            print(f"| `{method}` | " + " | ".join(row) + " |")
    cells, temps = tables(root, 1, say_missing=False)
    benchmarks = sorted({c.split("@")[0] for (_, _, c) in cells if "@T" in c
                         and not c.startswith(("macro", "gain"))})
    print("\n**Speed against plain decoding per benchmark, batch 1**\n")
    print("| method | " + " | ".join(f"{b} T = {t}" for t in temps for b in benchmarks) + " |")
    print("|---|" + "---|" * (len(temps) * len(benchmarks)))
    for method in methods_of(cells):
        speeds = (cells.get(("speedup", method, f"{b}@T{t}")) for t in temps
                  for b in benchmarks)
        print(f"| `{method}` | " + " | ".join("-" if v is None else f"{v:.2f}x"
                                              for v in speeds) + " |")


if __name__ == "__main__":
    if len(sys.argv) > 2 or (len(sys.argv) == 2 and sys.argv[1].startswith("-")):
        print(__doc__.strip(), file=sys.stderr if sys.argv[1] not in ("-h", "--help")
              else sys.stdout)
        sys.exit(0 if sys.argv[1] in ("-h", "--help") else 2)
    root = sys.argv[1] if len(sys.argv) > 1 else "experiments/smollm2/results_decoding_methods"
    if not os.path.isdir(root):
        sys.exit(f"{root}: no such folder (the four `dblast eval` folders b1_argmax, "
                 "b1_sampled, b8_argmax, b8_sampled live in it)")
    main(root)
