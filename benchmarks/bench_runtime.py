"""Proof that octorun is fast: fidelity to the simulator, PyTorch side by side, and overhead.

Every benchmark runs the replay model (``examples/models/replay.py``: layers that *sleep* a
profile's forward / input-grad / weight-grad times, scaled by ``time_scale``) under octorun, one
gloo process per pipeline rank, launched with ``torchrun`` exactly as a user would. Sleeps cost
no CPU, so 8 processes on a 2-core machine measure schedules and the runtime, not the machine.

Plans are made for what the replay really costs. For a source profile (e.g. an analytic
``profiles/gemma2-27b-h100.yaml``) and a time scale S, :func:`derive_profile` writes a profile
whose times are the source's times x S and whose ``output_bytes`` are the bytes the replay really
sends; its model is the replay of the source. The cluster's latency and bandwidth are measured on
this machine (:func:`measure_link`: a gloo ping-pong between two processes), not assumed.

Benchmarks (each a function returning plain data; ``main`` prints markdown and writes JSON):

``fidelity``  per source profile: the tuned plan (:func:`octoplan.tuner.tune`) and the 1F1B plan
              (:func:`octoplan.baseline.make_baseline`), each run for ``warmup + steps`` steps;
              the median ``iteration_ms`` of the timed steps against the simulator's prediction,
              and the measured speedup tuned / 1F1B against the predicted one.
``torch``     the same replay, processes and microbatches under torch.distributed.pipelining's
              four schedules (:func:`benchmarks.torch_pipelines.run_torch_schedule`) and octorun
              running the tuned plan, in one run (octorun before and after torch's four, so that
              a change of load on the machine shows).
``overhead``  a synthetic profile whose every stage op sleeps 10 ms: octorun's overhead =
              (measured iteration - the simulator's iteration with free communication) / measured;
              the trace of the last step splits it per op (:func:`trace_overheads`).

Measures: octorun's ``iteration_ms`` runs from the first op's start to the last op's end over all
ranks (FORMATS.md section 7's measure, what the simulator predicts); ``step_ms`` is the whole step on
the slowest rank (after the step's barrier: ops, waits, optimizer). torch's harness times
``schedule.step`` from the first process entering to the last leaving; ``step_ms`` is the fair
figure to put beside it, and both are reported.

Command line (see docs/BENCHMARKS.md for the runs and their results)::

    .venv/bin/python benchmarks/bench_runtime.py all --out out/bench-runtime
    .venv/bin/python benchmarks/bench_runtime.py fidelity --case profiles/gemma2-27b-h100.yaml:0.3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from octoplan.baseline import make_baseline  # noqa: E402
from octoplan.calibrate import calibration_of, split_trace  # noqa: E402
from octoplan.costs import LayerTable, op_ms, plan_stage_costs  # noqa: E402
from octoplan.ops import Kind  # noqa: E402
from octoplan.plan import Cluster, Plan, load_plan, save_plan  # noqa: E402
from octoplan.profile import Layer, ModelRef, Profile, load_profile, save_profile  # noqa: E402
from octoplan.simulator import simulate  # noqa: E402
from octorun.runtime import free_port  # noqa: E402

__all__ = [
    "REPLAY_MODEL",
    "DEFAULT_CASES",
    "Case",
    "Link",
    "Calibration",
    "calibrate",
    "measure_link",
    "derive_profile",
    "uniform_replay_profile",
    "make_plans",
    "run_octorun",
    "predict",
    "posthoc",
    "report",
    "CaseProfiles",
    "case_profiles",
    "octorun_command",
    "priority",
    "bench_fidelity",
    "bench_torch",
    "bench_overhead",
    "trace_overheads",
    "main",
]

log = logging.getLogger("benchmarks.bench_runtime")

REPLAY_MODEL = "examples/models/replay.py"  # relative to ROOT, where every job runs
DEFAULT_BYTES_SCALE = 1e-3  # the replay's default, which torch's harness also uses


@dataclass(frozen=True)
class Case:
    """A source profile and the time scale at which its replay's 8-stage ops last 5-50 ms."""

    source: str
    time_scale: float

    @property
    def name(self) -> str:
        return Path(self.source).stem

    @classmethod
    def parse(cls, text: str) -> "Case":
        path, _, scale = text.rpartition(":")
        if not path:
            raise SystemExit(f"--case {text!r}: write PROFILE.yaml:TIME_SCALE")
        return cls(path, float(scale))


# At these scales the 1F1B plan's longest op (a fused B of the heaviest of 8 uniform stages)
# lasts about 45 ms, its shortest about 10 ms; a layer's forward sleeps 1-4 ms.
DEFAULT_CASES = (
    Case("profiles/gemma2-27b-h100.yaml", 0.22),
    Case("profiles/nemotron-h-8b-h100.yaml", 0.65),
    Case("profiles/deepseek-v3-h200.yaml", 0.19),
)


# ---------------------------------------------------------------------------------------------
# The machine's link, and profiles of what the replay really costs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """One-way gloo transfer costs between two processes of this machine."""

    latency_ms: float  # mean one-way time of a small message
    latency_median_ms: float
    gbps: float  # GB/s (1e9 bytes/s), from the extra time of a large message
    op_overhead_ms: float = 0.0  # the runtime's time between two ops (calibrated; cluster.op_overhead_us)

    def cluster(self, gpus: int, *, memory_gb: float = 1e4) -> Cluster:
        """One node of ``gpus`` processes with these costs; memory large enough never to bind
        (the replay holds a few KB whatever the profile says)."""
        return Cluster(gpus=gpus, gpus_per_node=gpus, memory_gb=memory_gb, intra_node_gbps=self.gbps,
                       inter_node_gbps=self.gbps, latency_us=round(1000.0 * self.latency_ms, 1),
                       op_overhead_us=round(1000.0 * self.op_overhead_ms, 1))

    def to_dict(self) -> dict[str, float]:
        return {"latency_ms": self.latency_ms, "latency_median_ms": self.latency_median_ms, "gbps": self.gbps,
                "op_overhead_ms": self.op_overhead_ms}


_SMALL, _LARGE = 1 << 10, 1 << 20  # float32 elements: 4 KB and 4 MB


def _link_worker(rank: int, port: int, rounds: int, result_path: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        times: dict[int, list[float]] = {}
        for size in (_SMALL, _LARGE):
            tensor = torch.zeros(size)
            out = times[size] = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(tensor, 1)
                    dist.recv(tensor, 1)
                else:
                    dist.recv(tensor, 0)
                    dist.send(tensor, 0)
                out.append((time.perf_counter() - t0) / 2)  # one way: half a round trip
        if rank == 0:
            Path(result_path).write_text(json.dumps({str(k): v[rounds // 10:] for k, v in times.items()}))
    finally:
        dist.destroy_process_group()


def measure_link(rounds: int = 200) -> Link:
    """Ping-pong a 4 KB and a 4 MB tensor between two gloo processes.

    On a loaded machine the small message's time is a process wake-up, not a wire: its *mean* is
    what a chain of transfers adds up to, so the mean is the latency the plans are tuned with.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="octopipe-link-") as tmp:
        result = os.path.join(tmp, "link.json")
        mp.spawn(_link_worker, args=(free_port(), rounds, result), nprocs=2, join=True)
        times = {int(k): v for k, v in json.loads(Path(result).read_text()).items()}
    small, large = times[_SMALL], times[_LARGE]
    extra_s = max(statistics.median(large) - statistics.median(small), 1e-9)
    gbps = 4 * (_LARGE - _SMALL) / extra_s / 1e9
    return Link(latency_ms=round(1000 * statistics.fmean(small), 4),
                latency_median_ms=round(1000 * statistics.median(small), 4), gbps=round(gbps, 3))


def _replay_config(source: str | Path, time_scale: float, bytes_scale: float) -> dict[str, Any]:
    return {"profile": str(Path(source).resolve()), "time_scale": time_scale, "bytes_scale": bytes_scale}


def derive_profile(source: str | Path, out: str | Path, *, time_scale: float,
                   bytes_scale: float = DEFAULT_BYTES_SCALE, per_layer_ms: dict[str, float] | None = None) -> Profile:
    """Write (to ``out``) and return the profile of the replay of ``source`` at ``time_scale``.

    Times are the source's x ``time_scale``, plus ``per_layer_ms[kind]`` (kind F, I or W) on every
    layer when given: the replay layer's own fixed cost on this machine beyond its sleep
    (:func:`calibrate`). A layer's ``output_bytes`` are the float32 bytes the replay
    layer really outputs (read from the built layer, so the replay's own size rule — scaled
    bytes, at least a few elements — is not repeated here). Parameter and activation bytes stay
    the source's: the cluster's memory is set large enough not to bind.
    """
    extra_ms = per_layer_ms or {}
    from octoplan.modelfile import load_model_file

    src = load_profile(source)
    config = _replay_config(source, time_scale, bytes_scale)
    model = load_model_file(ROOT / REPLAY_MODEL, config)
    layers = []
    for index, layer in enumerate(src.layers):
        out_elements = model.build_layer(index).out_elements
        # a fused backward runs both replayed branches, so it pays both branches' extra
        extra = {**extra_ms, "B": extra_ms.get("B", extra_ms.get("I", 0.0) + extra_ms.get("W", 0.0))}
        scaled = layer.map_times(lambda kind, ms: ms * time_scale + extra.get(kind, 0.0))
        layers.append(replace(scaled, output_bytes=4 * out_elements * src.microbatch_size, flops=None))
    derived = replace(src, model=ModelRef(f"replay-{Path(source).stem}", source=REPLAY_MODEL, config=config),
                      layers=tuple(layers), dtype="float32", extra={})
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_profile(derived, out)
    return derived


def uniform_replay_profile(path: str | Path, *, num_layers: int = 8, op_ms: float = 10.0,
                           out_elements: int = 1024) -> Profile:
    """A synthetic profile whose every layer's F = I = W = ``op_ms`` (one layer per stage on
    ``num_layers`` ranks; layer 0 has no I), written to ``path`` and replaying itself at time
    scale 1: the overhead benchmark's workload and the calibration's. Each message carries
    ``out_elements`` float32 numbers."""
    out_bytes = 4 * out_elements
    # Layer 0's input is the data, which has no gradient: the replay never runs its I sleep, so
    # the profile says 0 there (as analytic profiles do for the embedding).
    layers = tuple(Layer(f"block.{i}", "block", op_ms, op_ms if i else 0.0, op_ms, 4 * out_elements, out_bytes, out_bytes)
                   for i in range(num_layers))
    # bytes_scale 1: the replay sends exactly output_bytes
    config = {"profile": str(Path(path).resolve()), "time_scale": 1.0, "bytes_scale": 1.0}
    profile = Profile(model=ModelRef("replay-uniform", source=REPLAY_MODEL, config=config), layers=layers,
                      device={"name": "cpu", "memory_gb": 24}, microbatch_size=1, dtype="float32")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, path)
    return profile


# ---------------------------------------------------------------------------------------------
# Plans, predictions, runs
# ---------------------------------------------------------------------------------------------


def make_plans(profile: Profile, profile_path: str | Path, cluster: Cluster, out_dir: str | Path, *,
               microbatches: int, tune_seconds: float, chunks_max: int = 3, seed: int = 0) -> dict[str, Path]:
    """``tuned`` (pp pinned to the process count, so every plan runs one 8-rank pipeline) and
    ``1f1b`` (uniform partition: Megatron-LM's default) plans, saved under ``out_dir``."""
    from octoplan.tuner import TuneOptions, tune

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    profile_path = str(Path(profile_path).resolve())
    gpus = cluster.gpus
    result = tune(profile, cluster, TuneOptions(gpus=gpus, pp=gpus, microbatches=microbatches, time_limit_s=tune_seconds,
                                                chunks_max=chunks_max, seed=seed), profile_path=profile_path)
    baseline = make_baseline(profile, schedule="1f1b", gpus=gpus, microbatches=microbatches, pp=gpus,
                             cluster=cluster, profile_path=profile_path)
    paths = {"tuned": out_dir / "tuned.yaml", "1f1b": out_dir / "1f1b.yaml"}
    save_plan(result.plan, paths["tuned"])
    save_plan(baseline, paths["1f1b"])
    return paths


def free_comm(cluster: Cluster) -> Cluster:
    """The same cluster with a runtime that costs nothing: free transfers, no per-op overhead."""
    return replace(cluster, latency_us=0.0, intra_node_gbps=1e12, inter_node_gbps=1e12, op_overhead_us=0.0)


def predict(plan: Plan, profile: Profile) -> dict[str, float]:
    """The simulator's iteration on the plan's cluster and with free communication."""
    with_comm = simulate(plan, profile)
    free = simulate(replace(plan, cluster=free_comm(plan.cluster)), profile)
    out = {"predicted_ms": round(with_comm.iteration_ms, 3), "predicted_free_ms": round(free.iteration_ms, 3),
           "predicted_bubble": round(with_comm.bubble_ratio, 4)}
    return out


# Scheduling priority of the measured jobs (a nice value; None: leave as is). On a shared
# machine whose cores other jobs keep busy, a process waking from a sleep waits for a core; a
# negative nice value (root only) lets the sleeping ranks wake at once, so that the benchmark
# measures the runtime and not the neighbours. The ranks use almost no CPU, so this costs the
# other jobs little.
NICE: int | None = None


@contextmanager
def priority(nice: int | None):
    """Run the block (and the processes it starts) at ``nice``; restore the old value after."""
    if nice is None:
        yield
        return
    old = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, nice)
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, old)


def octorun_command(plan_path: str | Path, *, nprocs: int, steps: int, metrics: str | Path, trace: str | Path,
                    timeout_s: float = 120.0, port: int | None = None, extra_args: Sequence[str] = ()) -> list[str]:
    """The torchrun command line that runs a plan under octorun (run from the project folder)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs),
        "--master-addr", "127.0.0.1", "--master-port", str(port or free_port()),
        "-m", "octorun", str(plan_path), "--steps", str(steps), "--metrics", str(metrics), "--trace", str(trace),
        "--timeout", f"{timeout_s:g}", *extra_args,
    ]


def run_octorun(plan_path: str | Path, *, steps: int, warmup: int, out_dir: str | Path, tag: str,
                timeout_s: float = 120.0, extra_args: Sequence[str] = ()) -> dict[str, Any]:
    """Run a plan with torchrun + octorun for ``warmup + steps`` steps; medians of the timed steps.

    Returns ``median_ms`` (iteration, FORMATS.md section 7), ``step_median_ms``, ``all_ms``, the
    measured bubble ratio, the metrics and trace file paths and the wall time of the whole job.
    """
    plan = load_plan(plan_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics, trace = out_dir / f"{tag}.metrics.jsonl", out_dir / f"{tag}.trace.json"
    cmd = octorun_command(Path(plan_path).resolve(), nprocs=plan.cluster.gpus, steps=warmup + steps,
                          metrics=metrics.resolve(), trace=trace.resolve(), timeout_s=timeout_s, extra_args=extra_args)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log.info("octorun %s: %s", tag, " ".join(cmd))
    started = time.perf_counter()
    with priority(NICE):
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s * 2 + 120 + 10 * (warmup + steps))
    wall_s = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"octorun {plan_path} exited {proc.returncode}:\n{(proc.stderr or proc.stdout)[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    timed = rows[warmup:]
    return {
        "tag": tag,
        "plan": str(plan_path),
        "steps": steps,
        "warmup": warmup,
        "median_ms": round(statistics.median(r["iteration_ms"] for r in timed), 3),
        "step_median_ms": round(statistics.median(r["step_ms"] for r in timed), 3),
        "all_ms": [round(r["iteration_ms"], 3) for r in timed],
        "bubble_ratio": round(statistics.median(r["bubble_ratio"] for r in timed), 4),
        "losses": [r["loss"] for r in rows],
        "metrics": str(metrics),
        "trace": str(trace),
        "wall_s": round(wall_s, 1),
    }


# ---------------------------------------------------------------------------------------------
# 1. Fidelity
# ---------------------------------------------------------------------------------------------


def _plan_shape(plan: Plan) -> dict[str, Any]:
    ops = [op for rank_ops in plan.schedule for op in rank_ops]
    return {
        "stages": len(plan.stages),
        "stage_layers": [s.end - s.start for s in plan.stages],
        "ranks": [s.rank for s in plan.stages],
        "split_backward": any(op.kind is Kind.I for op in ops),
    }


def _op_ms(profile: Profile, plan: Plan) -> dict[str, float]:
    """Shortest and longest op the plan runs (F, I, W or fused B of a stage), in ms. Stage 0's
    I is left out: the replay never runs it (the model's input has no gradient)."""
    costs = plan_stage_costs(plan, LayerTable(profile))
    times = [op_ms(costs[op.stage], op.kind) for rank_ops in plan.schedule for op in rank_ops
             if not (op.kind is Kind.I and op.stage == 0)]
    return {"min_op_ms": round(min(times), 2), "max_op_ms": round(max(times), 2)}


@dataclass(frozen=True)
class CaseProfiles:
    profile: Profile  # what plans are made and predicted with
    path: Path
    nominal: Profile  # source times x time scale only
    per_layer_ms: dict[str, float] | None  # the calibration added to every layer, if any


def case_profiles(case: Case, case_dir: Path, *, per_layer_ms: dict[str, float] | None,
                  bytes_scale: float = DEFAULT_BYTES_SCALE) -> CaseProfiles:
    """The replay profiles of a case: nominal (source x time scale), and the one plans use —
    nominal plus ``per_layer_ms`` (:func:`calibrate`) on every layer when given."""
    nominal = derive_profile(case.source, case_dir / "replay-profile-nominal.yaml", time_scale=case.time_scale,
                             bytes_scale=bytes_scale)
    path = case_dir / "replay-profile.yaml"
    profile = derive_profile(case.source, path, time_scale=case.time_scale, bytes_scale=bytes_scale,
                             per_layer_ms=per_layer_ms)
    return CaseProfiles(profile, path, nominal, per_layer_ms)


def bench_fidelity(cases: Sequence[Case], link: Link, out_dir: str | Path, *, nprocs: int, microbatches: int,
                   steps: int, warmup: int, tune_seconds: float, per_layer_ms: dict[str, float] | None = None,
                   chunks_max: int = 3, bytes_scale: float = DEFAULT_BYTES_SCALE) -> list[dict]:
    """Tuned and 1F1B plans of each case's replay: predicted vs measured, and the speedups. The
    link's calibrated per-op overhead is the planning cluster's ``op_overhead_us``, so the tuner
    weighs it and the planner's prediction includes it."""
    rows = []
    cluster = link.cluster(nprocs)
    for case in cases:
        case_dir = Path(out_dir) / case.name
        profiles = case_profiles(case, case_dir, per_layer_ms=per_layer_ms, bytes_scale=bytes_scale)
        profile = profiles.profile
        paths = make_plans(profile, profiles.path, cluster, case_dir, microbatches=microbatches, tune_seconds=tune_seconds,
                           chunks_max=chunks_max)
        row: dict[str, Any] = {"case": case.name, "source": case.source, "time_scale": case.time_scale,
                               "nprocs": nprocs, "microbatches": microbatches, "cluster": cluster.to_dict(),
                               "per_layer_ms": profiles.per_layer_ms}
        for name in ("1f1b", "tuned"):
            plan = load_plan(paths[name])
            measured = run_octorun(paths[name], steps=steps, warmup=warmup, out_dir=case_dir, tag=name)
            entry = {**predict(plan, profile), **_plan_shape(plan), **_op_ms(profiles.nominal, plan), **measured,
                     "predicted_nominal_ms": round(simulate(plan, profiles.nominal).iteration_ms, 3),
                     "trace_split": trace_overheads(plan, profile, measured["trace"])}
            entry["error"] = round(entry["median_ms"] / entry["predicted_ms"] - 1, 4)
            entry["posthoc_ms"] = round(posthoc(plan, profile, entry["trace_split"]), 3)
            entry["error_posthoc"] = round(entry["median_ms"] / entry["posthoc_ms"] - 1, 4)
            row[name] = entry
            log.info("%s %s: predicted %.1f ms, measured %.1f ms (%+.1f%%)", case.name, name, entry["predicted_ms"],
                     entry["median_ms"], 100 * entry["error"])
        row["predicted_nominal_speedup"] = round(row["1f1b"]["predicted_nominal_ms"] / row["tuned"]["predicted_nominal_ms"], 4)
        row["predicted_speedup"] = round(row["1f1b"]["predicted_ms"] / row["tuned"]["predicted_ms"], 4)
        row["measured_speedup"] = round(row["1f1b"]["median_ms"] / row["tuned"]["median_ms"], 4)
        row["speedup_error"] = round(row["measured_speedup"] / row["predicted_speedup"] - 1, 4)
        rows.append(row)
    return rows


def posthoc(plan: Plan, profile: Profile, split: dict[str, Any]) -> float:
    """The simulator's iteration with the costs the run itself showed (from its trace,
    :func:`trace_overheads`): each layer's F, I, W plus the run's median excess per layer (a
    fused B's excess goes to the profile's fused backward, or to I when it has none and the plan no
    split one), its mean runtime gap per op, and its transfer time both ways
    averaged as the latency. Not a prediction: it tells whether the simulator's model of the
    schedule is right once the costs are, i.e. how much of an error is in the costs."""
    extra = dict(split["excess_per_layer_ms"])
    fused = extra.get("B")
    if fused is not None and "I" not in extra and not profile.measures_fused_backward:  # B = I + W: its excess goes to I
        extra["I"] = fused
    layers = tuple(layer.map_times(lambda kind, ms: max(0.0, ms + extra.get(kind, 0.0))) for layer in profile.layers)
    # the run's gap per op is the cluster's per-op overhead (a fused B pays it once, as any op)
    gap_ms = max(0.0, split["dispatch_gap_ms"].get("mean", 0.0))
    measured = replace(plan, cluster=replace(plan.cluster, latency_us=1000.0 * (split["latency_ms"] or 0.0), op_overhead_us=1000.0 * gap_ms))
    return simulate(measured, replace(profile, layers=layers)).iteration_ms


def fidelity_table(rows: list[dict]) -> str:
    """Per case and plan: predictions (nominal; the planner's, from the calibrated profile and
    cluster the plan was made with), the measured median and the error, the post hoc check,
    then the speedups tuned / 1F1B."""
    lines = [
        "| profile (time scale) | plan | stages | op ms | predicted ms: nominal | planner's "
        "| measured ms (min–max) | error | post hoc ms (error) | speedup: predicted | measured | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def pct(value: float | None) -> str:
        return "–" if value is None else f"{100 * value:+.1f}%"

    for row in rows:
        for name in ("1f1b", "tuned"):
            e = row[name]
            if name == "tuned":
                speed = f"{row['predicted_speedup']:.3f} | {row['measured_speedup']:.3f} | {pct(row['speedup_error'])}"
            else:
                speed = "| |"
            lines.append(
                f"| {row['case']} ({row['time_scale']:g}) | {name} | {e['stages']}{' I/W' if e['split_backward'] else ''} "
                f"| {e['min_op_ms']:.0f}–{e['max_op_ms']:.0f} | {e['predicted_nominal_ms']:.1f} | {e['predicted_ms']:.1f} "
                f"| {e['median_ms']:.1f} ({min(e['all_ms']):.0f}–{max(e['all_ms']):.0f}) | {pct(e['error'])} "
                f"| {e.get('posthoc_ms', float('nan')):.1f} ({pct(e.get('error_posthoc'))}) "
                f"| {speed} |"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# 2. Side by side with PyTorch
# ---------------------------------------------------------------------------------------------


def bench_torch(case: Case, link: Link, out_dir: str | Path, *, nprocs: int, microbatches: int, steps: int,
                warmup: int, tune_seconds: float, schedules: Sequence[str] | None = None,
                tuned_plan: str | Path | None = None, per_layer_ms: dict[str, float] | None = None,
                chunks_max: int = 3) -> dict[str, Any]:
    """torch's schedules and octorun's tuned plan on the same replay, processes and microbatches.

    octorun runs before and after torch's schedules; its figure is the median over both runs'
    timed steps. Ratios are torch's median / octorun's (> 1: octorun is faster), against
    octorun's ``step_ms`` (the figure measured like torch's) and its ``iteration_ms``.
    """
    from benchmarks.torch_pipelines import TORCH_SCHEDULES, run_torch_schedule

    case_dir = Path(out_dir) / f"torch-{case.name}"
    if tuned_plan is None:
        profiles = case_profiles(case, case_dir, per_layer_ms=per_layer_ms)
        tuned_plan = make_plans(profiles.profile, profiles.path, link.cluster(nprocs), case_dir, microbatches=microbatches,
                                tune_seconds=tune_seconds, chunks_max=chunks_max)["tuned"]
    plan = load_plan(tuned_plan)
    profile = load_profile(plan.profile)
    before = run_octorun(tuned_plan, steps=steps, warmup=warmup, out_dir=case_dir, tag="tuned-before")
    torch_rows = []
    for name in schedules or list(TORCH_SCHEDULES):
        with priority(NICE):
            row = run_torch_schedule(case.source, name, nprocs=nprocs, microbatches=microbatches, time_scale=case.time_scale,
                                     steps=steps, warmup=warmup, partition_method="balanced",
                                     latency_ms=link.latency_ms)
        torch_rows.append(row)
        log.info("torch %s: median %.1f ms", name, row["median_ms"])
    after = run_octorun(tuned_plan, steps=steps, warmup=warmup, out_dir=case_dir, tag="tuned-after")
    runs = [before, after]
    octo = {
        **predict(plan, profile), **_plan_shape(plan),
        "median_ms": round(statistics.median(ms for r in runs for ms in r["all_ms"]), 3),
        "step_median_ms": round(statistics.median([r["step_median_ms"] for r in runs]), 3),
        "runs": runs,
    }
    for row in torch_rows:
        row["ratio_vs_octorun_step"] = round(row["median_ms"] / octo["step_median_ms"], 4)
        row["ratio_vs_octorun_iteration"] = round(row["median_ms"] / octo["median_ms"], 4)
    best = min(torch_rows, key=lambda r: r["median_ms"])
    return {"case": case.name, "time_scale": case.time_scale, "nprocs": nprocs, "microbatches": microbatches,
            "octorun": octo, "torch": torch_rows, "best_torch": best["schedule"],
            "octorun_faster_than_best": octo["step_median_ms"] < best["median_ms"]}


def torch_table(result: dict[str, Any]) -> str:
    octo = result["octorun"]
    lines = [
        "| runtime / schedule | stages | median ms (min–max) | torch / octorun (step) | torch / octorun (iteration) |",
        "|---|---|---|---|---|",
    ]
    all_ms = [ms for r in octo["runs"] for ms in r["all_ms"]]
    lines.append(f"| octorun, tuned plan: iteration_ms | {octo['stages']} | {octo['median_ms']:.1f} "
                 f"({min(all_ms):.0f}–{max(all_ms):.0f}) | | |")
    lines.append(f"| octorun, tuned plan: step_ms | {octo['stages']} | {octo['step_median_ms']:.1f} | 1 | |")
    for row in result["torch"]:
        lines.append(f"| torch {row['schedule']} | {len(row['stages'])} | {row['median_ms']:.1f} "
                     f"({min(row['all_ms']):.0f}–{max(row['all_ms']):.0f}) | {row['ratio_vs_octorun_step']:.3f} "
                     f"| {row['ratio_vs_octorun_iteration']:.3f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# 3. Overhead
# ---------------------------------------------------------------------------------------------


def trace_overheads(plan: Plan, profile: Profile, trace_path: str | Path) -> dict[str, Any]:
    """Split the last step's time per op, from octorun's trace (:func:`octoplan.calibrate.split_trace`).

    - ``op_excess_ms``: measured op duration - the profile's (sleep overshoot + the runtime's and
      autograd's own work inside the op); ``excess_per_layer_ms``: its median per layer, by kind;
    - ``dispatch_gap_ms``: the gap between an op and the previous op on its rank when nothing from
      another rank held it up (its input message, if any, was due by the previous op's end):
      pure runtime time;
      ``dispatch_gap_share``: the largest sum of them on one rank over the iteration;
    - ``transfer_ms``: for ops whose input message came last, their start - the producing op's
      end on the other rank (send + receive + hand-over to the compute thread), which includes
      the offset between the ranks' clocks (an op whose message may still have been on its way
      counts as neither a gap nor a transfer); ``transfer_both_ways_ms`` cancels it (the median
      over rank pairs of the mean of both directions' median waits) and ``clock_offset_ms``
      shows it per pair; ``latency_ms``: that less the mean gap, which the wait holds (the
      producer posts its send after its op) and the simulator charges to the producing op.
    """
    split = split_trace(plan, profile, trace_path)
    per_layer: dict[str, list[float]] = {}
    per_op: dict[str, list[float]] = {}
    for o in split.ops:
        per_layer.setdefault(o.op.kind.value, []).append(o.excess_ms / o.layers)
        per_op.setdefault(o.op.kind.value, []).append(o.excess_ms)

    def stats(xs: list[float]) -> dict[str, float]:
        if not xs:
            return {"count": 0}
        return {"count": len(xs), "mean": round(statistics.fmean(xs), 4), "median": round(statistics.median(xs), 4),
                "max": round(max(xs), 4)}

    iteration_ms = split.iteration_ms
    return {"op_excess_ms": stats([o.excess_ms for o in split.ops]), "dispatch_gap_ms": stats(split.gaps),
            "transfer_ms": stats(split.transfers),
            # octorun's own time on the rank it costs most: gaps while the next op's input was due
            "dispatch_gap_share": round(max(split.gap_ms_by_thread.values(), default=0.0) / iteration_ms, 4) if iteration_ms > 0 else None,
            "transfer_both_ways_ms": round(split.wait_ms, 4) if split.pairs else None,
            "latency_ms": round(latency, 4) if (latency := calibration_of(split).latency_ms) is not None else None,
            "clock_offset_ms": {pair: round(ms, 3) for pair, ms in split.offsets_ms.items()},
            "excess_per_layer_ms": {kind: round(statistics.median(xs), 4) for kind, xs in sorted(per_layer.items())},
            "excess_per_op_ms": {kind: round(statistics.median(xs), 4) for kind, xs in sorted(per_op.items())}}


def bench_overhead(link: Link, out_dir: str | Path, *, nprocs: int, microbatches: int, steps: int, warmup: int,
                   op_ms: float = 10.0, schedules: Sequence[str] = ("1f1b", "zb-h1"),
                   shapes: Sequence[str] = ("static",), layers_per_stage: int = 1) -> list[dict]:
    """Uniform 10 ms ops: measured vs the simulator with free communication (the runtime's whole
    cost, transfers included) and with the measured link (the runtime's cost beyond the link).
    ``shapes``: ``static`` (octorun's default: layouts sent in step 0 only) and/or ``dynamic``
    (``--dynamic-shapes``: a header before every message), each schedule run once per mode.
    ``layers_per_stage`` > 1: each 10 ms op is that many replay layers (the calibration's second
    job, which separates a replay op's fixed cost from its cost per layer)."""
    out_dir = Path(out_dir) / ("overhead" if layers_per_stage == 1 else f"overhead-{layers_per_stage}-layers")
    profile_path = out_dir / "uniform-profile.yaml"
    profile = uniform_replay_profile(profile_path, num_layers=nprocs * layers_per_stage, op_ms=op_ms / layers_per_stage)
    cluster = link.cluster(nprocs)
    rows = []
    for schedule in schedules:
        plan = make_baseline(profile, schedule=schedule, gpus=nprocs, microbatches=microbatches, pp=nprocs,
                             cluster=cluster, profile_path=str(profile_path.resolve()))
        plan_path = out_dir / f"{schedule}.yaml"
        save_plan(plan, plan_path)
        for mode in shapes:
            tag = schedule if mode == "static" else f"{schedule}-{mode}"
            extra = ("--dynamic-shapes",) if mode == "dynamic" else ()
            rows.append(_overhead_row(plan, profile, schedule, mode, run_octorun(plan_path, steps=steps, warmup=warmup,
                                                                                 out_dir=out_dir, tag=tag, extra_args=extra),
                                      op_ms=op_ms, nprocs=nprocs, microbatches=microbatches))
            rows[-1]["layers_per_stage"] = layers_per_stage
            log.info("overhead %s (%s shapes): measured %.1f ms, free-comm prediction %.1f ms: %.2f%%", schedule, mode,
                     rows[-1]["median_ms"], rows[-1]["predicted_free_ms"], 100 * rows[-1]["overhead"])
    return rows


def _overhead_row(plan: Plan, profile: Profile, schedule: str, shapes: str, measured: dict, *, op_ms: float, nprocs: int,
                  microbatches: int) -> dict:
    pred = predict(plan, profile)
    ops_per_rank = max(len(ops) for ops in plan.schedule)
    return {
        "schedule": schedule, "shapes": shapes, "op_ms": op_ms, "nprocs": nprocs, "microbatches": microbatches,
        **pred, **measured,
        "overhead": round((measured["median_ms"] - pred["predicted_free_ms"]) / measured["median_ms"], 4),
        "overhead_beyond_link": round((measured["median_ms"] - pred["predicted_ms"]) / measured["median_ms"], 4),
        "overhead_per_op_ms": round((measured["median_ms"] - pred["predicted_free_ms"]) / ops_per_rank, 4),
        "ops_per_rank": ops_per_rank,
        "trace": {**trace_overheads(plan, profile, measured["trace"]), "file": measured["trace"]},
    }


def overhead_table(rows: list[dict]) -> str:
    lines = [
        "| plan | shapes | ops/rank | predicted, free comm ms | predicted, measured link ms | measured ms (min–max) "
        "| overhead | beyond the link | per op ms | op excess ms (mean) | dispatch gap ms (median) | octorun's gaps, busiest rank "
        "| transfer ms (median) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["trace"]
        lines.append(
            f"| {r['schedule']} | {r.get('shapes', 'dynamic')} | {r['ops_per_rank']} | {r['predicted_free_ms']:.1f} | {r['predicted_ms']:.1f} "
            f"| {r['median_ms']:.1f} ({min(r['all_ms']):.0f}–{max(r['all_ms']):.0f}) | {100 * r['overhead']:.2f}% "
            f"| {100 * r['overhead_beyond_link']:.2f}% | {r['overhead_per_op_ms']:.3f} "
            f"| {t['op_excess_ms'].get('mean', float('nan')):.3f} | {t['dispatch_gap_ms'].get('median', float('nan')):.3f} "
            f"| {100 * (t.get('dispatch_gap_share') or float('nan')):.2f}% "
            f"| {t['transfer_ms'].get('median', float('nan')):.3f} |"
        )
    return "\n".join(lines)


CALIBRATION_LAYERS = 4  # replay layers per op in the calibration's second job


@dataclass(frozen=True)
class Calibration:
    """What the replay and the transport really cost inside an 8-process octorun job here."""

    per_layer_ms: dict[str, float]  # F, I, W: a replay layer's cost beyond its sleep
    latency_ms: float  # a transfer: producing op's end -> consuming op's start, when it waited
    op_ms: float  # per op: the runtime's gap between two ops, plus a replay op's fixed cost
    per_op_ms: dict[str, float] | None = None  # F, I, W: that fixed cost (None: one job, all per layer)

    def link(self, measured: Link) -> Link:
        """``measured`` with this latency and per-op overhead: the cluster plans are made and predicted for."""
        return replace(measured, latency_ms=self.latency_ms, latency_median_ms=self.latency_ms, op_overhead_ms=self.op_ms)


def calibrate(overhead_rows: list[dict], stacked_rows: list[dict] | None = None) -> Calibration:
    """Calibrate from the overhead benchmark's zb-h1 run (one 10 ms layer per stage, I/W split)
    and, when given, the same plan with each op made of ``layers_per_stage`` shorter layers.

    A replayed op's cost beyond its sleeps (the wait for a core after each sleep, autograd's
    work and the runtime's inside the op) has a part per op and a part per layer: with one job
    only, all of it is taken per layer, the median over the last step of (measured op -
    profile op) per kind. With the stacked job, per kind, the per-op medians of the two jobs
    (1 and k layers) give the part per layer, (e_k - e_1) / (k - 1), and the part per op, e_1
    less that; the parts per op, averaged over F, I and W, join the runtime's gap in the
    planning cluster's ``op_overhead_us`` (one figure for every op). Latency: the time from a
    producing op's end to the consuming op's start on another rank, for ops that waited for
    their message (send, receive, hand-over to the compute thread), both directions averaged
    (``transfer_both_ways_ms``), less the mean gap per op, which that wait holds and the plan
    charges per op (``latency_ms``). Per op: the mean gap between consecutive ops of a rank
    that waited for nothing. A two-process ping-pong (:func:`measure_link`) swings between 0.15
    and 2 ms from one minute to the next here and misses the hand-over; this is measured in a
    job of the same processes as the runs it is used for.
    """
    def zb_row(rows: list[dict]) -> dict:
        row = next((r for r in rows if r["schedule"] == "zb-h1" and r.get("shapes", "static") == "static"), None)
        if row is None:
            raise ValueError("calibration needs the overhead benchmark's zb-h1 run")
        return row

    trace = zb_row(overhead_rows)["trace"]
    gap = max(0.0, trace["dispatch_gap_ms"]["mean"])
    if not stacked_rows:
        return Calibration(per_layer_ms={kind: max(0.0, trace["excess_per_layer_ms"][kind]) for kind in "FIW"},
                           latency_ms=trace["latency_ms"] or 0.0, op_ms=gap)
    stacked = zb_row(stacked_rows)
    k = stacked["layers_per_stage"]
    one, many = trace["excess_per_op_ms"], stacked["trace"]["excess_per_op_ms"]
    per_layer = {kind: max(0.0, (many[kind] - one[kind]) / (k - 1)) for kind in "FIW"}
    per_op = {kind: max(0.0, one[kind] - per_layer[kind]) for kind in "FIW"}
    return Calibration(per_layer_ms=per_layer, latency_ms=trace["latency_ms"] or 0.0,
                       op_ms=gap + statistics.fmean(per_op.values()), per_op_ms=per_op)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def report(results: dict[str, Any]) -> str:
    """The markdown of a run's results (what ``main`` prints, and ``report`` prints again)."""
    ping = results["link"]
    parts = [f"gloo ping-pong: one-way latency mean {ping['latency_ms']:.3f} ms (median {ping['latency_median_ms']:.3f}), "
             f"{ping['gbps']:.2f} GB/s"]
    if "calibration" in results:
        cal = results["calibration"]
        parts.append(f"calibration (in-job): transfer {cal['latency_ms']:.3f} ms, runtime per op {cal.get('op_ms', 0):.3f} ms, "
                     f"replay layer cost beyond its sleep per layer {cal['per_layer_ms']} ms"
                     + (f", per op {cal['per_op_ms']} ms (in the runtime's per-op figure)" if cal.get("per_op_ms") else ""))
    if "overhead" in results:
        parts.append("## Overhead\n\n" + overhead_table(results["overhead"]))
    if "fidelity" in results:
        for row in results["fidelity"]:  # runs from before post hoc existed: add it from the files
            for name in ("1f1b", "tuned"):
                e = row[name]
                if "posthoc_ms" not in e and Path(e["trace"]).exists():
                    plan = load_plan(e["plan"])
                    # the profile beside the plan: the one it was made with, even if the folder moved
                    beside = Path(e["plan"]).parent / "replay-profile.yaml"
                    profile = load_profile(beside if beside.exists() else plan.profile)
                    e["posthoc_ms"] = round(posthoc(plan, profile, trace_overheads(plan, profile, e["trace"])), 3)
                    e["error_posthoc"] = round(e["median_ms"] / e["posthoc_ms"] - 1, 4)
        parts.append("## Fidelity\n\n" + fidelity_table(results["fidelity"]))
    if "torch" in results:
        parts.append("## Side by side with PyTorch\n\n" + torch_table(results["torch"]))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", choices=["fidelity", "torch", "overhead", "all", "report"],
                        help="report: print the tables of an earlier run's JSON (--out/all.json or --json)")
    parser.add_argument("--json", help="with report: the results file (default OUT/all.json)")
    parser.add_argument("--case", action="append", type=Case.parse, default=[],
                        help="PROFILE.yaml:TIME_SCALE (repeatable; default: the three of DEFAULT_CASES)")
    parser.add_argument("--torch-case", type=Case.parse, help="case of the torch comparison (default: the first case)")
    parser.add_argument("--nprocs", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps dropped before timing")
    parser.add_argument("--tune-seconds", type=float, default=30.0)
    parser.add_argument("--latency-us", type=float, help="skip measuring the link: use this one-way latency")
    parser.add_argument("--gbps", type=float, default=1.0, help="with --latency-us: the link's bandwidth")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="plan with source times x time scale only, without the replay layer's measured fixed cost")
    parser.add_argument("--chunks-max", type=int, default=3, help="the tuner's most stages per rank")
    parser.add_argument("--nice", type=int, help="run the measured jobs at this nice value (e.g. -10; needs root)")
    parser.add_argument("--out", default="out/bench-runtime")
    args = parser.parse_args(argv)
    global NICE
    NICE = args.nice
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("octoplan.tuner").setLevel(logging.WARNING)
    out = Path(args.out)
    if args.bench == "report":
        print(report(json.loads(Path(args.json or out / "all.json").read_text())))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    cases = args.case or list(DEFAULT_CASES)
    if args.latency_us is not None:
        link = Link(latency_ms=args.latency_us / 1000, latency_median_ms=args.latency_us / 1000, gbps=args.gbps)
    else:
        with priority(NICE):
            link = measure_link()
    log.info("link: %s", link)
    common = dict(nprocs=args.nprocs, microbatches=args.microbatches, steps=args.steps, warmup=args.warmup)
    results: dict[str, Any] = {"link": link.to_dict(), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                               "args": {k: v for k, v in vars(args).items() if k not in ("case", "torch_case")},
                               "cases": [vars(c) for c in cases]}
    per_layer = None
    if args.bench in ("overhead", "all") or not args.no_calibrate:
        # the overhead runs double as the calibration of the replay layer's fixed cost
        schedules = ("1f1b", "zb-h1") if args.bench in ("overhead", "all") else ("zb-h1",)
        shapes = ("static", "dynamic") if args.bench == "overhead" else ("static",)
        results["overhead"] = bench_overhead(link, out, schedules=schedules, shapes=shapes, **common)
        if not args.no_calibrate:
            # the same zb-h1 plan with each 10 ms op made of CALIBRATION_LAYERS replay layers
            results["overhead_stacked"] = bench_overhead(link, out, schedules=("zb-h1",),
                                                         layers_per_stage=CALIBRATION_LAYERS, **common)
            calibration = calibrate(results["overhead"], results["overhead_stacked"])
            per_layer, link = calibration.per_layer_ms, calibration.link(link)
            results["calibration"] = {"per_layer_ms": per_layer, "per_op_ms": calibration.per_op_ms,
                                      "latency_ms": calibration.latency_ms, "op_ms": calibration.op_ms}
            log.info("calibration: %s", calibration)
    if args.bench in ("fidelity", "all"):
        results["fidelity"] = bench_fidelity(cases, link, out, tune_seconds=args.tune_seconds, per_layer_ms=per_layer,
                                             chunks_max=args.chunks_max, **common)
    if args.bench in ("torch", "all"):
        case = args.torch_case or cases[0]
        tuned = None
        if "fidelity" in results and (out / case.name / "tuned.yaml").exists() and case in cases:
            tuned = out / case.name / "tuned.yaml"
        results["torch"] = bench_torch(case, link, out, tune_seconds=args.tune_seconds, tuned_plan=tuned,
                                       per_layer_ms=per_layer, chunks_max=args.chunks_max, **common)
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    (out / f"{args.bench}.json").write_text(json.dumps(results, indent=2))
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
