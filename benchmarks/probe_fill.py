"""Probe: can the pipeline's fill prove an efficiency cap, and do thin first stages pay?

    .venv/bin/python benchmarks/probe_fill.py assign --only deepseek-v3 jamba-v0.1 --limit 60
    .venv/bin/python benchmarks/probe_fill.py thin-front --only jamba-v0.1

``assign``: the least makespan of any assignment of the profile's layers to the pp ranks
(contiguity relaxed, so every layout is one) when rank r cannot start before the first
microbatch's forward reaches its first layer: minimize T with T >= Fpre(first layer of r) +
M x (F + the cheaper backward) of r's layers. CP-SAT, one worker, a deterministic-time limit.
Its proven bound is a cap on every plan's efficiency (FORMATS.md section 7's lower bound over
it); the assignment it finds is not a layout (its ranks hold many runs), so it is no plan.

``thin-front``: each rank r holds layer r alone as a first stage (so every rank has forwards
to run during the fill), then a loop of two stages per rank over the rest; the cut points are
climbed (one boundary +-1 at a time) on the one-machine relaxation of the dataflow
(``octoplan.schedules.exact``), and the climbed layout's policy and justified orders simulated.
"""

from __future__ import annotations

import argparse
import time

from ortools.sat.python import cp_model

from bench_tuner import SUITE, _profile_and_cluster
from octoplan.costs import cheaper_backward, lower_bound_ms, to_ticks
from octoplan.schedules.exact import relaxation_bound
from octoplan.tuner.placed_cuts import loop_cuts
from octoplan.tuner.seeds.base import with_policies
from octoplan.tuner.space import Config, Evaluator


def fill_aware_assignment(profile, pp: int, microbatches: int, limit_s: float) -> tuple[str, float, float]:
    """(status, best makespan found, proven lower bound), in ms."""
    work = [microbatches * to_ticks(l.forward_ms + sum(cheaper_backward(l))) for l in profile.layers]
    before = [0]
    for layer in profile.layers:
        before.append(before[-1] + to_ticks(layer.forward_ms) - 1)  # ticks rounded down: a bound
    n = len(work)
    model = cp_model.CpModel()
    holds = [[model.new_bool_var("") for _ in range(pp)] for _ in range(n)]
    first = [[model.new_bool_var("") for _ in range(pp)] for _ in range(n)]
    for row in holds:
        model.add_exactly_one(row)
    finish = model.new_int_var(0, sum(work) + before[-1], "finish")
    first_layer, used = [], []
    for r in range(pp):
        model.add_at_most_one(first[l][r] for l in range(n))  # a rank may hold nothing
        seen = 0
        for l in range(n):
            seen = seen + first[l][r]
            model.add(holds[l][r] <= seen)  # no layer before the rank's first
            model.add_implication(first[l][r], holds[l][r])
        model.add(finish >= sum(max(0, before[l]) * first[l][r] for l in range(n)) + sum(work[l] * holds[l][r] for l in range(n)))
        used.append(model.new_bool_var(f"used{r}"))
        model.add(sum(first[l][r] for l in range(n)) == used[r])
        first_layer.append(sum(l * first[l][r] for l in range(n)))
    model.add(first[0][0] == 1)
    for r in range(pp - 1):  # ranks are interchangeable: the working ones first, by first layer
        model.add(used[r] >= used[r + 1])
        model.add(first_layer[r + 1] >= first_layer[r] + 1).only_enforce_if(used[r + 1])
    model.minimize(finish)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = limit_s
    status = solver.solve(model)
    return solver.status_name(status), solver.objective_value / 1000, solver.best_objective_bound / 1000


def thin_front(profile, cluster, w, seconds: float) -> None:
    ev = Evaluator(profile, cluster)
    config = Config(pp=w.pp, dp=w.gpus // w.pp, microbatches=w.microbatches)
    p = w.pp
    work = [to_ticks(l.forward_ms + sum(cheaper_backward(l))) for l in profile.layers]
    body = loop_cuts(work[p:], p)
    bounds = list(range(p)) + [p + b for b in body.bounds]
    ranks = tuple(range(p)) * 3

    def relaxation(cuts) -> float:
        cand = with_policies(config, tuple(cuts), ranks, "thin front")[0]
        return relaxation_bound(ev.schedule(cand), ranks, ev.costs(cand), cluster=cluster, parallel=config.parallel())

    best = relaxation(bounds)
    print(f"{w.name}: thin front + the rest's best loop cut: relaxation {best:.1f} ms", flush=True)
    start, improved = time.perf_counter(), True
    while improved and time.perf_counter() - start < seconds:
        improved = False
        for k in range(1, len(bounds) - 1):
            for step in (-1, 1):
                cuts = bounds[:]
                cuts[k] += step
                if cuts[k - 1] < cuts[k] < cuts[k + 1]:
                    found = relaxation(cuts)
                    if found < best - 1e-6:
                        bounds, best, improved = cuts, found, True
    print(f"{w.name}: climbed on the relaxation: {best:.1f} ms, cuts {bounds}", flush=True)
    for cand in with_policies(config, tuple(bounds), ranks, "thin front"):
        simulated = min(ev.score(c).iteration_ms for c in [cand] + ev.justified(cand))
        print(f"  {cand.origin}: best of its policy and justified orders {simulated:.1f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probe", choices=("assign", "thin-front"))
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--limit", type=float, default=60.0, help="assign: CP-SAT's deterministic seconds; thin-front: the climb's")
    args = parser.parse_args()
    for w in SUITE:
        if args.only and w.name not in args.only:
            continue
        profile, cluster = _profile_and_cluster(w, split_blocks=True)
        if args.probe == "thin-front":
            thin_front(profile, cluster, w, args.limit)
            continue
        ideal = lower_bound_ms(profile, pp=w.pp, microbatches=w.microbatches)
        began = time.perf_counter()
        status, found, proven = fill_aware_assignment(profile, w.pp, w.microbatches, args.limit)
        print(f"{w.name}: lower bound {ideal:.1f} ms; fill-aware assignment found {found:.1f} ms "
              f"(efficiency {ideal / found:.3f}), proven >= {proven:.1f} (efficiency <= {ideal / proven:.3f}); "
              f"{status}, {time.perf_counter() - began:.0f} s", flush=True)


if __name__ == "__main__":
    main()
