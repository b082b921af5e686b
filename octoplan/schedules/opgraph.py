"""The model an op order is scheduled in: ops as a graph with time lags.

An op order is a resource-constrained schedule: every rank runs one op at a time (a unary
resource), and dataflow ties ops together with time lags (an output is usable after its
transfer). The model is the simulator's (FORMATS.md section 7) without link contention: an op lasts
its stage's time plus the cluster's per-op overhead; a transfer between ranks adds latency +
bytes / bandwidth. Each stage runs its forwards, its backwards (I or B) and its weight
gradients in microbatch order, as every baseline schedule and every octoplan order does. With
``keep_memory`` a stage never holds more microbatches' activations at once (from F until the
W or B that frees them) than in a given order.

:mod:`octoplan.schedules.justify` repairs orders in this model; :mod:`octoplan.schedules.exact`
solves it with CP-SAT for a proven bound.
"""

from __future__ import annotations

import bisect
import heapq
from typing import Sequence

from octoplan.costs import StageCost, transfer_ms
from octoplan.ops import Kind, Op
from octoplan.plan import Cluster, Parallel

__all__ = ["OpGraph", "heads_and_tails", "most_in_flight", "serial_schedule"]


class OutOfMicrobatchOrder(ValueError):
    """A schedule in which some stage runs a kind's microbatches out of order: it may run, but
    it lies outside this model, whose edges keep each stage's microbatches in order."""


def check_microbatch_order(schedule: Sequence[Sequence[Op]]) -> None:
    """Raise :class:`OutOfMicrobatchOrder` naming the first op that comes before an earlier
    microbatch's op of its stage and kind (I and B sharing one order) on its rank."""
    for rank, rank_ops in enumerate(schedule):
        last: dict[tuple[int, str], Op] = {}
        for op in rank_ops:
            key = (op.stage, "backward" if op.kind in (Kind.I, Kind.B) else op.kind.value)
            before = last.get(key)
            if before is not None and before.mb > op.mb:
                raise OutOfMicrobatchOrder(f"rank {rank} runs {before} before {op}: microbatch {before.mb} of stage "
                                           f"{op.stage} before microbatch {op.mb}")
            last[key] = op


class OpGraph:
    """A plan's ops as indices: duration, rank, and predecessor edges with their transfer lags."""

    def __init__(self, schedule: Sequence[Sequence[Op]], rank_of_stage: Sequence[int], costs: Sequence[StageCost],
                 cluster: Cluster, parallel: Parallel, keep_memory: bool):
        check_microbatch_order(schedule)
        self.ops: list[Op] = [op for rank_ops in schedule for op in rank_ops]
        self.num_ranks = len(schedule)
        # each op's place in its rank's list of the order the graph is built from
        self.position: list[float] = [float(j) for rank_ops in schedule for j in range(len(rank_ops))]
        index = {op: i for i, op in enumerate(self.ops)}
        overhead = cluster.op_overhead_us / 1000.0
        num_stages = len(rank_of_stage)
        self.rank = [rank_of_stage[op.stage] for op in self.ops]
        op_ms = [{Kind.F: c.forward_ms, Kind.I: c.backward_input_ms, Kind.W: c.backward_weight_ms,
                  Kind.B: c.b_ms} for c in costs]
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
        # early cannot take a plan past its memory. F(s, m) waits for the release of
        # microbatch m - most[s]; with the edges F(s, m - 1) -> F(s, m), all releases up to
        # that microbatch's have then happened. A stage that fuses some backwards and splits
        # others may release out of microbatch order (microbatch 1 with its B before
        # microbatch 0's W), and that edge can then point backwards in the given order (a
        # cycle). Such a stage keeps its releases in their given order instead, and F(s, m)
        # waits for its (m - most[s])-th release (from 0): m + 1 - most[s] have happened.
        if keep_memory:
            most = most_in_flight(schedule)
            releases: dict[int, list[Op]] = {}
            for op in self.ops:  # one rank's ops in its order, then the next rank's
                if op.kind in (Kind.W, Kind.B):
                    releases.setdefault(op.stage, []).append(op)
            for stage, ops in releases.items():
                k = most.get(stage, 0)
                freed = {op.mb: op for op in ops}
                waits = [(freed[m - k], Op(stage, Kind.F, m)) for m in range(k, len(ops))]
                if any(index[release] > index[forward] for release, forward in waits):  # one rank's ops, in its order
                    for a, b in zip(ops, ops[1:]):
                        edge(a, b, 0.0)
                    waits = [(ops[m - k], forward) for m, (_, forward) in enumerate(waits, start=k)]
                for release, forward in waits:
                    edge(release, forward, 0.0)
        self.succs: list[list[tuple[int, float]]] = [[] for _ in self.ops]
        for b, preds in enumerate(self.preds):
            for a, lag in preds:
                self.succs[a].append((b, lag))

    def with_order(self) -> tuple[list[list[tuple[int, float]]], list[list[tuple[int, float]]]]:
        """Predecessor and successor edges with the order's own sequence added: each op after
        its rank's previous op."""
        preds = [list(p) for p in self.preds]
        for i, place in enumerate(self.position):
            if place > 0:  # not a rank's first op (ops are indexed rank by rank)
                preds[i].append((i - 1, 0.0))
        succs: list[list[tuple[int, float]]] = [[] for _ in preds]
        for b, edges in enumerate(preds):
            for a, lag in edges:
                succs[a].append((b, lag))
        return preds, succs

    def order_times(self) -> list[float]:
        """The start times of the order the graph is built from: every op as early as its
        inputs and its rank's previous op allow."""
        preds, succs = self.with_order()
        return serial_schedule(self.dur, self.rank, preds, succs, self.position, self.num_ranks)

    def makespan(self, start: Sequence[float]) -> float:
        return max((t + d for t, d in zip(start, self.dur)), default=0.0)


def heads_and_tails(graph: OpGraph, prev: Sequence[int] | None = None,
                    nxt: Sequence[int] | None = None) -> tuple[list[float], list[float], list[int]]:
    """Every op's head (the longest path before its start) and tail (after its end), and its
    place in a topological order, over the dataflow plus, if given, rank orders: ``prev[i]``
    and ``nxt[i]`` are the ops just before and after op i on its rank (-1: none).
    ``ValueError`` if the edges close a cycle."""
    n = len(graph.dur)
    no_order = [-1] * n
    prev, nxt = prev or no_order, nxt or no_order
    missing = [len(p) + (prev[i] >= 0) for i, p in enumerate(graph.preds)]
    order = [i for i in range(n) if missing[i] == 0]
    for i in order:  # grows while it is walked
        for b, _ in graph.succs[i]:
            missing[b] -= 1
            if missing[b] == 0:
                order.append(b)
        b = nxt[i]
        if b >= 0:
            missing[b] -= 1
            if missing[b] == 0:
                order.append(b)
    if len(order) != n:
        raise ValueError("the ops' dataflow and rank orders close a cycle")
    head = _longest(order, graph.preds, prev, graph.dur)
    tail = _longest(order[::-1], graph.succs, nxt, graph.dur, backward=True)
    place = [0] * n
    for k, i in enumerate(order):
        place[i] = k
    return head, tail, place


def _longest(order: Sequence[int], edges: Sequence[Sequence[tuple[int, float]]], extra: Sequence[int],
             dur: Sequence[float], *, backward: bool = False) -> list[float]:
    """Longest paths to each op along ``order``, over ``edges`` (op, lag) and the one
    ``extra`` edge of lag 0 per op: heads over predecessors, or (``backward``) tails over
    successors with the order reversed. Tails are summed from the far end (lag + op + tail),
    as in the one-machine bound: the same floats, so ties between equal paths break alike."""
    value = [0.0] * len(dur)
    for i in order:
        best = 0.0
        for j, lag in edges[i]:
            v = lag + dur[j] + value[j] if backward else value[j] + dur[j] + lag
            if v > best:
                best = v
        j = extra[i]
        if j >= 0 and value[j] + dur[j] > best:
            best = value[j] + dur[j]
        value[i] = best
    return value


def most_in_flight(schedule: Sequence[Sequence[Op]]) -> dict[int, int]:
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


def serial_schedule(dur: Sequence[float], rank: Sequence[int], preds: Sequence[Sequence[tuple[int, float]]],
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
