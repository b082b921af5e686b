"""A probe behind docs/BENCHMARKS.md ("Rank-balanced partitions for a fixed V"): does a V
layout whose cut points are chosen start-aware beat the tuner's plan of a suite workload
(jamba-v0.1 unless ``--workload`` names another of ``bench_tuner.SUITE``)?

CP-SAT chooses the 2p - 1 cut points of a V placement (rank r holds stages r and 2p - 1 - r) to
minimize max over ranks of (microbatches x the rank's F+I+W load + the forward time before its
first stage). The layout is then scheduled as the tuner would seed it (policy scheduler, three
knob settings, each justified, and each justified order rebuilt by the shifting-bottleneck
procedure and justified again), the best seed climbed for ``--climb`` seconds with the tuner's
moves, and
``order_bound`` gives the least makespan any op order of it can have.

Run: .venv/bin/python benchmarks/probe_start_aware_v.py [--workload deepseek-v3] [--cpsat 90] [--climb 60] [--bound 40]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ortools.sat.python import cp_model

from octoplan.arch import analytic_profile
from octoplan.costs import to_ticks
from octoplan.partition import balanced_partition
from octoplan.plan import Cluster
from octoplan.profile import Profile
from octoplan.schedules import v_placement
from octoplan.schedules.exact import order_bound
from octoplan.schedules.policy import default_policies
from octoplan.tuner.search import TuneOptions, _Search
from octoplan.tuner.space import Candidate, Config, Evaluator

sys.path.insert(0, str(Path(__file__).parent))
from bench_tuner import SUITE  # noqa: E402  (a sibling script, not a package)


def start_aware_cuts(profile: Profile, ranks: tuple[int, ...], microbatches: int, *,
                     time_limit_s: float = 10.0) -> tuple[tuple[int, ...], float]:
    num_layers, num_stages = profile.num_layers, len(ranks)
    work, fwd = [0], [0]  # prefix sums in ticks
    for layer in profile.layers:
        work.append(work[-1] + to_ticks(layer.total_ms))
        fwd.append(fwd[-1] + to_ticks(layer.forward_ms))
    m = cp_model.CpModel()
    cut = [m.new_constant(0)] + [m.new_int_var(s, num_layers - (num_stages - s), "") for s in range(1, num_stages)]
    cut.append(m.new_constant(num_layers))
    for s in range(num_stages):
        m.add(cut[s + 1] >= cut[s] + 1)
    # hinted with the balanced split: without it, 64 stages (deepseek-v3) end far from the optimum
    for s, (start, _) in enumerate(balanced_partition(profile, num_stages)[1:], start=1):
        m.add_hint(cut[s], start)
    work_at = [m.new_int_var(0, work[-1], "") for _ in cut]
    fwd_at = [m.new_int_var(0, fwd[-1], "") for _ in cut]
    for s, c in enumerate(cut):
        m.add_element(c, work, work_at[s])
        m.add_element(c, fwd, fwd_at[s])
    finish, busiest = m.new_int_var(0, microbatches * work[-1] + fwd[-1], ""), m.new_int_var(0, work[-1], "")
    for r in set(ranks):
        mine = [s for s, owner in enumerate(ranks) if owner == r]
        load = sum(work_at[s + 1] - work_at[s] for s in mine)
        m.add(load <= busiest)
        m.add(microbatches * load + fwd_at[min(mine)] <= finish)
    m.minimize(100 * finish + busiest)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = time_limit_s
    status = solver.solve(m)
    print(f"CP-SAT {solver.status_name(status)}: finish {solver.value(finish) / 1000:.1f} ms (bound "
          f"{solver.best_objective_bound / 100 / 1000:.1f})")
    return tuple(solver.value(c) for c in cut), solver.value(busiest) / 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--climb", type=float, default=60.0)
    parser.add_argument("--bound", type=float, default=40.0)
    parser.add_argument("--cpsat", type=float, default=10.0, help="seconds for the cut points")
    parser.add_argument("--workload", default="jamba-v0.1", choices=[w.name for w in SUITE])
    args = parser.parse_args()
    w = next(w for w in SUITE if w.name == args.workload)
    if w.gpus != w.pp:
        parser.error(f"{w.name} has data parallelism; this probe places one pipeline")
    pp, microbatches = w.pp, w.microbatches
    profile = analytic_profile(w.arch, w.gpu, tp=w.tp, split_blocks=True)
    cluster = Cluster(gpus=pp, gpus_per_node=w.gpus_per_node, memory_gb=profile.device["memory_gb"])
    evaluator, config = Evaluator(profile, cluster), Config(pp, 1, microbatches)
    ranks = tuple(v_placement(pp, 2 * pp))
    bounds, busiest = start_aware_cuts(profile, ranks, microbatches, time_limit_s=args.cpsat)
    print(f"start-aware V: busiest rank {busiest:.2f} ms (mean {sum(l.total_ms for l in profile.layers) / pp:.2f})")
    best = None
    for split, depth, gap in ((True, 1.0, False), (True, 2.0, False), (True, 2.0, True)):
        seed = Candidate(config, bounds, ranks, default_policies(ranks, pp, microbatches, split=split, depth=depth,
                                                                warmup_gap=gap), None, "start-aware V")
        justified = evaluator.justified(seed)
        for cand in [seed, *justified, *(r for j in justified for r in evaluator.reordered(j))]:
            scored = evaluator.score(cand)
            if scored.fits and (best is None or scored.iteration_ms < best[0]):
                best = (scored.iteration_ms, cand, seed)
    print(f"best seed, justified: {best[0]:.1f} ms")
    search = _Search(evaluator, TuneOptions(gpus=pp, time_limit_s=args.climb), None)
    search.climb(best[2], deadline=args.climb)  # from the policy seed: its knobs are moves too
    print(f"climb ({args.climb:g} s): {search.best_scored.iteration_ms:.1f} ms")
    plan = evaluator.plan(best[1])
    result = order_bound(plan.schedule, [s.rank for s in plan.stages], evaluator.costs(best[1]), cluster=cluster,
                         parallel=plan.parallel, time_limit_s=args.bound)
    print(f"order bound of the layout: no order beats {result.lower_bound_ms:.1f} ms ({result.status}, best found {result.best_ms:.1f})")


if __name__ == "__main__":
    main()
