"""How far an op order is from the best order of its layout: the order model solved by CP-SAT.

Justification and the list schedulers find good orders, but they cannot say how much better
an order of the same stages and placement could be. This module states the order problem of
:mod:`octoplan.schedules.opgraph` exactly and hands it to CP-SAT (OR-Tools): one interval per
op, one no-overlap constraint per rank, a precedence with its transfer lag per dataflow edge,
each stage's kinds in microbatch order and, by default, each stage's in-flight limit taken
from the given order. The objective is the makespan, and the given order is the hint.

CP-SAT returns the best order it found in the time allowed and a lower bound that no order of
the model can beat; when the two meet, the order is optimal. Large plans (thousands of ops)
can leave CP-SAT without an answer in a short time, so the bound also takes the *one-machine
relaxation* (Carlier, 1982), which costs one pass over the graph: each rank alone, its ops
released at their *heads* (the longest path of the dataflow before them) and followed by their
*tails* (the longest path after them), scheduled preemptively by Jackson's rule (most tail
first), which is optimal for that relaxation. It catches what bounds a pipeline most often: a
rank that cannot start before the first microbatch reaches it, and must still pass its last
gradient back.

The simulator's costs are the model's plus link contention, so the bound holds for the
simulated iteration too. CP-SAT works in integer ticks of 1 us rounded *down*, so its model is
never slower than the real one and its bound stays a bound. Orders found here are judged by
the simulator like any other.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from typing import Sequence

from ortools.sat.python import cp_model

from octoplan.costs import TICKS_PER_MS, StageCost
from octoplan.ops import Op
from octoplan.plan import Cluster, Parallel
from octoplan.schedules.opgraph import OpGraph, heads_and_tails, serial_schedule

__all__ = ["OrderBound", "RankBound", "order_bound", "one_machine_bound", "rank_bounds", "relaxation_bound"]


@dataclass(frozen=True)
class RankBound:
    """One rank's part of the one-machine relaxation: no order of the layout finishes before
    ``bound_ms``, because the rank cannot start before ``first_start_ms`` (the dataflow's
    longest path to its earliest op: the first microbatch's way to its first stage), has
    ``busy_ms`` of ops to run, and the rest, ``bound_ms - first_start_ms - busy_ms``, is waiting
    the dataflow forces on it (between its ops, or after its last one while other ranks finish
    what depends on it). Which of the three dominates says what a better layout must change."""

    rank: int
    bound_ms: float
    first_start_ms: float
    busy_ms: float

    @property
    def forced_wait_ms(self) -> float:
        return max(0.0, self.bound_ms - self.first_start_ms - self.busy_ms)


@dataclass(frozen=True)
class OrderBound:
    """The bound for one layout. Times are the model's makespans (no link contention)."""

    status: str  # OPTIMAL (best_ms is the best any order can do), or CP-SAT's FEASIBLE or UNKNOWN
    given_ms: float  # the given order
    best_ms: float  # the best order found (the given one when CP-SAT found nothing shorter)
    lower_bound_ms: float  # no order of the model finishes sooner: the larger of CP-SAT's bound and
    relaxation_ms: float  # the one-machine relaxation's (which needs no search)
    order: tuple[tuple[Op, ...], ...]  # the best order found, per rank
    wall_s: float
    by_rank: tuple[RankBound, ...] = ()  # the relaxation per rank, by rank: relaxation_ms is their largest

    @property
    def by_relaxation(self) -> bool:
        """Whether the one-machine relaxation (rather than CP-SAT's search) proves the bound."""
        return self.relaxation_ms >= self.lower_bound_ms - 1e-9

    @property
    def gap(self) -> float:
        """The share of the given order's time that a better order could at most save."""
        return max(0.0, 1.0 - self.lower_bound_ms / self.given_ms) if self.given_ms > 0 else 0.0


def _ticks_down(ms: float) -> int:
    # rounding down keeps the integer model a relaxation (the epsilon absorbs float noise
    # such as 2.9999999 ticks, far below a tick)
    return max(0, math.floor(ms * TICKS_PER_MS + 1e-6))


def one_machine_bound(graph: OpGraph, num_ranks: int) -> float:
    """The largest over ranks of the optimal preemptive makespan of the rank's ops alone, with
    heads and tails (Jackson's preemptive schedule): a lower bound on every order's makespan."""
    return max((b.bound_ms for b in rank_bounds(graph, num_ranks)), default=0.0)


def rank_bounds(graph: OpGraph, num_ranks: int) -> list[RankBound]:
    """:func:`one_machine_bound`'s figure for each rank, with what makes it up (:class:`RankBound`)."""
    head, tail, _ = heads_and_tails(graph)
    by_rank: list[list[tuple[float, int]]] = [[] for _ in range(num_ranks)]
    for i, r in enumerate(graph.rank):
        by_rank[r].append((head[i], i))
    out = []
    for rank, ops in enumerate(by_rank):
        ops.sort()
        best = 0.0
        ready: list[tuple[float, int, float]] = []  # (-tail, op, time left), most tail first
        t, k = 0.0, 0
        while k < len(ops) or ready:
            if not ready and t < ops[k][0]:
                t = ops[k][0]
            while k < len(ops) and ops[k][0] <= t:
                i = ops[k][1]
                heapq.heappush(ready, (-tail[i], i, graph.dur[i]))
                k += 1
            neg_tail, i, left = heapq.heappop(ready)
            # run it until it ends or the next release, which may preempt it
            until = ops[k][0] if k < len(ops) else math.inf
            if t + left <= until:
                t += left
                best = max(best, t - neg_tail)
            else:
                heapq.heappush(ready, (neg_tail, i, left - (until - t)))
                t = until
        out.append(RankBound(rank, best, ops[0][0] if ops else 0.0, sum(graph.dur[i] for _, i in ops)))
    return out


def relaxation_bound(schedule: Sequence[Sequence[Op]], rank_of_stage: Sequence[int], costs: Sequence[StageCost], *,
                     cluster: Cluster, parallel: Parallel, keep_memory: bool = False) -> float:
    """:func:`one_machine_bound` of ``schedule``'s ops on its layout: no order of them (with
    ``keep_memory``, none within ``schedule``'s in-flight counts) has a shorter makespan."""
    graph = OpGraph(schedule, rank_of_stage, costs, cluster, parallel, keep_memory)
    return one_machine_bound(graph, parallel.pp)


def order_bound(schedule: Sequence[Sequence[Op]], rank_of_stage: Sequence[int], costs: Sequence[StageCost], *,
                cluster: Cluster, parallel: Parallel, time_limit_s: float = 30.0, keep_memory: bool = True,
                workers: int = 1) -> OrderBound:
    """The best order CP-SAT finds for ``schedule``'s ops on its layout within ``time_limit_s``
    seconds, and the proven lower bound on every order's makespan. ``keep_memory``: orders in
    which no stage holds more microbatches in flight than in ``schedule`` (without it, any
    order, whatever its memory). ``workers`` > 1 searches in parallel (the result may then
    vary from run to run; with 1 it varies only when the time limit cuts the search). When the
    one-machine relaxation already meets the given order, that order is optimal and CP-SAT is
    not run."""
    started = time.perf_counter()
    graph = OpGraph(schedule, rank_of_stage, costs, cluster, parallel, keep_memory)
    n = len(graph.ops)
    num_ranks = parallel.pp
    given_ms = graph.makespan(graph.order_times())
    by_rank = tuple(rank_bounds(graph, num_ranks))
    relaxation = max((b.bound_ms for b in by_rank), default=0.0)
    if relaxation >= given_ms - 1e-9 * max(1.0, given_ms):  # the order is optimal: nothing to search
        return OrderBound("OPTIMAL", given_ms, given_ms, given_ms, relaxation, tuple(tuple(ops) for ops in schedule),
                          time.perf_counter() - started, by_rank)

    def in_ticks(edges: list[list[tuple[int, float]]]) -> list[list[tuple[int, int]]]:
        return [[(a, _ticks_down(lag)) for a, lag in row] for row in edges]

    dur = [_ticks_down(d) for d in graph.dur]
    preds = in_ticks(graph.preds)
    # the hint: the given order's times in the integer model, so it is feasible there
    hint = [int(t) for t in serial_schedule(dur, graph.rank, *map(in_ticks, graph.with_order()), graph.position, num_ranks)]
    horizon = max((hint[i] + dur[i] for i in range(n)), default=0)

    model = cp_model.CpModel()
    start = [model.NewIntVar(0, horizon - dur[i], f"s{i}") for i in range(n)]
    intervals = [model.NewFixedSizeIntervalVar(start[i], dur[i], f"op{i}") for i in range(n)]
    for b, edges in enumerate(preds):
        for a, lag in edges:
            model.Add(start[b] >= start[a] + dur[a] + lag)
    per_rank: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in range(n):
        per_rank[graph.rank[i]].append(i)
    makespan = model.NewIntVar(0, horizon, "makespan")
    for ops in per_rank:
        model.AddNoOverlap([intervals[i] for i in ops])
        # implied by the no-overlap, but stated: it gives the LP relaxation each rank's load
        model.Add(makespan >= sum(dur[i] for i in ops))
    has_succ = [False] * n
    for edges in graph.preds:
        for a, _ in edges:
            has_succ[a] = True
    for i in range(n):
        if not has_succ[i]:
            model.Add(makespan >= start[i] + dur[i])
    for i in range(n):
        model.AddHint(start[i], hint[i])
    # the objective's variable too: a hint that leaves it out is incomplete, and on plans of
    # thousands of ops CP-SAT then spends its whole time limit failing to complete it
    # (status UNKNOWN, no order) where a complete hint is its first solution within seconds
    model.AddHint(makespan, horizon)
    model.Minimize(makespan)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, time_limit_s)
    solver.parameters.num_workers = max(1, workers)
    solver.parameters.catch_sigint_signal = False  # Ctrl-C ends the command, not just this solve
    status = solver.Solve(model)
    bound_ticks = int(math.ceil(solver.BestObjectiveBound() - 1e-9))
    order = tuple(tuple(ops) for ops in schedule)
    best_ms = given_ms
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) and solver.ObjectiveValue() < horizon:
        found = [solver.Value(start[i]) for i in range(n)]
        out: list[list[tuple[int, float, int]]] = [[] for _ in range(num_ranks)]
        for i in range(n):
            out[graph.rank[i]].append((found[i], graph.position[i], i))
        order = tuple(tuple(graph.ops[i] for _, _, i in sorted(rank_ops)) for rank_ops in out)
        # the found order's real makespan: the integer model rounded every time down
        regraph = OpGraph(order, rank_of_stage, costs, cluster, parallel, keep_memory)
        best_ms = regraph.makespan(regraph.order_times())
        if best_ms >= given_ms:
            order, best_ms = tuple(tuple(ops) for ops in schedule), given_ms
    lower = min(max(bound_ticks / TICKS_PER_MS, relaxation), best_ms)
    return OrderBound(solver.StatusName(status), given_ms, best_ms, lower, relaxation, order, time.perf_counter() - started,
                      by_rank)
