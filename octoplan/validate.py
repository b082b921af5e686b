"""``octoplan validate``: every rule of FORMATS.md section 3.

Structure is checked when a plan is loaded (:func:`octoplan.plan.check_structure`); this
module adds the run-to-end rule by simulating the orders: a cycle between the per-rank orders
and the dependencies is reported with the op each rank waits on.
"""

from __future__ import annotations

from octoplan.costs import StageCost
from octoplan.errors import InputError
from octoplan.plan import Plan
from octoplan.simulator import DeadlockError, simulate_costs

__all__ = ["check_runnable"]

_UNIT = StageCost(1.0, 1.0, 1.0, 0, 0, 0)


def check_runnable(plan: Plan, *, file: str = "<plan>") -> None:
    """Raise :class:`InputError` if the per-rank orders cannot run to the end."""
    try:
        simulate_costs(plan, [_UNIT] * plan.num_stages)
    except DeadlockError as exc:
        raise InputError(file, "schedule", str(exc), "reorder the ops so that each waited-for op can run first") from None
