"""Probe: loops and zigzags of 2-3 stages per rank whose cut points are start-aware, ordered by
a critical-path list scheduler, on the suite's lowest-efficiency workloads.

Cuts (CP-SAT, exact for the model): minimise T with, for every rank r,
    aware x (F + I of the layers before r's first stage) + M x (r's F + I + W per microbatch) <= T,
the first term standing for the rank's wait for the first microbatch and for the last one's
backward beneath it. Each layout is then ordered by the policy scheduler (warm-up depths 1-3,
with and without the gap, the best justified), by the shifting-bottleneck procedure, and by a
list scheduler that runs, on each free rank, the released op with the longest tail (its path to
the iteration's end; :mod:`octoplan.schedules.list_order`), justified; the simulator prices
every order, which must fit memory. With ``--tune`` the layouts and their orders are also given
to the tuner as one more seed family, beside the same tune without it, both with
``--max-plans``.

    cd benchmarks && ../.venv/bin/python probe_start_aware_loops.py --only jamba-v0.1 deepseek-v3 [--tune 2500]
"""

from __future__ import annotations

import argparse

from bench_tuner import SUITE, _profile_and_cluster, run_one
from ortools.sat.python import cp_model

import bench_tuner
from octoplan.costs import cheaper_backward, to_ticks
from octoplan.schedules.exact import relaxation_bound
from octoplan.tuner.seeds import SEED_FAMILIES
from octoplan.tuner.seeds.base import SeedFamily, with_policies
from octoplan.tuner.space import LONGEST_TAIL, Candidate, Config, Evaluator

SETTINGS = [(True, depth, gap) for depth in (1.0, 2.0, 3.0) for gap in (False, True)]
SPECS = [("loop", 3, 1.0), ("loop", 3, 0.75), ("zigzag", 3, 1.0), ("loop", 2, 1.0), ("zigzag", 2, 1.0)]


def rank_of(shape: str, pp: int, stage: int) -> int:
    chunk, i = divmod(stage, pp)
    return i if shape == "loop" or chunk % 2 == 0 else pp - 1 - i


def start_aware_cuts(profile, pp: int, microbatches: int, shape: str, chunks: int, aware: float, limit_s: float = 20.0):
    layers = profile.layers
    num_stages = chunks * pp
    if num_stages > len(layers):
        return None
    work, lead = [0], [0]
    for layer in layers:
        work.append(work[-1] + to_ticks(layer.forward_ms + sum(cheaper_backward(layer))))
        lead.append(lead[-1] + to_ticks(aware * (layer.forward_ms + layer.backward_input_ms)))
    m = cp_model.CpModel()
    cut = [m.NewIntVar(0, len(layers), f"cut{s}") for s in range(num_stages + 1)]
    m.Add(cut[0] == 0)
    m.Add(cut[-1] == len(layers))
    for s in range(num_stages):
        m.Add(cut[s + 1] >= cut[s] + 1)
    at = [m.NewIntVar(0, work[-1], f"work{s}") for s in range(num_stages + 1)]
    for s in range(num_stages + 1):
        m.AddElement(cut[s], work, at[s])
    top = m.NewIntVar(0, 64 * work[-1], "top")
    for r in range(pp):
        mine = [s for s in range(num_stages) if rank_of(shape, pp, s) == r]
        wait = m.NewIntVar(0, lead[-1], f"lead{r}")
        m.AddElement(cut[mine[0]], lead, wait)
        m.Add(wait + microbatches * sum(at[s + 1] - at[s] for s in mine) <= top)
    m.Minimize(top)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = limit_s
    solver.parameters.num_workers = 1
    if solver.Solve(m) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return tuple(solver.Value(c) for c in cut), tuple(rank_of(shape, pp, s) for s in range(num_stages))


def orders(ev: Evaluator, config: Config, bounds, ranks, origin: str) -> list[tuple[str, Candidate]]:
    """The layout's candidates: policy orders, their justified and shifting-bottleneck orders,
    and the longest-tail-first order with its justified ones."""
    policy = with_policies(config, bounds, ranks, origin, settings=SETTINGS)
    best = min(policy, key=lambda c: ev.score(c).score)
    out = [("policy", c) for c in policy] + [("justified", c) for c in ev.justified(best)]
    out += [("shifting bottleneck", c) for c in ev.reordered(best)]
    out += [("longest tail first", c) for c in ev.reordered(best, LONGEST_TAIL)]
    return out


def workloads(names):
    """For each suite workload named: (workload, split-block profile, cluster, evaluator, config)."""
    for w in [w for w in SUITE if w.name in names]:
        profile, cluster = _profile_and_cluster(w, split_blocks=True)
        yield w, profile, cluster, Evaluator(profile, cluster), Config(pp=w.pp, dp=w.gpus // w.pp, microbatches=w.microbatches)


def best_by_kind(ev: Evaluator, found: list[tuple[str, Candidate]]) -> dict[str, float]:
    """The fastest iteration of each kind of order in ``found`` (:func:`orders`) that fits memory."""
    best: dict[str, float] = {}
    for kind, cand in found:
        scored = ev.score(cand)
        if scored.fits:
            best[kind] = min(best.get(kind, float("inf")), scored.iteration_ms)
    return best


def tune_beside(w, family: SeedFamily, max_plans: int) -> None:
    """Tune ``w`` on split blocks with ``max_plans``, without and with ``family`` among the seed
    families (after the first three; in place of the tuner's family of the same name, which
    both tunes go without), and print both."""
    others = tuple(f for f in SEED_FAMILIES if f.name != family.name)
    for label, families in (("without", others), ("with", (*others[:3], family, *others[3:]))):
        bench_tuner.SEED_FAMILIES = families
        r = run_one(w, time_limit=3600, split_blocks=True, max_plans=max_plans)
        print(f"{w.name} tune --max-plans {max_plans} {label} these seeds: {r['tuned_ms']:.1f} ms "
              f"(efficiency {r['efficiency']:.3f}), from {r['origin']}", flush=True)


class StartAwareLoops(SeedFamily):
    name = "start-aware loops (probe)"

    def seeds(self, ctx, config, earlier):
        out = []
        for shape, chunks, aware in SPECS:
            layout = start_aware_cuts(ctx.profile, config.pp, config.microbatches, shape, chunks, aware)
            if layout is not None:
                out += [c for _, c in orders(ctx.evaluator, config, *layout, f"start-aware {shape} x{chunks}")]
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", default=["jamba-v0.1", "deepseek-v3"])
    p.add_argument("--tune", type=int, default=0, metavar="MAX_PLANS", help="also tune with and without these seeds")
    args = p.parse_args()
    for w, profile, cluster, ev, config in workloads(args.only):
        for shape, chunks, aware in SPECS:
            layout = start_aware_cuts(profile, w.pp, w.microbatches, shape, chunks, aware)
            if layout is None:
                continue
            found = orders(ev, config, *layout, shape)
            c0 = found[0][1]
            relax = relaxation_bound(ev.schedule(c0), list(c0.ranks), ev.costs(c0), cluster=cluster, parallel=config.parallel())
            best = best_by_kind(ev, found)
            print(f"{w.name} {shape} x{chunks} aware {aware}: relaxation {relax:.1f} ms; "
                  + ", ".join(f"{k} {v:.1f}" for k, v in best.items()), flush=True)
        if args.tune:
            tune_beside(w, StartAwareLoops(), args.tune)


if __name__ == "__main__":
    main()
