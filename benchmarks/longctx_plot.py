"""One accuracy-against-KV-budget plot from several ``speculum longctx`` runs (their ``results.json``), so that
every policy can be drawn together though the runs were split to fit a session.

Accuracy is what is merged: a policy at a length and budget takes its rows from the first run that has
it, and the first run's ``full`` rows give the bytes that place budget-free policies (the quantizers) on
the budget axis. Speeds are not merged (each run's tok/s compare only with that run's ``full``): read them
in each run's ``results.md``.

    PYTHONPATH=src python benchmarks/longctx_plot.py OUT.png RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def merged_rows(runs: list[Path]) -> list[dict]:
    """The rows of ``runs`` (each a ``results.json``), a (policy, budget, length, task) taken once, from the
    first run that has it."""
    seen, rows = set(), []
    for run in runs:
        for row in json.loads(run.read_text()):
            key = (row["policy"], row["budget"], row["length"], row["task"])
            if key not in seen:
                seen.add(key)
                rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the plot to write (.png)")
    p.add_argument("runs", nargs="+", help="speculum longctx output directories (each with results.json)")
    args = p.parse_args()
    from speculum.bench.longctx import accuracy_plot

    runs = [Path(r) / "results.json" for r in args.runs]
    missing = [str(r) for r in runs if not r.is_file()]
    if missing:
        raise SystemExit(f"no results.json in: {', '.join(missing)}")
    rows = merged_rows(runs)
    accuracy_plot(rows, args.out)
    policies = sorted({r["policy"] for r in rows})
    print(f"{args.out}: {len(policies)} policies ({', '.join(policies)})")


if __name__ == "__main__":
    main()
