"""Predicted against measured for plans run by octorun: ``python examples/report.py PLAN=METRICS ...``.

The first plan is the one compared: each other plan's row shows how much faster the first is,
predicted (simulator) and measured (octorun's --metrics). Measured is the median over the steps
after the first (warm-up).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from octoplan.plan import load_plan


def main(pairs: list[str]) -> None:
    rows = []
    for pair in pairs:
        plan_path, _, metrics_path = pair.partition("=")
        plan = load_plan(plan_path)
        steps = [json.loads(line) for line in open(metrics_path) if line.strip()]
        measured = statistics.median(s["iteration_ms"] for s in (steps[1:] or steps))
        rows.append((plan_path, plan.predicted["iteration_ms"], measured, steps[-1]["loss"]))
    table = Table(title="predicted vs measured iteration")
    for column in ("plan", "predicted ms", "measured ms", "error", "first is faster: predicted", "measured"):
        table.add_column(column, justify="left" if column == "plan" else "right", no_wrap=column == "plan")
    first_pred, first_meas = rows[0][1], rows[0][2]
    for path, predicted, measured, _ in rows:
        table.add_row(Path(path).name, f"{predicted:.1f}", f"{measured:.1f}", f"{measured / predicted - 1:+.1%}",
                      f"{predicted / first_pred:.2f}x", f"{measured / first_meas:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main(sys.argv[1:])
