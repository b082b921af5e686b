"""How evenly a profile's layers can be spread over the pipeline's ranks at best: a cap on the
balance, and so on the efficiency, of every plan, whatever its schedule.

A rank's work per microbatch is the sum of its layers' least times (F plus the cheaper of I + W
and the fused B, as docs/FORMATS.md section 7's lower bound counts them); the balance of a
layout is that bound's per-microbatch share over its busiest rank's work. Layers of equal work
form one group and CP-SAT spreads each group's count over the ranks: a bin packing without the
symmetry between equal layers that keeps one boolean per layer and rank from proving its
optimum.

With ``stages_per_rank`` the cap holds for layouts of at most that many stages on each rank. A
stage is a run of consecutive layers, so it holds as many odd-indexed layers as even-indexed
ones, or one more of either, and so does its part strictly between the first and the last layer
(a run too); a rank of k stages is off by at most k, counted both ways. On split blocks, where
mixers and MLPs alternate, that keeps a rank from holding many more cheap mixers than costly
MLPs; the inside count sees past the embedding and the head. Contiguity is otherwise relaxed,
so the answer caps every such layout's balance and a layout need not reach it.
"""

from __future__ import annotations

from typing import NamedTuple

from octoplan.costs import to_ticks
from octoplan.profile import Profile

__all__ = ["BalanceCap", "balance_cap"]


class BalanceCap(NamedTuple):
    found: float  # the balance of the best assignment found
    proven: float  # no assignment balances better (equal to found where CP-SAT proved it)

    @property
    def is_proven(self) -> bool:
        return self.proven - self.found < 5e-4


def balance_cap(profile: Profile, pp: int, *, stages_per_rank: int | None = None,
                time_limit_s: float = 10.0) -> BalanceCap:
    """The best balance of any assignment of ``profile``'s layers to ``pp`` ranks (with
    ``stages_per_rank``, of layouts with at most that many stages per rank), within
    ``time_limit_s`` of CP-SAT's deterministic time on one worker: the same answer on any
    machine."""
    from ortools.sat.python import cp_model

    work = [to_ticks(l.forward_ms + min(l.backward_input_ms + l.backward_weight_ms, l.b_ms)) for l in profile.layers]
    ideal = max(sum(work) / pp, max(work))
    if ideal == 0:  # layers of no time (under a tick): nothing to balance
        return BalanceCap(1.0, 1.0)
    last = len(work) - 1
    groups: dict[tuple[int, bool, int], int] = {}  # (index parity, inside the ends, work) -> layers
    for i, w in enumerate(work):
        key = (i % 2, 0 < i < last, w) if stages_per_rank is not None else (0, True, w)
        groups[key] = groups.get(key, 0) + 1
    model = cp_model.CpModel()
    held = {g: [model.new_int_var(0, n, "") for _ in range(pp)] for g, n in groups.items()}
    for g, n in groups.items():
        model.add(sum(held[g]) == n)
    busiest = model.new_int_var(0, sum(work), "busiest")
    # the groups each parity rule counts: every layer, and those strictly inside the ends
    counted = [list(groups), [g for g in groups if g[1]]] if stages_per_rank is not None else []
    for r in range(pp):
        model.add(sum(g[2] * held[g][r] for g in groups) <= busiest)
        for rule in counted:
            surplus = sum(held[g][r] for g in rule if g[0] == 1) - sum(held[g][r] for g in rule if g[0] == 0)
            model.add(surplus <= stages_per_rank)
            model.add(surplus >= -stages_per_rank)
    model.minimize(busiest)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = time_limit_s
    solver.parameters.random_seed = 0
    solver.parameters.catch_sigint_signal = False  # Ctrl-C ends the command, not just this solve
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return BalanceCap(float("nan"), float("nan"))
    return BalanceCap(ideal / solver.objective_value, ideal / max(solver.best_objective_bound, 1))
