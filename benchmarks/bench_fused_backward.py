"""What pricing B ops at the measured fused backward changes in the tuner's choice.

Each profile is tuned twice on the same GPUs: as measured (a B op costs the layer's
``backward_ms``), and with ``backward_ms`` removed (B = I + W, as before profiles measured it).
Both tuned plans are then priced with the fused backward, which is what octorun runs for a B op
(docs/BENCHMARKS.md, "On a GPU"). A ratio above 1: the plan chosen without the fused time is
that much slower.

Run: .venv/bin/python benchmarks/bench_fused_backward.py profiles/h200/*.yaml [--gpus 4 --microbatches 8 --time-limit 20]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from octoplan.plan import Cluster
from octoplan.profile import load_profile
from octoplan.simulator import simulate
from octoplan.tuner import TuneOptions, tune


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("profiles", nargs="+")
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--time-limit", type=float, default=20.0)
    args = parser.parse_args()
    print("| profile | B / (I + W) | tuned with fused B: ms, ops, stages | tuned with B = I + W, priced fused: ms, ops, stages | ratio |")
    print("|---|---:|---|---|---:|")
    for path in args.profiles:
        measured = load_profile(path)
        plain = measured.with_layers([replace(layer, backward_ms=None) for layer in measured.layers])
        cluster = Cluster(gpus=args.gpus, memory_gb=measured.device.get("memory_gb", 80))
        opts = TuneOptions(gpus=args.gpus, pp=args.gpus, microbatches=args.microbatches, time_limit_s=args.time_limit)
        fused_plan, plain_plan = tune(measured, cluster, opts).plan, tune(plain, cluster, opts).plan
        fused_ms, plain_ms = simulate(fused_plan, measured).iteration_ms, simulate(plain_plan, measured).iteration_ms
        ratio = measured.fused_backward_ratio or 1.0  # none measured: B = I + W
        kinds = lambda plan: "".join(sorted({op.kind.value for ops in plan.schedule for op in ops}))
        print(f"| {path} | {ratio:.2f} | {fused_ms:.2f}, {kinds(fused_plan)}, {fused_plan.num_stages} | "
              f"{plain_ms:.2f}, {kinds(plain_plan)}, {plain_plan.num_stages} | {plain_ms / fused_ms:.3f} |")


if __name__ == "__main__":
    main()
