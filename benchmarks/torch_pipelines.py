"""Side by side with PyTorch: the replay model under torch.distributed.pipelining's own schedules.

Runs, on ``nprocs`` CPU processes with gloo, the replay model (``examples/models/replay.py``:
layers that sleep ``time_scale`` times a profile's forward / input-grad / weight-grad times) split
into stages, under one of torch's schedules, each with its natural stage count and placement:

==========================  ================  ===================================
name                        stages per rank   placement (stage -> rank)
==========================  ================  ===================================
``1F1B``                    1                 s
``Interleaved1F1B``         2                 s mod pp (loop)
``InterleavedZeroBubble``   2                 s mod pp (loop)
``ZBVZeroBubble``           2                 V: rank r holds r and 2*pp-1-r
==========================  ================  ===================================

The layers are split into stages by :func:`octoplan.partition.partition` (``balanced`` by
default). Every process builds only its stages' layers (the seeding of docs/FORMATS.md section 4), feeds the same
microbatches, and times ``schedule.step``: an iteration is the time from the first process
entering ``step`` (after a barrier) to the last one leaving it, read on the one monotonic clock
all processes share. The first ``warmup`` steps (torch infers shapes and opens its connections in
the first) are dropped; ``median_ms`` is the median of the next ``steps``.

Beside each measurement stands ``sim_ms``: octoplan's simulator run on the very op order torch
executed (read back from the schedule object), with the replay's times and free communication —
what that order costs with no runtime overhead — and ``sim_latency_ms``, the same with a measured
gloo one-way latency on every transfer between ranks (on a busy machine that latency is a
process wake-up, milliseconds). ``run_torch_plan`` runs an octoplan plan instead,
exported with :func:`octoplan.export.export_torch_csv` and loaded into torch's
``_PipelineScheduleRuntime``.

Sleeps cost no CPU, so 8 processes on 2 cores measure schedules, not the machine; the runtime's
own Python work (autograd bookkeeping, gloo transfers) is real and is part of what is measured.

Command line (writes a JSON file and prints a markdown table)::

    .venv/bin/python benchmarks/torch_pipelines.py --write-profile /tmp/replay12.yaml \\
        --nprocs 4 --microbatches 8 --time-scale 2 --steps 5 --json /tmp/torch.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from octoplan.errors import InputError  # noqa: E402
from octoplan.ops import parse_op  # noqa: E402
from octoplan.partition import partition  # noqa: E402
from octoplan.plan import Cluster, Parallel, Plan, Stage, load_plan, resolve_profile_path  # noqa: E402
from octoplan.profile import Layer, ModelRef, Profile, load_profile, save_profile  # noqa: E402
from octoplan.schedules.placement import loop_placement, v_placement  # noqa: E402
from octorun.runtime import free_port  # noqa: E402

__all__ = [
    "TORCH_SCHEDULES",
    "TorchSchedule",
    "run_torch_schedule",
    "run_torch_plan",
    "check_iw_split",
    "measure_gloo_latency_ms",
    "demo_profile",
    "markdown_table",
]

log = logging.getLogger("benchmarks.torch_pipelines")

REPLAY_MODEL = ROOT / "examples" / "models" / "replay.py"


@dataclass(frozen=True)
class TorchSchedule:
    name: str
    class_name: str  # in torch.distributed.pipelining.schedules
    stages_per_rank: int
    placement: str  # "loop" or "v"

    def ranks(self, pp: int) -> list[int]:
        num_stages = pp * self.stages_per_rank
        return v_placement(pp, num_stages) if self.placement == "v" else loop_placement(pp, num_stages)


TORCH_SCHEDULES: dict[str, TorchSchedule] = {
    s.name: s
    for s in (
        TorchSchedule("1F1B", "Schedule1F1B", 1, "loop"),
        TorchSchedule("Interleaved1F1B", "ScheduleInterleaved1F1B", 2, "loop"),
        TorchSchedule("InterleavedZeroBubble", "ScheduleInterleavedZeroBubble", 2, "loop"),
        TorchSchedule("ZBVZeroBubble", "ScheduleZBVZeroBubble", 2, "v"),
    )
}

# Runtime for an exported octoplan plan (run_torch_plan), not a schedule of its own.
_CSV_RUNTIME = "_PipelineScheduleRuntime"


@dataclass(frozen=True)
class _Job:
    """What every process needs to run one configuration."""

    profile_path: str
    time_scale: float
    stages: tuple[tuple[int, int, int], ...]  # (start, end, rank)
    class_name: str
    microbatches: int
    microbatch_size: int
    warmup: int
    steps: int
    csv_path: str | None = None  # for _CSV_RUNTIME


# ---------------------------------------------------------------------------------------------
# A profile to replay
# ---------------------------------------------------------------------------------------------


def demo_profile(*, path: str | Path | None = None, time_scale: float = 1.0) -> Profile:
    """12 heterogeneous layers: a cheap embedding, 10 blocks of which every third is heavier
    (an MoE-like block), and a costly head. Times in ms per microbatch before ``time_scale``.

    With ``path`` (where the profile will be saved), its model is the replay of itself at
    ``time_scale``, so plans made from it run under octorun as they do here."""
    layers = [Layer("embed", "embedding", 0.5, 0.2, 1.0, 8 << 20, 2 << 20, 1 << 20)]
    for i in range(10):
        heavy = i % 3 == 2
        f, i_ms, w_ms = (3.0, 3.0, 2.5) if heavy else (2.0, 2.0, 1.5)
        layers.append(Layer(f"block.{i}", "moe" if heavy else "transformer", f, i_ms, w_ms, 16 << 20, 6 << 20, 1 << 20))
    layers.append(Layer("head", "head", 4.0, 3.0, 3.0, 32 << 20, 4 << 20, 1 << 20))
    model = ModelRef("replay12")
    if path is not None:
        config = {"profile": str(path), "time_scale": time_scale}
        model = ModelRef("replay12", source=str(REPLAY_MODEL.relative_to(ROOT)), config=config)
    return Profile(model=model, layers=tuple(layers), microbatch_size=1)


def _scaled(profile: Profile, time_scale: float) -> Profile:
    layers = tuple(layer.map_times(lambda _, ms: ms * time_scale) for layer in profile.layers)
    return replace(profile, layers=layers)


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------


class _Chain(torch.nn.Module):
    """A stage: consecutive replay layers (each takes and returns one tensor)."""

    def __init__(self, layers: list[torch.nn.Module]):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _model(job: _Job):
    from octoplan.modelfile import load_model_file

    return load_model_file(REPLAY_MODEL, {"profile": job.profile_path, "time_scale": job.time_scale})


def _make_schedule(job: _Job, stages: list, loss_fn):
    from torch.distributed.pipelining import schedules as torch_schedules

    cls = getattr(torch_schedules, job.class_name)
    if job.class_name == "Schedule1F1B":
        return cls(stages[0], n_microbatches=job.microbatches, loss_fn=loss_fn)
    schedule = cls(stages, n_microbatches=job.microbatches, loss_fn=loss_fn)
    if job.csv_path is not None:
        schedule._load_csv(job.csv_path, format="compute_only")
    return schedule


def _one_f_one_b_order(pp: int, num_mb: int) -> dict[str, list[str]]:
    """The op order of Schedule1F1B's hand-written loop: ``pp - r`` forwards, then B/F pairs, then
    the remaining backwards. (Its ``_get_pipeline_order`` is not usable: in torch 2.13 the last
    rank's list there skips ``F0`` and ends with ``F<num_mb>``.)"""
    order = {}
    for rank in range(pp):
        warmup = min(num_mb, pp - rank)
        ops = [f"{rank}F{m}" for m in range(warmup)]
        fwd, bwd = warmup, 0
        while bwd < num_mb:
            ops.append(f"{rank}B{bwd}")
            bwd += 1
            if fwd < num_mb:
                ops.append(f"{rank}F{fwd}")
                fwd += 1
        order[str(rank)] = ops
    return order


def _executed_order(schedule, job: _Job, pp: int) -> dict[str, list[str]]:
    """Every rank's compute ops as torch runs them (bubbles, ``None``, dropped)."""
    if job.class_name == "Schedule1F1B":
        return _one_f_one_b_order(pp, job.microbatches)
    return {str(rank): [str(a) for a in actions if a is not None] for rank, actions in schedule.pipeline_order.items()}


def _worker(rank: int, world: int, port: int, job: _Job, result_path: str) -> None:
    from torch.distributed.pipelining import PipelineStage

    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120),
    )
    try:
        torch.set_num_threads(1)  # many processes on few cores; the layers do no real math
        model = _model(job)
        mine = [s for s, (_, _, r) in enumerate(job.stages) if r == rank]
        stages = []
        params = []
        for s in mine:
            start, end, _ = job.stages[s]
            chain = _Chain([model.build_layer(i) for i in range(start, end)])
            params += list(chain.parameters())
            stages.append(PipelineStage(chain, s, len(job.stages), torch.device("cpu")))
        schedule = _make_schedule(job, stages, model.loss)
        opt = torch.optim.SGD(params, lr=1e-3)
        pairs = [model.sample_batch(job.microbatch_size, step=0, replica=0, mb=j) for j in range(job.microbatches)]
        inputs, targets = torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])
        all_ms: list[float] = []
        losses: list[float] = []
        for step in range(job.warmup + job.steps):
            opt.zero_grad()
            mb_losses: list[torch.Tensor] = []
            torch.distributed.barrier()
            t0 = time.perf_counter()
            schedule.step(inputs, target=targets, losses=mb_losses)
            t1 = time.perf_counter()
            opt.step()
            # perf_counter is CLOCK_MONOTONIC, one clock for every process on the machine
            spans: list[Any] = [None] * world
            torch.distributed.all_gather_object(spans, (t0, t1))
            if step >= job.warmup:
                all_ms.append(1000.0 * (max(e for _, e in spans) - min(s for s, _ in spans)))
            if mb_losses:
                losses.append(torch.stack(mb_losses).mean().item())
        if rank == 0:
            order = _executed_order(schedule, job, world)
            Path(result_path).write_text(json.dumps({"all_ms": all_ms, "order": order}))
        holder = job.stages[-1][2]
        if rank == holder:
            Path(result_path + ".loss").write_text(json.dumps(losses))
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def _launch(job: _Job, nprocs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="octopipe-torch-") as tmp:
        result = os.path.join(tmp, "result.json")
        torch.multiprocessing.spawn(_worker, args=(nprocs, free_port(), job, result), nprocs=nprocs, join=True)
        out = json.loads(Path(result).read_text())
        out["losses"] = json.loads(Path(result + ".loss").read_text())
    return out


def _simulated_ms(profile: Profile, job: _Job, order: dict[str, list[str]], pp: int, *, latency_ms: float = 0.0) -> float:
    """octoplan's simulator on torch's executed order, replay times; each transfer between ranks
    costs ``latency_ms`` (the replay's tensors are a few KB: bandwidth is left free)."""
    from octoplan.simulator import simulate

    plan = Plan(
        model=profile.model,
        cluster=Cluster(gpus=pp, gpus_per_node=pp, latency_us=1000.0 * latency_ms, intra_node_gbps=1e9, inter_node_gbps=1e9),
        parallel=Parallel(pp=pp, microbatches=job.microbatches),
        stages=tuple(Stage(a, b, r) for a, b, r in job.stages),
        schedule=tuple(tuple(parse_op(s) for s in order[str(r)]) for r in range(pp)),
    )
    return simulate(plan, _scaled(profile, job.time_scale)).iteration_ms


def _summary(raw: dict[str, Any], profile: Profile, job: _Job, pp: int, *, latency_ms: float | None, **extra: Any) -> dict[str, Any]:
    all_ms = [round(ms, 3) for ms in raw["all_ms"]]
    timed = job.time_scale > 0  # with time_scale 0 the run measures the runtime's own overhead
    with_latency = {}
    if latency_ms is not None:
        sim = _simulated_ms(profile, job, raw["order"], pp, latency_ms=latency_ms) if timed else 0.0
        with_latency = {"latency_ms": latency_ms, "sim_latency_ms": round(sim, 3)}
    return {
        **extra,
        "nprocs": pp,
        "microbatches": job.microbatches,
        "time_scale": job.time_scale,
        "stages": [list(s) for s in job.stages],
        "median_ms": round(statistics.median(all_ms), 3),
        "all_ms": all_ms,
        "sim_ms": round(_simulated_ms(profile, job, raw["order"], pp), 3) if timed else 0.0,
        **with_latency,
        "losses": raw["losses"],
    }


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def run_torch_schedule(
    profile_path: str | Path,
    schedule_name: str,
    *,
    nprocs: int,
    microbatches: int,
    time_scale: float,
    steps: int,
    warmup: int = 2,
    partition_method: str = "balanced",
    latency_ms: float | None = None,
) -> dict[str, Any]:
    """Median iteration of the replay of ``profile_path`` under one of torch's schedules.

    Returns ``median_ms``, ``all_ms`` (the timed steps), ``sim_ms`` (see module docstring; with
    ``latency_ms`` also ``sim_latency_ms``, the same with that cost per transfer), the stage
    layout, and the mean loss of every step (warm-up included) as a sign of life.
    """
    if schedule_name not in TORCH_SCHEDULES:
        raise InputError(None, "schedule", f"unknown torch schedule {schedule_name!r}", f"use one of {', '.join(TORCH_SCHEDULES)}")
    spec = TORCH_SCHEDULES[schedule_name]
    profile_path = str(Path(profile_path).resolve())  # every process reads it, from any directory
    profile = load_profile(profile_path)
    ranks = spec.ranks(nprocs)
    bounds = partition(profile, len(ranks), partition_method, file=profile_path)
    job = _Job(
        profile_path=profile_path, time_scale=time_scale,
        stages=tuple((a, b, r) for (a, b), r in zip(bounds, ranks)), class_name=spec.class_name,
        microbatches=microbatches, microbatch_size=profile.microbatch_size, warmup=warmup, steps=steps,
    )
    log.info("torch %s on %d processes: stages %s", schedule_name, nprocs, job.stages)
    raw = _launch(job, nprocs)
    return _summary(raw, profile, job, nprocs, latency_ms=latency_ms, schedule=schedule_name, partition=partition_method)


def run_torch_plan(
    plan_path: str | Path, *, time_scale: float, steps: int, warmup: int = 2, latency_ms: float | None = None,
) -> dict[str, Any]:
    """An octoplan plan (e.g. a tuned one), exported to torch's CSV, run by torch's runtime on the
    replay of the plan's profile; same measurement as :func:`run_torch_schedule`."""
    from octoplan.export import export_torch_csv

    plan = load_plan(plan_path)
    if plan.parallel.dp != 1:
        raise InputError(str(plan_path), "parallel.dp", f"is {plan.parallel.dp}", "this benchmark runs one pipeline: use a dp = 1 plan")
    found = resolve_profile_path(plan, plan_path)
    if found is None:
        raise InputError(str(plan_path), "profile", f"profile {plan.profile!r} not found", "the replay model needs the plan's profile")
    profile_path = str(found.resolve())
    profile = load_profile(profile_path)
    with tempfile.TemporaryDirectory(prefix="octopipe-csv-") as tmp:
        csv_path = os.path.join(tmp, "plan.csv")
        export_torch_csv(plan, csv_path, file=str(plan_path))
        job = _Job(
            profile_path=profile_path, time_scale=time_scale,
            stages=tuple((s.start, s.end, s.rank) for s in plan.stages), class_name=_CSV_RUNTIME,
            microbatches=plan.microbatches, microbatch_size=profile.microbatch_size, warmup=warmup, steps=steps,
            csv_path=csv_path,
        )
        raw = _launch(job, plan.pp)
    return _summary(raw, profile, job, plan.pp, latency_ms=latency_ms, schedule=f"plan:{Path(plan_path).name}", partition="plan")


def _ping_worker(rank: int, port: int, rounds: int, result_path: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        tensor = torch.zeros(1024)
        round_trips = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            if rank == 0:
                torch.distributed.send(tensor, 1)
                torch.distributed.recv(tensor, 1)
            else:
                torch.distributed.recv(tensor, 0)
                torch.distributed.send(tensor, 0)
            round_trips.append(time.perf_counter() - t0)
        if rank == 0:
            Path(result_path).write_text(json.dumps(round_trips[rounds // 10:]))  # drop connection set-up
    finally:
        torch.distributed.destroy_process_group()


def measure_gloo_latency_ms(rounds: int = 200) -> float:
    """Median one-way time of a 4 KB gloo send between two processes on this machine (half a
    ping-pong round trip). On a machine whose cores are all busy this is a wake-up latency,
    milliseconds, not a network one."""
    with tempfile.TemporaryDirectory(prefix="octopipe-ping-") as tmp:
        result = os.path.join(tmp, "ping.json")
        torch.multiprocessing.spawn(_ping_worker, args=(free_port(), rounds, result), nprocs=2, join=True)
        round_trips = json.loads(Path(result).read_text())
    return round(1000.0 * statistics.median(round_trips) / 2, 3)


def check_iw_split(profile_path: str | Path, *, time_scale: float, layers: tuple[int, int] = (1, 4)) -> dict[str, float]:
    """Does torch's I/W split run the replay layers' two backward branches apart?

    Builds layers ``[start, end)`` of the replay as one non-first stage, runs torch's
    ``stage_backward_input`` then ``stage_backward_weight`` (what torch's ZB schedules call for
    I and W) and times them against the replayed profile's I and W sums.
    """
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from octoplan.modelfile import load_model_file

    profile_path = str(Path(profile_path).resolve())
    profile = load_profile(profile_path)
    model = load_model_file(REPLAY_MODEL, {"profile": profile_path, "time_scale": time_scale})
    start, end = layers
    chain = _Chain([model.build_layer(i) for i in range(start, end)])
    width = model.build_layer(start - 1).out_elements if start > 0 else model.sample_batch(1, step=0, replica=0, mb=0)[0].shape[1]
    x = torch.randn(profile.microbatch_size, width, requires_grad=True)
    out = chain(x)
    grad = torch.ones_like(out)
    t0 = time.perf_counter()
    _, param_groups = stage_backward_input([out], [grad], [x], chain.parameters())
    t1 = time.perf_counter()
    stage_backward_weight(chain.parameters(), param_groups)
    t2 = time.perf_counter()
    picked = profile.layers[start:end]
    return {
        "layers": [start, end],
        "input_ms": round(1000 * (t1 - t0), 3),
        "weight_ms": round(1000 * (t2 - t1), 3),
        "expected_input_ms": round(time_scale * sum(layer.backward_input_ms for layer in picked), 3),
        "expected_weight_ms": round(time_scale * sum(layer.backward_weight_ms for layer in picked), 3),
        "input_grad_ok": bool(x.grad is not None and torch.isfinite(x.grad).all()),
        "weight_grads_ok": all(p.grad is not None for p in chain.parameters()),
    }


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| schedule | procs | stages | microbatches | median ms | min–max ms | sim ms (free comm) | measured / sim "
        "| sim ms (measured latency) | measured / sim |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = f"{row['median_ms'] / row['sim_ms']:.3f}" if row["sim_ms"] > 0 else "–"
        sim_lat = row.get("sim_latency_ms", 0.0)
        ratio_lat = f"{row['median_ms'] / sim_lat:.3f}" if sim_lat > 0 else "–"
        lines.append(
            f"| {row['schedule']} | {row['nprocs']} | {len(row['stages'])} | {row['microbatches']} | {row['median_ms']:.1f} | "
            f"{min(row['all_ms']):.1f}–{max(row['all_ms']):.1f} | {row['sim_ms']:.1f} | {ratio} | "
            f"{sim_lat:.1f} | {ratio_lat} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", help="profile YAML to replay")
    parser.add_argument("--write-profile", metavar="PATH", help="write the 12-layer demo profile here and replay it")
    parser.add_argument("--schedules", default=",".join(TORCH_SCHEDULES), help="comma-separated torch schedules")
    parser.add_argument("--plan", action="append", default=[], help="also run this octoplan plan under torch's runtime (repeatable)")
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--partition", default="balanced", choices=["balanced", "uniform"])
    parser.add_argument("--latency-ms", type=float, default=None,
                        help="per-transfer cost for the second simulation (default: measure gloo's one-way latency)")
    parser.add_argument("--json", help="write all results here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.write_profile:
            save_profile(demo_profile(path=args.write_profile, time_scale=args.time_scale), args.write_profile)
            args.profile = args.profile or args.write_profile
        if not args.profile and not args.plan:
            parser.error("give --profile, --write-profile or --plan")
        rows = []
        latency_ms = args.latency_ms if args.latency_ms is not None else measure_gloo_latency_ms()
        log.info("gloo one-way latency: %.3f ms", latency_ms)
        if args.profile:
            split = check_iw_split(args.profile, time_scale=args.time_scale)
            log.info("torch I/W split on replay layers %s", split)
            for name in [n for n in args.schedules.split(",") if n]:
                rows.append(run_torch_schedule(
                    args.profile, name, nprocs=args.nprocs, microbatches=args.microbatches, time_scale=args.time_scale,
                    steps=args.steps, warmup=args.warmup, partition_method=args.partition, latency_ms=latency_ms,
                ))
                log.info("%s: median %.1f ms (sim %.1f)", name, rows[-1]["median_ms"], rows[-1]["sim_ms"])
        else:
            split = None
        for plan_path in args.plan:
            rows.append(run_torch_plan(plan_path, time_scale=args.time_scale, steps=args.steps, warmup=args.warmup,
                                       latency_ms=latency_ms))
            log.info("%s: median %.1f ms (sim %.1f)", plan_path, rows[-1]["median_ms"], rows[-1]["sim_ms"])
    except InputError as exc:
        print(f"error: {exc.line()}", file=sys.stderr)
        return 2
    table = markdown_table(rows)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"iw_split": split, "gloo_latency_ms": latency_ms, "rows": rows}, indent=2))
    return 0 if all(math.isfinite(r["median_ms"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
