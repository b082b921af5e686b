"""Plans of the known schedules (FORMATS.md section 6): partition + placement + the schedule's rule."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from octoplan.errors import InputError
from octoplan.ops import splits_backward
from octoplan.plan import MAX_MICROBATCHES, Cluster, Parallel, Plan, Stage, check_structure
from octoplan.partition import partition
from octoplan.profile import Profile
from octoplan.schedules import SCHEDULES, get_schedule
from octoplan.simulator import SimResult, simulate
from octoplan.yamlio import file_sha256

__all__ = ["make_baseline", "simulated_baseline", "split_gpus"]


def split_gpus(gpus: int, pp: int | None) -> tuple[int, int]:
    """(pp, dp) for ``gpus`` GPUs; pp defaults to all of them."""
    pp = gpus if pp is None else pp
    if pp < 1:
        raise InputError(None, "--pp", f"is {pp}", "use a pipeline degree of 1 or more")
    if gpus % pp:
        raise InputError(None, "--pp", f"{pp} does not divide --gpus {gpus}", "pick a pp that divides the GPU count")
    return pp, gpus // pp


DEFAULT_CHUNKS = 2  # interleaved 1F1B's stages per rank unless --chunks says otherwise (FORMATS.md section 6)


def simulated_baseline(
    profile: Profile,
    *,
    schedule: str,
    gpus: int,
    microbatches: int,
    pp: int | None = None,
    partition_method: str = "uniform",
    chunks: int | None = None,
    cluster: Cluster | None = None,
    profile_path: str | Path | None = None,
    rank_order: str = "pp-inner",
    recompute: bool = False,
) -> tuple[Plan, SimResult]:
    """A plan of one known schedule, with its simulated timeline; ``InputError`` when the
    schedule cannot apply. ``recompute``: every stage recomputes its activations (Megatron-LM's
    full recomputation)."""
    if schedule not in SCHEDULES:
        raise InputError(None, "--schedule", f"unknown schedule {schedule!r}", f"use one of {', '.join(SCHEDULES)}")
    spec = get_schedule(schedule)
    pp, dp = split_gpus(gpus, pp)
    if chunks is not None and chunks < 1:
        raise InputError(None, "--chunks", f"is {chunks}", "use 1 or more chunks")
    if chunks is not None and spec.stages_per_rank(1) == spec.stages_per_rank(2):
        # only interleaved 1F1B takes a chunk count; the others fix theirs (ZB-V: 2 per rank),
        # so --chunks there is a misunderstanding even where it names their own count
        per_rank = spec.stages_per_rank(chunks)
        raise InputError(None, "--chunks", f"{schedule} always holds {per_rank} stage(s) per rank",
                         "drop --chunks (it applies to interleaved-1f1b)")
    chunks = DEFAULT_CHUNKS if chunks is None else chunks
    if not 1 <= microbatches <= MAX_MICROBATCHES:
        raise InputError(None, "--microbatches", f"is {microbatches}", f"use 1 to {MAX_MICROBATCHES}")
    need = spec.min_microbatches(pp)
    if microbatches < need:
        raise InputError(None, "--microbatches", f"{microbatches} is too few: {spec.why_min}", f"use at least {need}")
    num_stages = spec.num_stages(pp, chunks)
    file = str(profile_path) if profile_path else None
    order = tuple(tuple(ops) for ops in spec.generate(pp, microbatches, chunks))
    bounds = partition(profile, num_stages, partition_method, file=file, fused_backward=not splits_backward(order))
    ranks = spec.placement(pp, num_stages)
    cluster = cluster or Cluster(gpus=gpus)
    if cluster.gpus != gpus:
        cluster = Cluster(**{**cluster.to_dict(), "gpus": gpus})
    plan = Plan(
        model=profile.model,
        cluster=cluster,
        parallel=Parallel(pp=pp, dp=dp, microbatches=microbatches, rank_order=rank_order),
        stages=tuple(Stage(start, end, rank, recompute) for (start, end), rank in zip(bounds, ranks)),
        schedule=order,
        profile=str(profile_path) if profile_path else None,
        profile_sha256=file_sha256(profile_path) if profile_path and Path(profile_path).exists() else None,
        extra={"generator": {"schedule": schedule, "partition": partition_method, "chunks": num_stages // pp,
                             **({"recompute": True} if recompute else {})}},
    )
    check_structure(plan, num_layers=profile.num_layers)
    result = simulate(plan, profile)
    return replace(plan, predicted=result.prediction()), result


def make_baseline(profile: Profile, **options) -> Plan:
    """The plan of :func:`simulated_baseline` (same options), its prediction filled in."""
    return simulated_baseline(profile, **options)[0]
