"""The policy list scheduler against an earlier version of itself: same orders, and how fast.

Run: .venv/bin/python benchmarks/bench_policy.py --against 2e91084 [--cases 400] [--seed 1]
     .venv/bin/python benchmarks/bench_policy.py --against REV --tight-budgets [--cases 300]

Loads ``octoplan/schedules/policy.py`` as it was at git revision ``--against``, checks that both
versions give identical op orders on random placements (loop, V and shuffled maps), knobs and
memory budgets, then times both on a 16-rank V of 32 stages with 64 microbatches, alternating
old and new, and prints the median of each.

``--tight-budgets`` compares the two versions' orders instead, where memory binds (for a change
to the scheduler's memory rule; docs/BENCHMARKS.md has one): each case's
budget per rank is what the order built without a budget holds at its peak, up to 10% more,
plus room for the transients and messages the scheduler keeps free. Both versions' orders are
simulated; it prints how many are faster, slower or the same now, and the extreme ratios.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from octoplan.costs import StageCost  # noqa: E402
from octoplan.plan import Cluster, ModelRef, Parallel, Plan, Stage  # noqa: E402
from octoplan.schedules import policy as current  # noqa: E402
from octoplan.simulator import simulate_costs  # noqa: E402


def load_revision(rev: str):
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:octoplan/schedules/policy.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "policy_at_revision.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("policy_at_revision", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def random_case(rng: random.Random):
    ranks, per = rng.randint(2, 8), rng.randint(1, 3)
    stages = ranks * per
    shape = rng.choice(["loop", "v", "random"])
    if shape == "v" and per == 2:
        rank_of = list(range(ranks)) + list(reversed(range(ranks)))
    else:
        rank_of = [s % ranks for s in range(stages)]
        if shape == "random":
            rng.shuffle(rank_of)
    costs = [StageCost(rng.uniform(0.5, 3), rng.uniform(0.5, 3), rng.uniform(0.1, 3), 1000,
                       rng.randint(0, 100) * 10**6, rng.randint(1, 10) * 10**6) for _ in range(stages)]
    mb = rng.randint(1, 4) * ranks
    split = rng.random() < 0.6
    knobs = []
    for p in current.default_policies(rank_of, ranks, mb, split=split, depth=rng.choice([0.5, 1, 1.5, 2]),
                                      warmup_gap=rng.random() < 0.7):
        knobs.append({**p.to_dict(), "w_cap": rng.choice([p.w_cap, 0, 2]) if split else 0,
                      "deep_first": rng.random() < 0.7, "w_fits_gap": rng.random() < 0.5})
    cluster = Cluster(gpus=ranks, gpus_per_node=rng.choice([2, 4, 8]), latency_us=rng.choice([0, 10, 500]))
    budget = None if rng.random() < 0.5 else [rng.uniform(1, 8) * 100 * 10**6 for _ in range(ranks)]
    return rank_of, costs, mb, knobs, cluster, Parallel(pp=ranks, dp=1, microbatches=mb), budget


def run(module, case):
    rank_of, costs, mb, knobs, cluster, parallel, budget = case
    return module.policy_schedule(rank_of, costs, microbatches=mb, policies=[module.RankPolicy(**k) for k in knobs],
                                  cluster=cluster, parallel=parallel, activation_budget_bytes=budget)


def tight_budget_case(rng: random.Random):
    """A random case whose budget the order built without one just fits (see the docstring)."""
    rank_of, costs, mb, knobs, cluster, parallel, _ = random_case(rng)
    free = simulated(rank_of, costs, cluster, parallel, run(current, (rank_of, costs, mb, knobs, cluster, parallel, None)))
    reserve = max(c.recompute_bytes + c.i_peak_bytes for c in costs) + 6 * max(c.output_bytes for c in costs)
    budget = [peak * (1 + 0.1 * rng.random()) + reserve for peak in free.peak_activation_bytes]
    return rank_of, costs, mb, knobs, cluster, parallel, budget


def simulated(rank_of, costs, cluster, parallel, ops):
    stages = tuple(Stage(start=s, end=s + 1, rank=r) for s, r in enumerate(rank_of))
    plan = Plan(model=ModelRef("policy-bench"), cluster=cluster, parallel=parallel, stages=stages,
                schedule=tuple(map(tuple, ops)))
    return simulate_costs(plan, costs)


def compare_tight_budgets(old, args) -> None:
    rng = random.Random(args.seed)
    counts = {"faster": 0, "slower": 0, "same": 0}
    ratios = []
    for _ in range(args.cases):
        case = tight_budget_case(rng)
        rank_of, costs, _, _, cluster, parallel, _ = case
        before = simulated(rank_of, costs, cluster, parallel, run(old, case)).iteration_ms
        now = simulated(rank_of, costs, cluster, parallel, run(current, case)).iteration_ms
        key = "same" if abs(before - now) <= 1e-9 * before else ("faster" if now < before else "slower")
        counts[key] += 1
        if key != "same":
            ratios.append(before / now)
    print(f"{args.cases} tight-budget cases (seed {args.seed}), against {args.against}: "
          f"{counts['faster']} faster, {counts['slower']} slower, {counts['same']} the same; "
          f"{args.against} / now from {min(ratios, default=1):.3f} to {max(ratios, default=1):.3f}, "
          f"median of the changed {statistics.median(ratios) if ratios else 1:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--against", required=True, help="git revision of the version to compare with")
    parser.add_argument("--cases", type=int, default=400)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--tight-budgets", action="store_true", help="compare the orders' iteration times where memory binds")
    args = parser.parse_args()
    old = load_revision(args.against)
    if args.tight_budgets:
        compare_tight_budgets(old, args)
        return
    rng = random.Random(args.seed)
    for index in range(args.cases):
        case = random_case(rng)
        if run(old, case) != run(current, case):
            raise SystemExit(f"case {index}: the orders differ")
    print(f"identical orders on {args.cases} random cases (seed {args.seed})")
    rank_of = list(range(16)) + list(reversed(range(16)))
    costs = [StageCost(1.0 + 0.01 * s, 1.1, 0.9, 1000, 10**6, 10**6) for s in range(32)]
    knobs = [p.to_dict() for p in current.default_policies(rank_of, 16, 64, split=True)]
    big = (rank_of, costs, 64, knobs, Cluster(gpus=16), Parallel(pp=16, dp=1, microbatches=64), None)
    times: dict[str, list[float]] = {"old": [], "new": []}
    for _ in range(args.repeat):
        for name, module in (("old", old), ("new", current)):
            start = time.perf_counter()
            run(module, big)
            times[name].append(1000 * (time.perf_counter() - start))
    old_ms, new_ms = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"16-rank V, 32 stages, 64 microbatches, split backward: {args.against} {old_ms:.1f} ms, "
          f"now {new_ms:.1f} ms (median of {args.repeat}): {old_ms / new_ms:.2f}x")


if __name__ == "__main__":
    main()
