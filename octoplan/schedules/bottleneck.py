"""Op orders by the shifting-bottleneck procedure: a new order for a given partition and placement.

List schedulers (the policy scheduler, a baseline's rule) decide each rank's next op from what
is ready at that moment, and justification (:mod:`octoplan.schedules.justify`) only repairs the
order it is given. Neither looks at which rank the iteration's length hangs on. The shifting
bottleneck procedure from job-shop scheduling (Adams, Balas and Zawack, 1988, "The shifting
bottleneck procedure for job shop scheduling") does:

1. Every op gets a *head* (the longest path of dataflow and fixed rank orders before it) and a
   *tail* (the longest after it), in :mod:`octoplan.schedules.opgraph`'s model.
2. Each rank not yet ordered is ordered alone, its ops released at their heads and followed
   by their tails, by Schrage's rule: when the rank is free, run the released op with the
   longest tail. The rank whose order ends latest (head + work + tail) is the bottleneck; its
   order is fixed, which lengthens other ops' heads and tails.
3. Every rank fixed so far is then ordered again with the others held, as the new order
   changed its heads and tails (the procedure's re-optimization step).
4. Until every rank is ordered.

The rank alone with heads and tails is the one-machine problem whose preemptive optimum
:func:`octoplan.schedules.exact.one_machine_bound` takes as a lower bound, so this procedure
orders each rank against the same quantities that bound it. It is a different heuristic from
the list schedulers, not a better one everywhere: on the benchmark suite's tuned plans its
orders, justified, were faster than the tuner's on gemma3-27b, llama3-8b and nemotron-h-8b
(0.3-1.4%), and as fast or slower on the others; on some balanced layouts the policy scheduler
with justification is already at the bound and this procedure is not. The tuner therefore
tries it as one more move, and the simulator decides (docs/BENCHMARKS.md).

Each stage keeps its microbatch order (the graph's edges). With ``keep_memory``, no stage holds
more microbatches in flight than in the given order. A zero-length path between two ops on one
rank is broken by their place in a topological order, so fixing a rank's order never closes a
cycle. The simulator remains the judge of the order returned, link contention and memory
included.
"""

from __future__ import annotations

import heapq
import time
from typing import Sequence

from octoplan.costs import StageCost
from octoplan.ops import Op
from octoplan.plan import Cluster, Parallel
from octoplan.schedules.opgraph import OpGraph, heads_and_tails

__all__ = ["bottleneck_order"]


class _Sequencer:
    """The graph with some ranks' orders fixed: each op's rank predecessor and successor."""

    def __init__(self, graph: OpGraph):
        self.graph = graph
        n = len(graph.ops)
        self.prev = [-1] * n
        self.next = [-1] * n
        self.by_rank: list[list[int]] = [[] for _ in range(graph.num_ranks)]
        for i, r in enumerate(graph.rank):
            self.by_rank[r].append(i)
        self.fixed: dict[int, list[int]] = {}

    def fix(self, rank: int, order: list[int]) -> None:
        self.release(rank)
        self.fixed[rank] = order
        for a, b in zip(order, order[1:]):
            self.next[a], self.prev[b] = b, a

    def release(self, rank: int) -> None:
        for i in self.fixed.pop(rank, ()):
            self.prev[i] = self.next[i] = -1

    def heads_tails(self) -> tuple[list[float], list[float], list[int]]:
        """Longest paths before and after every op, and each op's place in a topological order."""
        return heads_and_tails(self.graph, self.prev, self.next)

    def schrage(self, rank: int, head: list[float], tail: list[float], place: list[int]) -> tuple[list[int], float]:
        """The rank's ops alone, by Schrage's rule: its order and when its last tail ends."""
        dur = self.graph.dur
        ops = sorted(self.by_rank[rank], key=lambda i: (head[i], place[i]))
        ready: list[tuple[float, float, int, int]] = []  # longest tail, longest op, topological place
        order: list[int] = []
        t, k, end = 0.0, 0, 0.0
        while k < len(ops) or ready:
            if not ready and t < head[ops[k]]:
                t = head[ops[k]]
            while k < len(ops) and head[ops[k]] <= t + 1e-9:
                i = ops[k]
                heapq.heappush(ready, (-_even(tail[i]), -_even(dur[i]), place[i], i))
                k += 1
            *_, i = heapq.heappop(ready)
            order.append(i)
            t += dur[i]
            end = max(end, t + tail[i])
        return order, end


def _even(ms: float) -> float:
    """``ms`` to the nanosecond, for comparisons: paths whose lengths differ only in the last
    bits (floats summed in another order, or layer times read back from a profile file, which
    keeps six decimals) mostly compare equal, and their ties break alike."""
    return round(ms, 6)


def bottleneck_order(schedule: Sequence[Sequence[Op]], rank_of_stage: Sequence[int], costs: Sequence[StageCost], *,
                     cluster: Cluster, parallel: Parallel, keep_memory: bool = True,
                     deadline: float | None = None) -> tuple[list[list[Op]], float]:
    """Per-rank op lists for ``schedule``'s ops on its layout by the shifting-bottleneck
    procedure, and their makespan in the order model. ``keep_memory``: no stage holds more
    microbatches in flight than in ``schedule``. Its cost grows with the square of the rank
    count: a pass over every op per rank fixed or re-ordered. ``deadline`` (a
    ``time.perf_counter()`` reading): past it, each rank still unordered is ordered and fixed
    in turn, without looking for the bottleneck and without re-optimizing: one pass a rank,
    a worse order in bounded time."""
    graph = OpGraph(schedule, rank_of_stage, costs, cluster, parallel, keep_memory)
    seq = _Sequencer(graph)
    num_ranks = graph.num_ranks
    fixed_in_turn: list[int] = []
    while len(fixed_in_turn) < num_ranks:
        head, tail, place = seq.heads_tails()
        if deadline is not None and time.perf_counter() > deadline:
            rank = next(r for r in range(num_ranks) if r not in seq.fixed)
            seq.fix(rank, seq.schrage(rank, head, tail, place)[0])
            fixed_in_turn.append(rank)
            continue
        worst: tuple[float, int, list[int]] | None = None
        for r in range(num_ranks):
            if r not in seq.fixed and seq.by_rank[r]:
                order, end = seq.schrage(r, head, tail, place)
                if worst is None or _even(end) > worst[0]:
                    worst = (_even(end), r, order)
        if worst is None:  # the ranks left hold no ops
            fixed_in_turn.extend(r for r in range(num_ranks) if r not in seq.fixed)
            break
        seq.fix(worst[1], worst[2])
        fixed_in_turn.append(worst[1])
        # re-optimize every rank fixed so far, the others held (the one just fixed too: it then
        # sees the heads and tails that the others' new orders make)
        for r in fixed_in_turn:
            seq.release(r)
            head, tail, place = seq.heads_tails()
            seq.fix(r, seq.schrage(r, head, tail, place)[0])
    head, _, _ = seq.heads_tails()
    makespan = max((h + d for h, d in zip(head, graph.dur)), default=0.0)
    out = [[graph.ops[i] for i in seq.fixed.get(r, [])] for r in range(num_ranks)]
    return out, makespan
