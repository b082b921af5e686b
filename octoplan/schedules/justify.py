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

The model is the simulator's (SPEC section 7) without link contention: an op lasts its
stage's time plus the cluster's per-op overhead; a transfer between ranks adds latency +
bytes / bandwidth. Each stage keeps its forwards, backwards and weight gradients in
microbatch order, and never holds more microbatches' activations at once than it did in the
given order (``keep_memory``), so a justified plan needs about the memory of the order it
came from (exactly, on a rank with one stage). The simulator remains the judge of the order
returned, and of its memory.
"""

from __future__ import annotations

import bisect
import heapq
from typing import Sequence

from octoplan.costs import StageCost, transfer_ms
from octoplan.ops import Kind, Op
from octoplan.plan import Cluster, Parallel

__all__ = ["justify"]


class _Problem:
    """Ops as indices: duration, rank, and predecessor edges with their transfer lags."""

    def __init__(self, schedule: Sequence[Sequence[Op]], rank_of_stage: Sequence[int], costs: Sequence[StageCost],
                 cluster: Cluster, parallel: Parallel, keep_memory: bool):
        self.ops: list[Op] = [op for rank_ops in schedule for op in rank_ops]
        index = {op: i for i, op in enumerate(self.ops)}
        overhead = cluster.op_overhead_us / 1000.0
        num_stages = len(rank_of_stage)
        self.rank = [rank_of_stage[op.stage] for op in self.ops]
        op_ms = [{Kind.F: c.forward_ms, Kind.I: c.backward_input_ms, Kind.W: c.backward_weight_ms,
                  Kind.B: c.backward_input_ms + c.backward_weight_ms} for c in costs]
        self.dur = [op_ms[op.stage][op.kind] + overhead for op in self.ops]
        fwd_wire = [transfer_ms(cluster, parallel, rank_of_stage[s], rank_of_stage[s + 1], costs[s].output_bytes)
                    if s + 1 < num_stages else 0.0 for s in range(num_stages)]
        self.preds: list[list[tuple[int, float]]] = [[] for _ in self.ops]

        def edge(a: Op, b: Op, lag: float) -> None:
            ia, ib = index.get(a), index.get(b)
            if ia is not None and ib is not None:
                self.preds[ib].append((ia, lag))

        for op in self.ops:
            s, m = op.stage, op.mb
            if op.kind is Kind.F:
                if s + 1 < num_stages:
                    edge(op, Op(s + 1, Kind.F, m), fwd_wire[s])
                else:
                    edge(op, Op(s, Kind.I, m), 0.0)
                    edge(op, Op(s, Kind.B, m), 0.0)
            else:
                if op.kind in (Kind.I, Kind.B) and s > 0:
                    for kind in (Kind.I, Kind.B):
                        edge(op, Op(s - 1, kind, m), fwd_wire[s - 1])
                if op.kind is Kind.I:
                    edge(op, Op(s, Kind.W, m), 0.0)
            # each stage runs each kind in microbatch order (the backward kinds I and B share one order)
            if op.kind in (Kind.I, Kind.B):
                for kind in (Kind.I, Kind.B):
                    edge(op, Op(s, kind, m + 1), 0.0)
            else:
                edge(op, Op(s, op.kind, m + 1), 0.0)
        # memory (with keep_memory): a stage never holds more microbatches' activations than it
        # did in the given order (from F until the W or B that frees them), so pulling forwards
        # early cannot take a plan past its memory: F(s, m) waits for the release of
        # F(s, m - most[s])
        most = _most_in_flight(schedule) if keep_memory else {}
        for op in self.ops:
            if op.kind is Kind.F and op.stage in most and op.mb >= most[op.stage]:
                for kind in (Kind.W, Kind.B):
                    edge(Op(op.stage, kind, op.mb - most[op.stage]), op, 0.0)
        self.succs: list[list[tuple[int, float]]] = [[] for _ in self.ops]
        for b, preds in enumerate(self.preds):
            for a, lag in preds:
                self.succs[a].append((b, lag))


def _most_in_flight(schedule: Sequence[Sequence[Op]]) -> dict[int, int]:
    """Per stage, the most microbatches whose activations it holds at once in ``schedule``'s
    order (forwards run, their W or B not yet)."""
    held: dict[int, int] = {}
    most: dict[int, int] = {}
    for rank_ops in schedule:
        for op in rank_ops:
            if op.kind is Kind.F:
                held[op.stage] = held.get(op.stage, 0) + 1
                most[op.stage] = max(most.get(op.stage, 0), held[op.stage])
            elif op.kind in (Kind.W, Kind.B):
                held[op.stage] -= 1
    return most


def _serial_sgs(dur: Sequence[float], rank: Sequence[int], preds: Sequence[Sequence[tuple[int, float]]],
                succs: Sequence[Sequence[tuple[int, float]]], priority: Sequence[float], num_ranks: int) -> list[float]:
    """Start times: ops taken in ``priority`` order (lowest first) among those whose
    predecessors are placed, each at the earliest time its inputs allow, in the first gap of
    its rank long enough to hold it."""
    n = len(dur)
    start = [0.0] * n
    missing = [len(p) for p in preds]
    heap = [(priority[i], i) for i in range(n) if missing[i] == 0]
    heapq.heapify(heap)
    starts: list[list[float]] = [[] for _ in range(num_ranks)]  # busy intervals per rank, by start
    ends: list[list[float]] = [[] for _ in range(num_ranks)]
    placed = 0
    while heap:
        _, i = heapq.heappop(heap)
        earliest = 0.0
        for a, lag in preds[i]:
            t = start[a] + dur[a] + lag
            if t > earliest:
                earliest = t
        r, d = rank[i], dur[i]
        s_list, e_list = starts[r], ends[r]
        k = bisect.bisect_right(e_list, earliest)  # first interval ending after `earliest`
        t = earliest
        while k < len(s_list) and s_list[k] < t + d - 1e-9:
            if e_list[k] > t:
                t = e_list[k]
            k += 1
        s_list.insert(k, t)
        e_list.insert(k, t + d)
        start[i] = t
        placed += 1
        for b, _ in succs[i]:
            missing[b] -= 1
            if missing[b] == 0:
                heapq.heappush(heap, (priority[b], b))
    if placed != n:
        raise ValueError("the schedule's dataflow has a cycle")
    return start


def justify(schedule: Sequence[Sequence[Op]], rank_of_stage: Sequence[int], costs: Sequence[StageCost], *,
            cluster: Cluster, parallel: Parallel, rounds: int = 3,
            keep_memory: bool = True) -> tuple[list[list[Op]], float]:
    """The per-rank op lists after up to ``rounds`` right-then-left justifications of
    ``schedule``'s order, and their makespan in the model above (``schedule``'s own order and
    makespan when justification finds nothing shorter). ``keep_memory``: no stage holds more
    microbatches in flight than in ``schedule``; without it, Ws may be deferred and forwards
    pulled ahead as far as the dataflow allows, for plans with memory to spare."""
    problem = _Problem(schedule, rank_of_stage, costs, cluster, parallel, keep_memory)
    n = len(problem.ops)
    num_ranks = parallel.pp
    # the given order's own times: each op after its rank's previous op and its inputs
    position = [float(j) for rank_ops in schedule for j in range(len(rank_ops))]
    order_preds = [list(p) for p in problem.preds]
    for i in range(1, n):
        if position[i] > 0:  # not a rank's first op: it follows the op before it
            order_preds[i].append((i - 1, 0.0))
    order_succs: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    for b, preds in enumerate(order_preds):
        for a, lag in preds:
            order_succs[a].append((b, lag))
    start = _serial_sgs(problem.dur, problem.rank, order_preds, order_succs, position, num_ranks)
    best_span = max((start[i] + problem.dur[i] for i in range(n)), default=0.0)
    best_start = start
    for _ in range(rounds):
        finish = [start[i] + problem.dur[i] for i in range(n)]
        # right-justify: the mirrored problem (edges reversed), latest finishers first
        mirrored = _serial_sgs(problem.dur, problem.rank, problem.succs, problem.preds, [-f for f in finish], num_ranks)
        span = max((mirrored[i] + problem.dur[i] for i in range(n)), default=0.0)
        right = [span - (mirrored[i] + problem.dur[i]) for i in range(n)]
        start = _serial_sgs(problem.dur, problem.rank, problem.preds, problem.succs, right, num_ranks)
        span = max((start[i] + problem.dur[i] for i in range(n)), default=0.0)
        if span < best_span - 1e-9:
            best_span, best_start = span, start
        else:
            break
    out: list[list[tuple[float, int]]] = [[] for _ in range(num_ranks)]
    for i in range(n):
        out[problem.rank[i]].append((best_start[i], i))
    return [[problem.ops[i] for _, i in sorted(rank_ops)] for rank_ops in out], best_span
