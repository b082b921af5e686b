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

``--free-up-leg`` (session 27): the down leg stays on ranks 0..p-1 in order, but CP-SAT may put
each stage of the up leg on any rank (a permutation), so a rank's two stages need not be
mirror images; the same objective. ``--relaxation-climb S``: before scheduling, climb the
layout for S seconds by the one-machine relaxation bound of its ops (any order, any memory;
:func:`octoplan.schedules.exact.relaxation_bound`, one pass over the graph): shift a cut
point, move a stage to another rank or swap two stages' ranks, at most 3 stages per rank.

Run: .venv/bin/python benchmarks/probe_start_aware_v.py [--workload deepseek-v3] [--cpsat 90] [--climb 60] [--bound 40]
     [--free-up-leg] [--relaxation-climb 120]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from ortools.sat.python import cp_model

from octoplan.arch import analytic_profile
from octoplan.costs import to_ticks
from octoplan.ops import Kind, Op
from octoplan.partition import balanced_partition
from octoplan.plan import Cluster
from octoplan.profile import Profile
from octoplan.schedules import v_placement
from octoplan.schedules.exact import order_bound, relaxation_bound
from octoplan.schedules.policy import default_policies
from octoplan.tuner.search import TuneOptions, _Search
from octoplan.tuner.space import Candidate, Config, Evaluator

sys.path.insert(0, str(Path(__file__).parent))
from bench_tuner import SUITE  # noqa: E402  (a sibling script, not a package)


def start_aware_cuts(profile: Profile, ranks: tuple[int, ...], microbatches: int, *,
                     time_limit_s: float = 10.0, free_up_leg: bool = False) -> tuple[tuple[int, ...], tuple[int, ...], float]:
    """(cut points, the rank of each stage, the busiest rank's load in ms). ``ranks`` is a V;
    with ``free_up_leg`` its up leg (stages p..2p-1) may be placed on any permutation of the
    ranks, hinted with the V's mirror."""
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
    pp = num_stages // 2
    # put[i][r]: up-leg stage pp + i on rank r (fixed to the V's mirror unless free_up_leg)
    put = [[m.new_bool_var("") for _ in range(pp)] for _ in range(pp)]
    for i in range(pp):
        m.add_exactly_one(put[i])
        m.add_exactly_one(put[j][i] for j in range(pp))
        for r in range(pp):
            if free_up_leg:
                m.add_hint(put[i][r], r == ranks[pp + i])
            else:
                m.add(put[i][r] == (r == ranks[pp + i]))
    for r in range(pp):
        down = next(s for s in range(pp) if ranks[s] == r)  # a V's down leg holds one stage per rank
        up = []
        for i in range(pp):
            held = m.new_int_var(0, work[-1], "")
            m.add(held == work_at[pp + i + 1] - work_at[pp + i]).only_enforce_if(put[i][r])
            m.add(held == 0).only_enforce_if(~put[i][r])
            up.append(held)
        load = work_at[down + 1] - work_at[down] + sum(up)
        m.add(load <= busiest)
        m.add(microbatches * load + fwd_at[down] <= finish)
    m.minimize(100 * finish + busiest)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = time_limit_s
    status = solver.solve(m)
    print(f"CP-SAT {solver.status_name(status)}: finish {solver.value(finish) / 1000:.1f} ms (bound "
          f"{solver.best_objective_bound / 100 / 1000:.1f})")
    placed = tuple(ranks[:pp]) + tuple(next(r for r in range(pp) if solver.value(put[i][r])) for i in range(pp))
    return tuple(solver.value(c) for c in cut), placed, solver.value(busiest) / 1000


def relaxation(evaluator: Evaluator, cand: Candidate) -> float:
    """The one-machine relaxation bound of ``cand``'s layout with every B split into I and W:
    no order of it, whatever its memory, is faster."""
    pp, microbatches = cand.config.pp, cand.config.microbatches
    schedule: list[list[Op]] = [[] for _ in range(pp)]
    for s, r in enumerate(cand.ranks):
        schedule[r] += [Op(s, kind, mb) for mb in range(microbatches) for kind in (Kind.F, Kind.I, Kind.W)]
    return relaxation_bound(schedule, cand.ranks, evaluator.costs(cand), cluster=evaluator.cluster,
                            parallel=cand.config.parallel())


def relaxation_climb(evaluator: Evaluator, cand: Candidate, seconds: float, *, chunks_max: int = 3) -> Candidate:
    """First-improvement climb of the layout by :func:`relaxation`: shift a cut point by a
    layer, move a stage to another rank, or swap two stages' ranks, in a seeded random order."""
    rng, deadline = random.Random(0), time.perf_counter() + seconds
    best, evaluations = relaxation(evaluator, cand), 0

    def layouts(bounds, ranks):
        for i in range(1, len(ranks)):
            for step in (-1, 1):
                yield bounds[:i] + (bounds[i] + step,) + bounds[i + 1:], ranks
        for i in range(len(ranks)):
            for j in range(i + 1, len(ranks)):
                if ranks[i] != ranks[j]:
                    swapped = list(ranks)
                    swapped[i], swapped[j] = swapped[j], swapped[i]
                    yield bounds, tuple(swapped)
            for r in range(cand.config.pp):
                if r != ranks[i]:
                    yield bounds, ranks[:i] + (r,) + ranks[i + 1:]

    def valid(bounds, ranks):
        held = [ranks.count(r) for r in range(cand.config.pp)]
        return all(b < c for b, c in zip(bounds, bounds[1:])) and 1 <= min(held) and max(held) <= chunks_max

    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        options = [(b, r) for b, r in layouts(cand.bounds, cand.ranks) if valid(b, r)]
        rng.shuffle(options)
        for bounds, ranks in options:
            if time.perf_counter() > deadline:
                break
            other = Candidate(cand.config, bounds, ranks, None, None, "relaxation climb")
            value, evaluations = relaxation(evaluator, other), evaluations + 1
            if value < best - 1e-9:
                best, cand, improved = value, other, True
                break
    print(f"relaxation climb: bound {best:.1f} ms after {evaluations} layouts")
    return cand


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--climb", type=float, default=60.0)
    parser.add_argument("--bound", type=float, default=40.0)
    parser.add_argument("--cpsat", type=float, default=10.0, help="seconds for the cut points")
    parser.add_argument("--workload", default="jamba-v0.1", choices=[w.name for w in SUITE])
    parser.add_argument("--free-up-leg", action="store_true", help="the up leg's stages on any permutation of the ranks")
    parser.add_argument("--relaxation-climb", type=float, default=0.0, metavar="SECONDS",
                        help="climb the layout by its one-machine relaxation bound before scheduling")
    args = parser.parse_args()
    w = next(w for w in SUITE if w.name == args.workload)
    if w.gpus != w.pp:
        parser.error(f"{w.name} has data parallelism; this probe places one pipeline")
    pp, microbatches = w.pp, w.microbatches
    profile = analytic_profile(w.arch, w.gpu, tp=w.tp, split_blocks=True)
    cluster = Cluster(gpus=pp, gpus_per_node=w.gpus_per_node, memory_gb=profile.device["memory_gb"])
    evaluator, config = Evaluator(profile, cluster), Config(pp, 1, microbatches)
    bounds, ranks, busiest = start_aware_cuts(profile, tuple(v_placement(pp, 2 * pp)), microbatches,
                                              time_limit_s=args.cpsat, free_up_leg=args.free_up_leg)
    print(f"start-aware V: busiest rank {busiest:.2f} ms (mean {sum(l.total_ms for l in profile.layers) / pp:.2f}); "
          f"up leg on ranks {ranks[pp:]}")
    layout = Candidate(config, bounds, ranks, None, None, "start-aware V")
    print(f"its relaxation bound: {relaxation(evaluator, layout):.1f} ms")
    if args.relaxation_climb > 0:
        layout = relaxation_climb(evaluator, layout, args.relaxation_climb)
        bounds, ranks = layout.bounds, layout.ranks
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
