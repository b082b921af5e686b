"""Probe: do randomized priorities find shorter orders than the longest-tail-first list scheduler?

    .venv/bin/python benchmarks/probe_list_priorities.py PLAN [--seconds 30] [--noise 0.05]

For PLAN's stages and placement, this rebuilds the op order with
:func:`octoplan.schedules.list_order.longest_tail_order`'s rule (whenever a rank is free, the
arrived op with the highest priority) many times, each time with every op's priority its tail
times 1 + U(-noise, noise), keeping the shortest order, with the in-flight limit of PLAN's order
and without it. Makespans are the order model's (:mod:`octoplan.schedules.opgraph`), printed
beside PLAN's own order and the one-machine relaxation bound of the layout; the plain
longest-tail-first order's peak memory is the simulator's.
"""

from __future__ import annotations

import argparse
import heapq
import random
import time
from pathlib import Path

from octoplan.cli import _load_plan_with_profile
from octoplan.costs import LayerTable, stage_costs
from octoplan.schedules.exact import relaxation_bound
from octoplan.schedules.list_order import longest_tail_order
from octoplan.schedules.opgraph import OpGraph, heads_and_tails
from octoplan.simulator import simulate


def list_makespan(graph: OpGraph, priority: list[float]) -> float:
    """The makespan of the non-delay list schedule that, whenever a rank is free, starts its
    arrived op of the highest ``priority`` (the rule of ``longest_tail_order`` with tails as
    priorities)."""
    n, num_ranks = len(graph.dur), graph.num_ranks
    missing = [len(p) for p in graph.preds]
    arrival = [0.0] * n
    coming: list[list[tuple[float, int]]] = [[] for _ in range(num_ranks)]
    arrived: list[list[tuple[float, int]]] = [[] for _ in range(num_ranks)]
    for i in range(n):
        if missing[i] == 0:
            heapq.heappush(coming[graph.rank[i]], (0.0, i))
    free = [0.0] * num_ranks
    makespan = 0.0
    for _ in range(n):
        best = None
        for r in range(num_ranks):
            while coming[r] and coming[r][0][0] <= free[r]:
                _, i = heapq.heappop(coming[r])
                heapq.heappush(arrived[r], (-priority[i], i))
            t = free[r] if arrived[r] else (coming[r][0][0] if coming[r] else None)
            if t is not None and (best is None or t < best[0]):
                best = (t, r)
        t, r = best
        while coming[r] and coming[r][0][0] <= t:
            _, i = heapq.heappop(coming[r])
            heapq.heappush(arrived[r], (-priority[i], i))
        _, i = heapq.heappop(arrived[r])
        free[r] = t + graph.dur[i]
        makespan = max(makespan, free[r])
        for b, lag in graph.succs[i]:
            arrival[b] = max(arrival[b], free[r] + lag)
            missing[b] -= 1
            if missing[b] == 0:
                heapq.heappush(coming[graph.rank[b]], (arrival[b], b))
    return makespan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("--seconds", type=float, default=30.0, help="per in-flight setting")
    parser.add_argument("--noise", type=float, default=0.05)
    args = parser.parse_args()
    plan, profile = _load_plan_with_profile(args.plan)
    costs = stage_costs(plan.stages, LayerTable(profile))
    ranks = [s.rank for s in plan.stages]
    schedule = [list(ops) for ops in plan.schedule]
    own = OpGraph(schedule, ranks, costs, plan.cluster, plan.parallel, True)
    bound = relaxation_bound(schedule, ranks, costs, cluster=plan.cluster, parallel=plan.parallel)
    print(f"{args.plan}: its order {own.makespan(own.order_times()):.1f} ms in the order model, "
          f"relaxation bound {bound:.1f} ms")
    for keep in (True, False):
        graph = OpGraph(schedule, ranks, costs, plan.cluster, plan.parallel, keep)
        _, tail, _ = heads_and_tails(graph)
        order, plain = longest_tail_order(schedule, ranks, costs, cluster=plan.cluster, parallel=plan.parallel,
                                          keep_memory=keep)
        run = simulate(plan.with_schedule(order), profile)
        best = list_makespan(graph, tail)
        assert abs(best - plain) < 1e-6, "the probe's list scheduler drifted from longest_tail_order"
        rng, tries, began = random.Random(0), 0, time.perf_counter()
        while time.perf_counter() - began < args.seconds:
            tries += 1
            best = min(best, list_makespan(graph, [x * (1 + rng.uniform(-args.noise, args.noise)) for x in tail]))
        print(f"  in flight {'kept' if keep else 'unbounded'}: longest tail first {plain:.1f} ms (peak "
              f"{max(run.peak_memory_bytes) / 1e9:.1f} GB, {'fits' if run.fits_memory else 'does not fit'}), "
              f"best of {tries} randomized {best:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
