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

from octoplan.errors import InputError
from octoplan.plan import load_plan


def _steps(metrics_path: str) -> list[dict]:
    try:
        with open(metrics_path) as lines:
            steps = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError) as exc:
        raise InputError(metrics_path, None, f"cannot be read as octorun --metrics: {exc}",
                         "give PLAN=METRICS, the metrics file octorun wrote for PLAN") from None
    if not steps:
        raise InputError(metrics_path, None, "holds no step", "give the --metrics file of a run that trained")
    for number, step in enumerate(steps, 1):
        if not (isinstance(step, dict) and all(isinstance(step.get(key), (int, float)) for key in ("iteration_ms", "loss"))):
            raise InputError(metrics_path, f"line {number}", "is no step of octorun --metrics (iteration_ms and loss)",
                             "give PLAN=METRICS, the metrics file octorun wrote for PLAN")
    return steps


def main(pairs: list[str]) -> None:
    rows = []
    for pair in pairs:
        plan_path, _, metrics_path = pair.partition("=")
        if not metrics_path:
            raise InputError(None, pair, "is no PLAN=METRICS pair", "give each plan with its metrics: plans/x.yaml=out/x.jsonl")
        plan = load_plan(plan_path)
        steps = _steps(metrics_path)
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
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(f"usage: python examples/report.py PLAN=METRICS [PLAN=METRICS ...]\n\n{__doc__.split(chr(10) * 2, 1)[1]}")
        sys.exit(0 if len(sys.argv) >= 2 else 2)
    try:
        main(sys.argv[1:])
    except InputError as exc:
        sys.stderr.write(f"error: {exc.line()}\n")
        sys.exit(2)
