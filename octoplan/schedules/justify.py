"""Forward-backward justification: a better op order for a given partition and placement.

An op order is a resource-constrained schedule: every rank runs one op at a time (a unary
resource), and dataflow ties ops together with time lags (an output is usable after its
transfer). List schedulers, hand-written or policy-driven, leave gaps wherever their rule
guessed wrong; on irregular layouts (uneven stages, several stages per rank in no loop or V
shape) those gaps add up to 10-25% of the iteration. *Justification* is the standard repair
from project scheduling (Valls, Ballestín and Quintanilla, 2005, "Justification and RCPSP"):

1. *right-justify*: take ops latest-finishing first and place each as late as it can go —
   before its successors' starts, in the latest gap of its rank that holds it;
2. *left-justify*: take ops earliest-starting (in the right-justified schedule) first and
   place each as early as it can go — after its predecessors, in the earliest gap that holds it.

Placing an op in a gap can move it past others on its rank, so the order changes; neither
pass can lengthen the schedule, and in practice a couple of rounds take most of the gain.
A W that waited for the end moves into a bubble; a forward that could run early is pulled
there. Right-justification is left-justification of the mirrored problem (every edge
reversed, time running backwards), so one serial schedule-generation scheme serves both.

The model is :mod:`octoplan.schedules.opgraph`'s: the simulator's without link contention,
each stage keeping its microbatch order. With ``keep_memory`` no stage holds more microbatches'
activations at once than in the given order, so a justified plan needs about the memory of the
order it came from (exactly, on a rank with one stage). The simulator remains the judge of the
order returned, and of its memory.
"""

from __future__ import annotations

from typing import Sequence

from octoplan.costs import StageCost
from octoplan.ops import Op
from octoplan.plan import Cluster, Parallel
from octoplan.schedules.opgraph import OpGraph, serial_schedule

__all__ = ["justify"]


def justify(schedule: Sequence[Sequence[Op]], rank_of_stage: Sequence[int], costs: Sequence[StageCost], *,
            cluster: Cluster, parallel: Parallel, rounds: int = 3,
            keep_memory: bool = True) -> tuple[list[list[Op]], float]:
    """The per-rank op lists after up to ``rounds`` right-then-left justifications of
    ``schedule``'s order, and their makespan in the model above (``schedule``'s own order and
    makespan when justification finds nothing shorter). ``keep_memory``: no stage holds more
    microbatches in flight than in ``schedule``; without it, Ws may be deferred and forwards
    pulled ahead as far as the dataflow allows, for plans with memory to spare."""
    problem = OpGraph(schedule, rank_of_stage, costs, cluster, parallel, keep_memory)
    n = len(problem.ops)
    num_ranks = parallel.pp
    start = problem.order_times()  # the given order's own times
    best_span = problem.makespan(start)
    best_start = start
    for _ in range(rounds):
        finish = [start[i] + problem.dur[i] for i in range(n)]
        # right-justify: the mirrored problem (edges reversed), latest finishers first
        mirrored = serial_schedule(problem.dur, problem.rank, problem.succs, problem.preds, [-f for f in finish], num_ranks)
        span = problem.makespan(mirrored)
        right = [span - (mirrored[i] + problem.dur[i]) for i in range(n)]
        start = serial_schedule(problem.dur, problem.rank, problem.preds, problem.succs, right, num_ranks)
        span = problem.makespan(start)
        if span < best_span - 1e-9:
            best_span, best_start = span, start
        else:
            break
    out: list[list[tuple[float, int]]] = [[] for _ in range(num_ranks)]
    for i in range(n):
        out[problem.rank[i]].append((best_start[i], i))
    return [[problem.ops[i] for _, i in sorted(rank_ops)] for rank_ops in out], best_span
