"""Configuration benchmark: the whole configuration for a fixed global batch on N GPUs, tuned,
against Megatron-LM's best configuration from a grid search, every other baseline schedule's
best configuration, and the ideal.

    .venv/bin/python benchmarks/bench_config.py [--time-limit 30 | --max-plans N] [--only NAME ...] [--sizes 1 2 4] [--json out.json]

For each workload of the tuner suite (benchmarks/bench_tuner.py's SUITE: model, GPU, tensor
parallelism) at two GPU counts and one global batch (fixed per workload, so the two counts are
strong scaling), on nodes of the suite's size:

- **Megatron-LM's best configuration**: a grid search over every pp dividing the pipeline GPUs
  (N / tp) with at most one pp rank per layer, both global rank orders, every microbatch size of
  ``--sizes`` that divides the batch per replica, 1F1B and interleaved 1F1B with every chunk
  count the layers allow (Megatron's uniform partition; only layouts and orders Megatron-LM
  runs, where its pipeline layout can name every layer, else its scheme as the tuner suite
  prices it: Mamba hybrids and the VLM), and on a
  configuration that does not fit memory the least block recomputation that fits
  (``--recompute-method block --recompute-num-layers K``, the fewest K). The fastest that fits.
- **tuned**: ``octoplan tune`` with every size's profile for the same batch
  (:func:`octoplan.tuner.configs.tune_global_batch`), ``--time-limit`` seconds in all, on
  profiles whose blocks are split into mixer and MLP/MoE layers (the same work, finer cut
  points; ``--whole-blocks`` keeps them whole), as the tuner suite does. Megatron-LM cannot cut
  a block, so its grid stays on whole blocks.
- **best baseline**: the fastest fitting configuration of any FORMATS.md section 6 schedule and
  partition (as ``tune`` prices them: every size, pp, rank order, chunk count), on the tuned
  profiles' layers.
- **ideal**: the global batch's compute (every layer's forward + cheapest backward, for every
  microbatch) spread evenly over the pipeline GPUs, at the size where it is least: no plan beats it.
- **bound**: the least lower bound of any configuration (docs/FORMATS.md section 7: the even
  share of work, or the largest layer's, plus the per-op costs), at or above the ideal.
- **ceiling**: Megatron-LM's best over the bound — the speedup of the best configuration at
  efficiency 1, above which no plan can go.

Prints a markdown table and the geo-means; ``--json`` writes every row.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass

from bench_tuner import SUITE

from octoplan.arch import analytic_profile
from octoplan.export_megatron import megatron_expert_problem
from octoplan.costs import lower_bound_ms
from octoplan.plan import Cluster
from octoplan.tuner import TuneOptions
from octoplan.tuner.configs import tune_global_batch
from octoplan.tuner.frameworks import Frameworks
from octoplan.tuner.climb import Search
from octoplan.tuner.search import configs_for
from octoplan.tuner.seeds.baselines import baseline_candidates, fewest_recomputed_layers
from octoplan.tuner.space import Evaluator


@dataclass(frozen=True)
class Case:
    workload: str
    gpus: tuple[int, ...]  # physical GPUs (tp x pp x dp)
    global_batch: int  # samples per iteration


# GPU counts from 16 to 256, each crossing node boundaries; the batch: 4 samples per pipeline
# GPU at the larger count (a batch where pipelines cannot hide behind many microbatches)
CASES = [
    Case("llama3-8b", (16, 64), 256),
    Case("llama3-70b", (64, 256), 128),
    Case("gemma2-27b", (16, 64), 128),
    Case("nemotron-h-8b", (16, 64), 256),
    Case("deepseek-v3", (128, 256), 128),
    Case("internvl2-8b", (16, 64), 256),
    Case("jamba-v0.1", (32, 128), 256),
    Case("gemma3-27b", (64, 256), 256),
    Case("llama3-70b-a100", (128, 256), 128),
]


def _ideal_ms(profiles, pipeline_gpus: int, global_batch: int) -> float:
    """Every layer's forward and cheapest backward for the whole batch, spread evenly."""
    best = math.inf
    for profile in profiles:
        if global_batch % profile.microbatch_size:
            continue
        per_microbatch = sum(layer.forward_ms + min(layer.backward_input_ms + layer.backward_weight_ms, layer.b_ms)
                             for layer in profile.layers)
        best = min(best, per_microbatch * global_batch / profile.microbatch_size / pipeline_gpus)
    return best


def _bound_ms(profiles, pipeline_gpus: int, global_batch: int, op_overhead_ms: float) -> float:
    """The least lower bound (docs/FORMATS.md section 7) of any configuration: no plan of any pp,
    dp and microbatch size beats it (its largest layer and per-op costs included)."""
    best = math.inf
    for profile in profiles:
        for pp in range(1, min(pipeline_gpus, profile.num_layers) + 1):
            dp = pipeline_gpus // pp
            if pipeline_gpus % pp or global_batch % (dp * profile.microbatch_size):
                continue
            microbatches = global_batch // (dp * profile.microbatch_size)
            best = min(best, lower_bound_ms(profile, pp=pp, microbatches=microbatches, op_overhead_ms=op_overhead_ms))
    return best


def megatron_grid(profile, cluster: Cluster, pipeline_gpus: int, global_batch: int) -> tuple[float, str, int]:
    """Megatron-LM's fastest fitting configuration at this microbatch size: (ms, label, priced)."""
    opts = TuneOptions(gpus=pipeline_gpus, global_batch=global_batch)
    try:
        configs = configs_for(profile, opts, cluster)
    except Exception:  # the batch does not split at this size
        return math.inf, "", 0
    search = Search(Evaluator(profile, cluster), opts, None)
    # no cluster: both rank orders count as Megatron-LM's, though under expert parallelism it runs
    # only dp-inner across nodes; that can only flatter Megatron-LM's best configuration
    frameworks = Frameworks(profile)
    best, label, priced = math.inf, "", 0
    for config in configs:
        for name, cand in baseline_candidates(profile, cluster, config, 32):
            if not name.endswith("/uniform") or not (name.startswith("1f1b/") or name.startswith("interleaved-1f1b")):
                continue
            # where Megatron-LM's layout letters name every layer, only the layouts and orders it
            # runs; elsewhere (Mamba hybrids, a vision encoder) its scheme, as the tuner suite prices it
            if frameworks.letters is not None and "Megatron-LM" not in frameworks.runs_on(cand):
                continue
            if megatron_expert_problem(config.parallel(), frameworks.ep, frameworks.tp):  # (it forms no expert groups)
                continue
            scored = search.offer(cand)
            priced += 1
            what = name
            if not scored.fits:
                cand = fewest_recomputed_layers(search, cand, f"{name}+recompute")
                scored = search.offer(cand)
                what = f"{name}+recompute({max((k for _, k in cand.recompute_layers), default='all')})"
            if scored.fits and scored.iteration_ms < best:
                best, label = scored.iteration_ms, f"{what} mbs={profile.microbatch_size} {config.label()}"
    return best, label, priced


def run_case(case: Case, gpus: int, *, sizes, time_limit: float, max_plans: int | None = None,
             split_blocks: bool = True) -> dict:
    w = next(w for w in SUITE if w.name == case.workload)
    pipeline_gpus = gpus // w.tp
    # Megatron-LM cuts between whole blocks; the tuner may cut a block between its mixer and MLP
    profiles = [analytic_profile(w.arch, w.gpu, tp=w.tp, microbatch_size=size) for size in sizes]
    tuned_profiles = [analytic_profile(w.arch, w.gpu, tp=w.tp, microbatch_size=size, split_blocks=split_blocks)
                      for size in sizes]
    cluster = Cluster(gpus=pipeline_gpus, gpus_per_node=max(1, w.gpus_per_node), memory_gb=profiles[0].device["memory_gb"])
    start = time.perf_counter()
    megatron = min((megatron_grid(p, cluster, pipeline_gpus, case.global_batch) for p in profiles), key=lambda r: r[0])
    grid_s = time.perf_counter() - start
    usable = [p for p in tuned_profiles if case.global_batch % p.microbatch_size == 0]
    start = time.perf_counter()
    batch = tune_global_batch([(None, p) for p in usable], cluster,
                              TuneOptions(gpus=pipeline_gpus, global_batch=case.global_batch, time_limit_s=time_limit,
                                          max_plans=max_plans))
    tune_s = time.perf_counter() - start
    tuned = batch.result.scored.iteration_ms
    fitting = [(row.scored.iteration_ms, row.name, size, row.config) for size, row in batch.baselines if row.scored.fits]
    best_baseline = min(fitting, key=lambda r: r[0], default=(math.inf, "", 0, None))
    ideal = _ideal_ms(usable, pipeline_gpus, case.global_batch)
    bound = _bound_ms(usable, pipeline_gpus, case.global_batch, cluster.op_overhead_us / 1000.0)
    winner = batch.configs[0]
    runner = batch.configs[1] if len(batch.configs) > 1 else None
    from octoplan.tuner.configs import why_slower

    return {
        "workload": case.workload, "gpus": gpus, "tp": w.tp, "pipeline_gpus": pipeline_gpus,
        "global_batch": case.global_batch, "tuned_ms": tuned, "tuned_config": winner.label(),
        "next_config": runner.label() if runner else "", "next_why": why_slower(runner, winner) if runner else "",
        "megatron_ms": megatron[0], "megatron_config": megatron[1], "megatron_priced": megatron[2],
        "best_baseline_ms": best_baseline[0],
        "best_baseline": f"{best_baseline[1]} mbs={best_baseline[2]} {best_baseline[3].label() if best_baseline[3] else ''}",
        "ideal_ms": ideal, "bound_ms": bound, "grid_s": round(grid_s, 1), "tune_s": round(tune_s, 1),
    }


def _geo(values) -> float:
    values = [v for v in values if math.isfinite(v) and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-limit", type=float, default=30.0, help="seconds of tuning per case, all sizes together")
    parser.add_argument("--only", nargs="*", default=None, help="workloads to run")
    parser.add_argument("--max-plans", type=int, default=None,
                        help="a budget of simulated plans per case instead of seconds (the same result at any load)")
    parser.add_argument("--sizes", nargs="*", type=int, default=[1, 2, 4], help="microbatch sizes (samples)")
    parser.add_argument("--whole-blocks", action="store_true",
                        help="tune on whole blocks too (by default the tuner may cut a block between mixer and MLP)")
    parser.add_argument("--json", default=None, help="write every row here")
    args = parser.parse_args()
    rows = []
    for case in CASES:
        if args.only and case.workload not in args.only:
            continue
        for gpus in case.gpus:
            row = run_case(case, gpus, sizes=args.sizes, time_limit=args.time_limit, max_plans=args.max_plans,
                           split_blocks=not args.whole_blocks)
            rows.append(row)
            print(f"<!-- {row['workload']} {gpus}: tuned {row['tuned_ms']:.1f} megatron {row['megatron_ms']:.1f} "
                  f"ideal {row['ideal_ms']:.1f} ({row['grid_s']} s grid, {row['tune_s']} s tune) -->", flush=True)
    print()
    print("| workload | GPUs (tp x pipeline) | batch | tuned ms | configuration | vs Megatron-LM best | Megatron-LM best "
          "| vs best baseline | of ideal | ceiling | of ceiling | next-best configuration: why it lost |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['gpus']} ({r['tp']} x {r['pipeline_gpus']}) | {r['global_batch']} | "
              f"{r['tuned_ms']:.1f} | {r['tuned_config']} | {r['megatron_ms'] / r['tuned_ms']:.3f}x | "
              f"{r['megatron_ms']:.1f} ({r['megatron_config']}) | {r['best_baseline_ms'] / r['tuned_ms']:.3f}x | "
              f"{r['ideal_ms'] / r['tuned_ms']:.3f} | {r['megatron_ms'] / r['bound_ms']:.3f}x | "
              f"{r['bound_ms'] / r['tuned_ms']:.1%} | "
              f"{r['next_config']}: {r['next_why']} |")
    speedup = _geo([r["megatron_ms"] / r["tuned_ms"] for r in rows])
    ceiling = _geo([r["megatron_ms"] / r["bound_ms"] for r in rows])
    within = sum(1 for r in rows if r["tuned_ms"] <= 1.10 * r["ideal_ms"])
    print()
    print(f"geo-mean over Megatron-LM's best configuration: {speedup:.3f}x (ceiling at efficiency 1: {ceiling:.3f}x, "
          f"so {speedup / ceiling:.1%} of it); over the best baseline configuration: "
          f"{_geo([r['best_baseline_ms'] / r['tuned_ms'] for r in rows]):.3f}x; within 10% of the ideal: "
          f"{within} of {len(rows)} cases")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
