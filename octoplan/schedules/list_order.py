"""Op orders by a longest-tail-first list scheduler: a new order for a given partition and placement.

The policy scheduler decides each rank's next op by the op's kind and the rank's warm-up
count; the shifting-bottleneck procedure (:mod:`octoplan.schedules.bottleneck`) orders one rank
at a time against heads and tails. This scheduler orders every rank at once, in time: whenever
a rank is free, it starts, of the ops whose inputs have arrived, the one with the longest *tail*
(the longest path of dataflow after it to the iteration's end, in
:mod:`octoplan.schedules.opgraph`'s model), and if none has arrived it waits for the first that
will. That is the critical-path rule of list scheduling (a non-delay schedule): the op on the
longest remaining chain goes first, so the pipeline's drain, where a late backward holds up
every rank below it, is started as early as its inputs allow.

It is one more heuristic, not a better one everywhere: on loops of three stages per rank it
found orders the policies and the shifting-bottleneck procedure did not (docs/BENCHMARKS.md).
The tuner tries it as a move at a climb's local optimum, and the simulator decides.

With ``keep_memory`` no stage holds more microbatches in flight than in the given order (the
graph's memory edges); ties between equal tails go to the op earlier in a topological order,
so the result is deterministic.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from octoplan.costs import StageCost
from octoplan.ops import Op
from octoplan.plan import Cluster, Parallel
from octoplan.schedules.opgraph import OpGraph, heads_and_tails

__all__ = ["longest_tail_order"]


def longest_tail_order(schedule: Sequence[Sequence[Op]], rank_of_stage: Sequence[int], costs: Sequence[StageCost], *,
                       cluster: Cluster, parallel: Parallel, keep_memory: bool = True,
                       tail: Sequence[float] | None = None) -> tuple[list[list[Op]], float]:
    """Per-rank op lists for ``schedule``'s ops on its layout, each rank running, whenever it is
    free, the arrived op with the longest tail; and their makespan in the order model.
    ``keep_memory``: no stage holds more microbatches in flight than in ``schedule``. ``tail``:
    the priorities to use instead of the dataflow's tails, one per op of ``schedule`` taken rank
    by rank (``benchmarks/probe_x3_orders.py`` tries tails over an order's rank sequence)."""
    graph = OpGraph(schedule, rank_of_stage, costs, cluster, parallel, keep_memory)
    _, dataflow_tail, place = heads_and_tails(graph)
    tail = dataflow_tail if tail is None else tail
    n, num_ranks = len(graph.dur), graph.num_ranks
    missing = [len(p) for p in graph.preds]
    arrival = [0.0] * n  # when the op's last input has arrived (once all its predecessors ran)
    # per rank: ops whose inputs are all scheduled, by arrival; and those arrived, by tail
    coming: list[list[tuple[float, int, int]]] = [[] for _ in range(num_ranks)]
    arrived: list[list[tuple[float, int, int]]] = [[] for _ in range(num_ranks)]
    for i in range(n):
        if missing[i] == 0:
            heapq.heappush(coming[graph.rank[i]], (0.0, place[i], i))
    free = [0.0] * num_ranks
    order: list[list[Op]] = [[] for _ in range(num_ranks)]
    makespan = 0.0

    def admit(r: int, t: float) -> None:
        while coming[r] and coming[r][0][0] <= t:
            _, p, i = heapq.heappop(coming[r])
            heapq.heappush(arrived[r], (-tail[i], p, i))

    for _ in range(n):
        # the rank that can start an op soonest (ties: the lower rank) runs its next op
        best: tuple[float, int] | None = None
        for r in range(num_ranks):
            admit(r, free[r])
            if arrived[r]:
                t = free[r]
            elif coming[r]:
                t = coming[r][0][0]
            else:
                continue
            if best is None or t < best[0]:
                best = (t, r)
        if best is None:
            raise ValueError("the op graph has a cycle: some ops never become ready")
        t, r = best
        admit(r, t)
        _, _, i = heapq.heappop(arrived[r])
        free[r] = t + graph.dur[i]
        makespan = max(makespan, free[r])
        order[r].append(graph.ops[i])
        for b, lag in graph.succs[i]:
            arrival[b] = max(arrival[b], free[r] + lag)
            missing[b] -= 1
            if missing[b] == 0:
                heapq.heappush(coming[graph.rank[b]], (arrival[b], place[b], b))
    return order, makespan
