"""Simulator speed: one simulation of a 64-rank, 256-microbatch ZB-H1 plan (I/W split,
49,152 ops) — target at most 150 ms median — and how the time grows from 8 to 256 ranks.

Run: .venv/bin/python benchmarks/bench_simulator.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

from octoplan.baseline import make_baseline
from octoplan.plan import Cluster
from octoplan.profile import Layer, ModelRef, Profile
from octoplan.simulator import simulate


def _profile(num_layers: int) -> Profile:
    # Heterogeneous on purpose: a heavy first and last layer, alternating block costs.
    layers = [Layer("embed", "embedding", 3.0, 0.5, 3.0, 10**9, 10**8, 10**7)]
    for i in range(num_layers - 2):
        t = 1.0 + 0.5 * (i % 3)
        layers.append(Layer(f"block{i}", "layer", t, t, t, 4 * 10**8, 2 * 10**8, 10**7))
    layers.append(Layer("head", "head", 4.0, 4.0, 4.0, 10**9, 10**8, 10))
    return Profile(model=ModelRef("bench"), layers=tuple(layers))


def time_simulation(ranks: int, microbatches: int, repeat: int) -> tuple[float, float, int]:
    """(median CPU ms, median wall ms, ops). The simulator is single-threaded pure Python, so
    its thread CPU time is what it costs on an idle core; wall time also counts the slices
    other processes take on a shared machine."""
    profile = _profile(2 * ranks)
    plan = make_baseline(profile, schedule="zb-h1", gpus=ranks, microbatches=microbatches,
                         cluster=Cluster(gpus=ranks, gpus_per_node=8), partition_method="balanced")
    cpu, wall = [], []
    for _ in range(repeat):
        start_cpu, start_wall = time.thread_time(), time.perf_counter()
        simulate(plan, profile)
        cpu.append((time.thread_time() - start_cpu) * 1000)
        wall.append((time.perf_counter() - start_wall) * 1000)
    return statistics.median(cpu), statistics.median(wall), sum(len(ops) for ops in plan.schedule)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    cpu, wall, num_ops = time_simulation(64, 256, args.repeat)
    print(f"target: 64 ranks x 256 microbatches, {num_ops} ops: median {cpu:.1f} ms CPU, {wall:.1f} ms wall (limit 150 ms)")
    print("| ranks | microbatches | ops | median CPU ms | median wall ms | CPU us per op |")
    print("|---:|---:|---:|---:|---:|---:|")
    for ranks in (8, 16, 32, 64, 128, 256):
        cpu, wall, num_ops = time_simulation(ranks, 256, max(3, args.repeat // 2))
        print(f"| {ranks} | 256 | {num_ops} | {cpu:.1f} | {wall:.1f} | {1000 * cpu / num_ops:.2f} |")


if __name__ == "__main__":
    main()
