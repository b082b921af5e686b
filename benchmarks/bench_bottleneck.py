"""How close op orders come to the best order of their layouts: the policy scheduler with
justification against the shifting-bottleneck procedure (``octoplan.schedules.bottleneck``).

For each workload of the tuner suite (split-block profiles) and each layout shape — a V, loops
of 2 and 3 stages per rank, a zigzag of 3 (down, up, down the ranks) — on a balanced partition:
- the one-machine relaxation's bound (``octoplan bound``): no order of the layout beats it;
- the best of the policy seeds the tuner starts from (I/W split at warm-up depths 1 and 2), each
  with its justified orders, as the tuner had them before;
- the best of those seeds' orders rebuilt by the shifting-bottleneck procedure, with their
  justified orders (``Evaluator.reordered``).
Every order is priced by the simulator and must fit memory.

    .venv/bin/python benchmarks/bench_bottleneck.py [--only jamba-v0.1 gemma3-27b ...]
"""

from __future__ import annotations

import argparse
import time

from bench_tuner import SUITE, _profile_and_cluster

from octoplan.partition import balanced_partition
from octoplan.schedules import loop_placement, v_placement
from octoplan.schedules.exact import relaxation_bound
from octoplan.schedules.policy import default_policies
from octoplan.tuner.space import Candidate, Config, Evaluator, bounds_of


def zigzag_placement(pp: int, chunks: int) -> list[int]:
    """Down the ranks, back up, down again...: ``chunks`` stages per rank."""
    return [s % pp if (s // pp) % 2 == 0 else pp - 1 - s % pp for s in range(chunks * pp)]


SHAPES = {
    "V": lambda pp: v_placement(pp, 2 * pp),
    "loop x2": lambda pp: loop_placement(pp, 2 * pp),
    "zigzag x3": lambda pp: zigzag_placement(pp, 3),
    "loop x3": lambda pp: loop_placement(pp, 3 * pp),
}


def best_fitting(evaluator: Evaluator, cands) -> float | None:
    times = [s.iteration_ms for s in map(evaluator.score, cands) if s.fits]
    return min(times, default=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=["jamba-v0.1", "gemma3-27b", "gemma2-27b", "internvl2-8b"])
    args = parser.parse_args()
    print("| workload | layout | stages | no order beats (ms) | policy seeds, justified (ms) | above the bound | "
          "shifting bottleneck, justified (ms) | above the bound | reordering s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for w in SUITE:
        if w.name not in args.only:
            continue
        profile, cluster = _profile_and_cluster(w, split_blocks=True)
        evaluator = Evaluator(profile, cluster)
        config = Config(w.pp, w.gpus // w.pp, w.microbatches, "dp-inner" if w.gpus > w.pp else "pp-inner")
        for shape, place in SHAPES.items():
            ranks = tuple(place(w.pp))
            if len(ranks) > profile.num_layers:
                continue
            bounds = bounds_of(balanced_partition(profile, len(ranks)))
            seeds = [Candidate(config, bounds, ranks, default_policies(ranks, w.pp, w.microbatches, split=True, depth=d),
                               None, f"policy seed, depth {d:g}") for d in (1.0, 2.0)]
            policy = best_fitting(evaluator, [c for seed in seeds for c in (seed, *evaluator.justified(seed))])
            started = time.perf_counter()
            reordered = [c for seed in seeds for c in evaluator.reordered(seed)]
            took = time.perf_counter() - started
            rebuilt = best_fitting(evaluator, reordered)
            plan = evaluator.plan(seeds[0])
            bound = relaxation_bound(plan.schedule, ranks, evaluator.costs(seeds[0]), cluster=cluster,
                                     parallel=plan.parallel)
            above = lambda ms: f"{ms / bound - 1:.2%}" if ms else "-"
            print(f"| {w.name} | {shape} | {len(ranks)} | {bound:.1f} | {policy and round(policy, 1)} | {above(policy)} | "
                  f"{rebuilt and round(rebuilt, 1)} | {above(rebuilt)} | {took:.1f} |", flush=True)


if __name__ == "__main__":
    main()
