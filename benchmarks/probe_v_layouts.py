"""Probes behind docs/BENCHMARKS.md ("Session 17"): two V layouts the tuner does not build,
priced in the orders the baselines generate for them.

``rank-balanced``: for every fixed-placement baseline, the cut points CP-SAT chooses so that
each *rank's* F+I+W is balanced (the baselines balance each stage), scored in the baseline's
generated order and justified.

``thin-leg``: a V (rank r holds stages r and 2p-1-r) whose down leg (stages 0..p-1) is cut from
the first layers only, so that the forward of the first microbatch reaches every rank sooner;
each leg is balanced on its own, so every rank still holds 1/p of the work. Every cut point
of the two legs is scored with ZB-V's and DualPipeV's orders (raw and justified) and with the
policy scheduler.

    .venv/bin/python benchmarks/probe_v_layouts.py rank-balanced [--only jamba-v0.1 gemma3-27b]
    .venv/bin/python benchmarks/probe_v_layouts.py thin-leg [--only deepseek-v3]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from ortools.sat.python import cp_model

from octoplan.partition import balanced_partition
from octoplan.schedules import get_schedule, v_placement
from octoplan.schedules.policy import default_policies
from octoplan.tuner.search import TuneOptions, _baseline_candidates, configs_for
from octoplan.tuner.space import Candidate, Evaluator, bounds_of

sys.path.insert(0, str(Path(__file__).parent))
from bench_tuner import SUITE, _profile_and_cluster  # noqa: E402  (a sibling script, not a package)


def rank_balanced_cuts(work: list[int], ranks: tuple[int, ...], num_ranks: int, *, time_limit_s: float = 5.0):
    """Cut points of ``len(ranks)`` contiguous stages minimizing the busiest rank's summed work."""
    prefix = [0]
    for w in work:
        prefix.append(prefix[-1] + w)
    model = cp_model.CpModel()
    num_layers, num_stages = len(work), len(ranks)
    cut = [model.NewConstant(0)] + [model.NewIntVar(1, num_layers - 1, f"cut{s}") for s in range(1, num_stages)] \
        + [model.NewConstant(num_layers)]
    at = [model.NewIntVar(0, prefix[-1], f"at{s}") for s in range(num_stages + 1)]  # work before each cut
    for s in range(num_stages + 1):
        model.AddElement(cut[s], prefix, at[s])
    for s in range(num_stages):
        model.Add(cut[s + 1] >= cut[s] + 1)
    busiest = model.NewIntVar(0, prefix[-1], "busiest")
    for r in range(num_ranks):
        model.Add(sum(at[s + 1] - at[s] for s in range(num_stages) if ranks[s] == r) <= busiest)
    model.Minimize(busiest)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1
    if solver.Solve(model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return tuple(solver.Value(c) for c in cut)


def _workloads(only: list[str]):
    """(workload, split-block profile, cluster, evaluator, configuration) of each one named."""
    for w in SUITE:
        if only and w.name not in only:
            continue
        profile, cluster = _profile_and_cluster(w, split_blocks=True)
        config = configs_for(profile, TuneOptions(gpus=w.gpus, pp=w.pp, microbatches=w.microbatches))[0]
        yield w, profile, cluster, Evaluator(profile, cluster), config


def _justified_ms(ev: Evaluator, cand: Candidate) -> float:
    return min((ev.score(j).iteration_ms for j in ev.justified(cand)), default=float("nan"))


def rank_balanced(args) -> None:
    print("| workload | baseline | balanced stages ms | rank-balanced ms | rank-balanced, justified ms |")
    print("|---|---|---|---|---|")
    for w, profile, cluster, ev, config in _workloads(args.only):
        work = [round(1000 * (l.forward_ms + l.backward_input_ms + l.backward_weight_ms)) for l in profile.layers]
        for label, cand in _baseline_candidates(profile, cluster, config):
            if not label.endswith("/balanced") or cand.num_stages == config.pp:
                continue  # one stage per rank: balancing stages is balancing ranks
            if cand.num_stages > 3 * config.pp:
                continue  # session 17's table: the baselines of up to 3 chunks
            cuts = rank_balanced_cuts(work, cand.ranks, config.pp)
            if cuts is None:
                continue
            moved = Candidate(config, cuts, cand.ranks, None, cand.fixed, f"{label}, rank-balanced", f"{label}/rank-balanced")
            before, after = ev.score(cand), ev.score(moved)
            mark = lambda s: f"{s.iteration_ms:.1f}" + ("" if s.fits else " (does not fit)")
            print(f"| {w.name} | {label} | {mark(before)} | {mark(after)} | {_justified_ms(ev, moved):.1f} |", flush=True)


def thin_leg(args) -> None:
    print("| workload | down leg's share of the work | zbv | zbv justified | dualpipev | dualpipev justified | policy (depth 2) |")
    print("|---|---|---|---|---|---|---|")
    for w, profile, _, ev, config in _workloads(args.only):
        pp, num_layers = config.pp, profile.num_layers
        work = [l.forward_ms + l.backward_input_ms + l.backward_weight_ms for l in profile.layers]
        ranks = tuple(v_placement(pp, 2 * pp))
        orders = {name: tuple(tuple(ops) for ops in get_schedule(name).generate(pp, config.microbatches, 2))
                  for name in ("zbv", "dualpipev")}
        for split in range(pp, num_layers - pp + 1):
            share = sum(work[:split]) / sum(work)
            if not args.least <= share <= args.most:
                continue
            down = bounds_of(balanced_partition(replace(profile, layers=profile.layers[:split]), pp))
            up = bounds_of(balanced_partition(replace(profile, layers=profile.layers[split:]), pp))
            bounds = down + tuple(split + b for b in up[1:])
            cells = []
            for name, order in orders.items():
                cand = Candidate(config, bounds, ranks, None, order, name, f"{name}/thin-leg-{split}")
                cells += [f"{ev.score(cand).iteration_ms:.1f}", f"{_justified_ms(ev, cand):.1f}"]
            policies = default_policies(ranks, pp, config.microbatches, split=True, depth=2.0, warmup_gap=False)
            cells.append(f"{ev.score(Candidate(config, bounds, ranks, policies, None, 'policy')).iteration_ms:.1f}")
            print(f"| {w.name} | {share:.3f} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(required=True)
    p = sub.add_parser("rank-balanced")
    p.add_argument("--only", nargs="*", default=["jamba-v0.1", "gemma3-27b"])
    p.set_defaults(fn=rank_balanced)
    p = sub.add_parser("thin-leg")
    p.add_argument("--only", nargs="*", default=["deepseek-v3", "jamba-v0.1"])
    p.add_argument("--least", type=float, default=0.2, help="the smallest share of the work in the down leg")
    p.add_argument("--most", type=float, default=0.55)
    p.set_defaults(fn=thin_leg)
    args = parser.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
