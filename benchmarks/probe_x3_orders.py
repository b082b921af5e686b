"""Probe: can a better op order close the gap between a layout of three stages per rank and its
one-machine relaxation? Five searches from the best order the tuner's schedulers find.

The layout is one shape of the fill caps (:mod:`octoplan.tuner.fill_caps`; by default a loop of
3 stages per rank on jamba-v0.1), cut where CP-SAT puts the cut points in ``--cap-time``
deterministic seconds. It is ordered as in ``probe_start_aware_loops.orders`` (policies,
justified, shifting bottleneck, longest tail first), and the fastest order that fits memory is
the start of each search below, all in the order model of :mod:`octoplan.schedules.opgraph`
(in flight unbounded, as the relaxation is):

1. ``window``: large-neighbourhood search with CP-SAT. A window of ``--window`` ms slides over
   the schedule by half its width; the ops that start inside it are free, every rank keeps the
   order of its ops before and after the window, and CP-SAT minimises the makespan, then the
   free ops' end times (so that a window that cannot shorten the iteration still moves work
   earlier for the next one), from the current order as its hint, ``--window-limit`` seconds
   per window, for ``--lns`` seconds in all.
2. ``cp-sat``: CP-SAT's own search over every order (:func:`octoplan.schedules.exact.order_bound`)
   with ``--workers`` workers, whose portfolio includes its scheduling neighbourhoods, for
   ``--cp-sat`` seconds.
3. ``tails``: the longest-tail-first list scheduler again, with each op's tail taken over the
   current order's rank sequence as well as the dataflow (blended with the plain tail by a
   random weight), ``--rounds`` rounds, keeping the best.
4. ``active``: active schedules (Giffler and Thompson, 1960) instead of the non-delay ones of
   the longest-tail-first scheduler. The next op goes to the rank that can end one soonest
   (at c); of that rank's ops whose inputs are in, those that can start by e + alpha (c - e)
   (e: the earliest any of them can) compete, the longest tail first, so a rank may wait for a
   more urgent op rather than start the one at hand (alpha 0: non-delay; 1: every active
   schedule). Each alpha of ``ACTIVE_ALPHAS``, then the best alpha as the base of a pilot
   method (each choice between the ``--pilot-width`` longest tails settled by completing the
   schedule greedily after each) for ``--active`` seconds.
5. ``cuts``: the cut points climbed with the longest-tail-first order as the judge: every run
   of consecutive boundaries moved by one layer, kept where the order's makespan falls.

    cd benchmarks && ../.venv/bin/python probe_x3_orders.py --only jamba-v0.1 --shape loop --stages-per-rank 3
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import random
import time
from types import SimpleNamespace

from ortools.sat.python import cp_model
from probe_start_aware_loops import orders, workloads

from octoplan.costs import TICKS_PER_MS
from octoplan.schedules.exact import order_bound, relaxation_bound
from octoplan.schedules.list_order import longest_tail_order
from octoplan.schedules.opgraph import OpGraph, heads_and_tails
from octoplan.tuner.fill_caps import fill_cap, shape_ranks


def ticks(ms: float) -> int:
    return max(0, math.floor(ms * TICKS_PER_MS + 1e-6))


def neighbours(order: list[list[int]], n: int) -> tuple[list[int], list[int]]:
    """Each op's predecessor and successor on its rank in ``order`` (op indices per rank; -1: none)."""
    prev, nxt = [-1] * n, [-1] * n
    for rank_ops in order:
        for a, b in zip(rank_ops, rank_ops[1:]):
            prev[b], nxt[a] = a, b
    return prev, nxt


def times_of(graph, order: list[list[int]]) -> tuple[list[float], float]:
    """Start times of ``order`` as early as the dataflow allows (each op's head over the dataflow
    and the rank orders), and its makespan."""
    head, _, _ = heads_and_tails(graph, *neighbours(order, len(graph.dur)))
    return head, max((h + d for h, d in zip(head, graph.dur)), default=0.0)


def in_ticks(graph: OpGraph) -> SimpleNamespace:
    """``graph``'s durations and lags floored to CP-SAT's integer ticks, for its hint."""
    return SimpleNamespace(dur=[float(ticks(d)) for d in graph.dur],
                           preds=[[(a, float(ticks(lag))) for a, lag in edges] for edges in graph.preds],
                           succs=[[(b, float(ticks(lag))) for b, lag in edges] for edges in graph.succs])


def window_lns(graph: OpGraph, order: list[list[int]], *, width_ms: float, per_window_s: float, total_s: float):
    n = len(graph.dur)
    dur = [ticks(d) for d in graph.dur]
    integer = in_ticks(graph)
    preds = [[(a, ticks(lag)) for a, lag in edges] for edges in graph.preds]
    start, span = times_of(graph, order)
    began, low = time.perf_counter(), 0.0
    windows = improved = 0
    while time.perf_counter() - began < total_s:
        high = low + width_ms
        model = cp_model.CpModel()
        horizon = ticks(span) * 2 + 10
        s = [model.new_int_var(0, horizon, "") for _ in range(n)]
        for b, edges in enumerate(preds):
            for a, lag in edges:
                model.add(s[b] >= s[a] + dur[a] + lag)
        free: list[int] = []
        for rank_ops in order:
            before = [i for i in rank_ops if start[i] < low]
            inside = [i for i in rank_ops if low <= start[i] < high]
            after = [i for i in rank_ops if start[i] >= high]
            for run in (before, after):
                for a, b in zip(run, run[1:]):
                    model.add(s[b] >= s[a] + dur[a])
            for i in inside:
                if before:
                    model.add(s[i] >= s[before[-1]] + dur[before[-1]])
                if after:
                    model.add(s[after[0]] >= s[i] + dur[i])
            if inside:
                model.add_no_overlap([model.new_fixed_size_interval_var(s[i], dur[i], "") for i in inside])
            elif before and after:
                model.add(s[after[0]] >= s[before[-1]] + dur[before[-1]])
            free += inside
        makespan = model.new_int_var(0, horizon, "makespan")
        for i in range(n):
            model.add(makespan >= s[i] + dur[i])
        # the makespan first, then the free ops' ends: weigh the makespan above any sum of ends
        model.minimize(makespan * (len(free) + 1) + sum(s[i] for i in free))
        # the hint: the current order in the integer model (feasible there, as times are floored)
        hint_times, _ = times_of(integer, order)
        for i in range(n):
            model.add_hint(s[i], int(hint_times[i]))
        model.add_hint(makespan, max(int(hint_times[i]) + dur[i] for i in range(n)))
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = per_window_s
        solver.parameters.num_workers = 1
        windows += 1
        if solver.solve(model) in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            new = [sorted(rank_ops, key=lambda i: (solver.value(s[i]), start[i])) for rank_ops in order]
            new_start, new_span = times_of(graph, new)
            if new_span <= span + 1e-9:
                improved += new_span < span - 1e-6
                order, start, span = new, new_start, new_span
        low = low + width_ms / 2 if low + width_ms / 2 < span else 0.0
    return order, span, f"{windows} windows, {improved} shortened it"


def sequenced_tails(graph: OpGraph, order: list[list[int]], rounds: int, build, seed: int = 0) -> float:
    """The best makespan of ``rounds`` list orders, each built by ``build(tails)`` (one per op
    of ``graph``) with tails over the previous order's rank sequence, blended with the plain
    tails by a random weight."""
    n = len(graph.dur)
    _, plain, _ = heads_and_tails(graph)
    best = times_of(graph, order)[1]
    rng = random.Random(seed)
    current = order
    for _ in range(rounds):
        _, sequenced, _ = heads_and_tails(graph, *neighbours(current, n))
        weight = rng.random()
        current, span = build([weight * a + (1 - weight) * b for a, b in zip(plain, sequenced)])
        best = min(best, span)
    return best


ACTIVE_ALPHAS = (0.0, 0.1, 0.25, 0.4, 0.5, 0.75, 1.0)


class ActiveSchedule:
    """A partial active schedule of ``graph``'s ops (in flight unbounded): what each rank has
    run, when it is free, and which ops have all their inputs scheduled."""

    def __init__(self, graph: OpGraph):
        self.graph = graph
        self.missing = [len(p) for p in graph.preds]
        self.arrival = [0.0] * len(graph.dur)
        self.known: list[list[int]] = [[] for _ in range(graph.num_ranks)]
        for i, m in enumerate(self.missing):
            if m == 0:
                self.known[graph.rank[i]].append(i)
        self.free = [0.0] * graph.num_ranks
        self.order: list[list[int]] = [[] for _ in range(graph.num_ranks)]
        self.span, self.left = 0.0, len(graph.dur)

    def conflict(self, alpha: float) -> tuple[int, list[int]]:
        """The rank that can end an op soonest, and its ops that may start next."""
        dur, free, arrival = self.graph.dur, self.free, self.arrival
        end, rank = min((max(free[r], arrival[i]) + dur[i], r) for r in range(len(free)) for i in self.known[r])
        earliest = min(max(free[rank], arrival[i]) for i in self.known[rank])
        limit = earliest + alpha * (end - earliest) + 1e-9
        return rank, [i for i in self.known[rank] if max(free[rank], arrival[i]) <= limit]

    def run(self, rank: int, i: int) -> None:
        self.known[rank].remove(i)
        self.free[rank] = max(self.free[rank], self.arrival[i]) + self.graph.dur[i]
        self.span = max(self.span, self.free[rank])
        self.order[rank].append(i)
        self.left -= 1
        for b, lag in self.graph.succs[i]:
            self.arrival[b] = max(self.arrival[b], self.free[rank] + lag)
            self.missing[b] -= 1
            if self.missing[b] == 0:
                self.known[self.graph.rank[b]].append(b)

    def complete(self, tail: list[float], alpha: float) -> float:
        """Every op left, the longest tail first among those that compete; the makespan."""
        while self.left:
            rank, ops = self.conflict(alpha)
            self.run(rank, max(ops, key=lambda i: (tail[i], -i)))
        return self.span


def pilot(graph: OpGraph, tail: list[float], alpha: float, width: int, total_s: float) -> tuple[float, int]:
    """An active schedule whose choices between the ``width`` longest tails are each settled by
    completing the schedule greedily after every one of them (while ``total_s`` lasts); its
    makespan and the completions run."""
    state, began, rollouts = ActiveSchedule(graph), time.perf_counter(), 0
    while state.left:
        rank, ops = state.conflict(alpha)
        ops.sort(key=lambda i: (-tail[i], i))
        choice = ops[0]
        if len(ops) > 1 and time.perf_counter() - began < total_s:
            ends = []
            for i in ops[:width]:
                trial = _fork(state)
                trial.run(rank, i)
                ends.append((trial.complete(tail, alpha), ops.index(i)))
                rollouts += 1
            choice = ops[min(ends)[1]]
        state.run(rank, choice)
    return state.span, rollouts


def _fork(state: ActiveSchedule) -> ActiveSchedule:
    """A copy of ``state`` to run on (the graph shared)."""
    other = copy.copy(state)
    other.missing, other.arrival, other.free = state.missing[:], state.arrival[:], state.free[:]
    other.known = [ops[:] for ops in state.known]
    other.order = [ops[:] for ops in state.order]
    return other


def climb_cuts(ev, cand, ranks, schedule, cluster, parallel, num_layers: int, total_s: float):
    def judge(bounds):
        moved = dataclasses.replace(cand, bounds=tuple(bounds))
        return longest_tail_order(schedule, ranks, ev.costs(moved), cluster=cluster, parallel=parallel,
                                  keep_memory=False)[1]

    cuts, best = list(cand.bounds), judge(cand.bounds)
    began, tried, improved = time.perf_counter(), 0, True
    while improved and time.perf_counter() - began < total_s:
        improved = False
        for first in range(1, len(ranks)):
            for step in (-1, 1):
                for last in range(first, len(ranks)):
                    trial = cuts[:first] + [c + step for c in cuts[first:last + 1]] + cuts[last + 1:]
                    if trial[-1] != num_layers or any(a >= b for a, b in zip(trial, trial[1:])):
                        continue
                    tried += 1
                    span = judge(trial)
                    if span < best - 1e-9:
                        cuts, best, improved = trial, span, True
    return best, f"{tried} layouts tried"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", default=["jamba-v0.1"])
    p.add_argument("--shape", default="loop", choices=("loop", "zigzag"))
    p.add_argument("--stages-per-rank", type=int, default=3)
    p.add_argument("--cap-time", type=float, default=20.0, help="CP-SAT's deterministic seconds for the cut points")
    p.add_argument("--window", type=float, default=60.0, help="the window's width in ms")
    p.add_argument("--window-limit", type=float, default=5.0, help="CP-SAT's seconds per window")
    # each search is left out where its budget is 0
    p.add_argument("--lns", type=float, default=240.0, help="seconds of window search in all")
    p.add_argument("--cp-sat", type=float, default=120.0, help="seconds of CP-SAT's own search")
    p.add_argument("--workers", type=int, default=8, help="CP-SAT's workers")
    p.add_argument("--rounds", type=int, default=30, help="rounds of list orders on sequenced tails")
    p.add_argument("--active", type=float, default=300.0, help="seconds of the pilot method on active schedules")
    p.add_argument("--pilot-width", type=int, default=2, help="the longest tails the pilot method tries per choice")
    p.add_argument("--cuts", type=float, default=300.0, help="seconds of the cut climb")
    args = p.parse_args()
    for w, profile, cluster, ev, config in workloads(args.only):
        ranks = shape_ranks(args.shape, w.pp, args.stages_per_rank)
        cap = fill_cap(profile, cluster, microbatches=config.microbatches, ranks=ranks, time_limit_s=args.cap_time)
        if cap is None:
            print(f"{w.name}: no cut points in {args.cap_time:g} deterministic seconds")
            continue
        made = [(kind, c) for kind, c in orders(ev, config, cap.bounds, ranks, args.shape) if ev.score(c).fits]
        kind, cand = min(made, key=lambda item: ev.score(item[1]).iteration_ms)
        schedule, parallel = ev.schedule(cand), config.parallel()
        relax = relaxation_bound(schedule, list(ranks), ev.costs(cand), cluster=cluster, parallel=parallel)
        graph = OpGraph(schedule, list(ranks), ev.costs(cand), cluster, parallel, False)
        index = {op: i for i, op in enumerate(graph.ops)}
        order = [[index[op] for op in rank_ops] for rank_ops in schedule]
        given = times_of(graph, order)[1]
        print(f"{w.name} {args.shape} x{args.stages_per_rank}: fill figure {cap.found_ms:.1f} ms, relaxation "
              f"{relax:.1f}, best order {given:.1f} ({kind})", flush=True)
        if args.lns > 0:
            began = time.perf_counter()
            _, span, what = window_lns(graph, order, width_ms=args.window, per_window_s=args.window_limit, total_s=args.lns)
            print(f"  window: {span:.1f} ms ({what}, {time.perf_counter() - began:.0f} s)", flush=True)
        if args.cp_sat > 0:
            began = time.perf_counter()
            found = order_bound(schedule, list(ranks), ev.costs(cand), cluster=cluster, parallel=parallel,
                                time_limit_s=args.cp_sat, keep_memory=False, workers=args.workers)
            print(f"  cp-sat: {found.best_ms:.1f} ms ({found.status}, {args.workers} workers, no order below "
                  f"{found.lower_bound_ms:.1f}; {time.perf_counter() - began:.0f} s)", flush=True)
        if args.rounds > 0:
            began = time.perf_counter()
            def build(tails):
                ops, span = longest_tail_order(schedule, list(ranks), ev.costs(cand), cluster=cluster, parallel=parallel,
                                               keep_memory=False, tail=tails)
                return [[index[op] for op in rank_ops] for rank_ops in ops], span

            span = sequenced_tails(graph, order, args.rounds, build)
            print(f"  tails: {span:.1f} ms ({args.rounds} rounds, {time.perf_counter() - began:.0f} s)", flush=True)
        if args.active > 0:
            _, tail, _ = heads_and_tails(graph)
            spans = {alpha: ActiveSchedule(graph).complete(tail, alpha) for alpha in ACTIVE_ALPHAS}
            alpha = min(spans, key=spans.get)
            print("  active: " + ", ".join(f"alpha {a:g} {v:.1f} ms" for a, v in spans.items()), flush=True)
            began = time.perf_counter()
            span, rollouts = pilot(graph, tail, alpha, args.pilot_width, args.active)
            print(f"  pilot on alpha {alpha:g}: {span:.1f} ms ({rollouts} completions, "
                  f"{time.perf_counter() - began:.0f} s)", flush=True)
        if args.cuts > 0:
            began = time.perf_counter()
            span, what = climb_cuts(ev, cand, ranks, schedule, cluster, parallel, profile.num_layers, args.cuts)
            print(f"  cuts: {span:.1f} ms ({what}, {time.perf_counter() - began:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
