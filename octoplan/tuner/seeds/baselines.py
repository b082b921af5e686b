"""The baselines: every schedule x partition of FORMATS.md section 6 that applies, on every
configuration. They are the search's first seeds (so its answer is never worse than the best
baseline that fits) and the rows its result compares the tuned plan against, so they are
collected before the seed families run, not by one of them.

A baseline that fits memory in no configuration gets a second row, ``LABEL+recompute``, with
every stage recomputing its first N layers, the fewest N that fits (Megatron-LM's
``--recompute-method block --recompute-num-layers N``: what its users turn on when a schedule
runs out of memory; all layers where nothing less fits), unless ``--no-recompute``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from octoplan.errors import InputError
from octoplan.ops import splits_backward
from octoplan.partition import partition
from octoplan.plan import Cluster
from octoplan.profile import Profile
from octoplan.schedules import SCHEDULES, get_schedule
from octoplan.tuner.moves import with_recomputation
from octoplan.tuner.space import Candidate, Config, Scored, bounds_of

if TYPE_CHECKING:
    from octoplan.tuner.climb import Search
    from octoplan.tuner.search import TuneOptions

__all__ = ["BaselineRow", "MAX_BASELINE_CHUNKS", "baseline_chunks", "baseline_candidates", "collect_baselines",
           "fewest_recomputed_layers"]

# The most interleaved-1F1B chunks among the baselines without --chunks-max. Megatron-LM's users
# tune theirs (--num-layers-per-virtual-pipeline-stage), and a count above 3 can be the fastest
# baseline (llama3-70b on 64 H100s: 11 chunks, 1974.0 ms, against 2102.8 for the best of 2 or
# 3): the tuned plan must not be slower than that.
MAX_BASELINE_CHUNKS = 32


@dataclass(frozen=True)
class BaselineRow:
    """One baseline on the same GPUs: the best of its partitions and pp choices."""

    name: str  # schedule/partition, e.g. "1f1b/uniform"
    config: Config
    scored: Scored
    candidate: Candidate
    runs_on: tuple[str, ...] = ()  # the frameworks that run it as planned (frameworks.FRAMEWORKS)


def baseline_chunks(opts: TuneOptions) -> int:
    """The most interleaved-1F1B chunks among the baselines."""
    return MAX_BASELINE_CHUNKS if opts.chunks_max is None else opts.chunks_max


def _baseline_names(chunks_max: int) -> list[tuple[str, str, int]]:
    names = []
    for schedule in SCHEDULES:
        chunk_choices = range(2, max(2, chunks_max) + 1) if schedule == "interleaved-1f1b" else (2,)
        for chunks in chunk_choices:
            for partition_method in ("uniform", "balanced"):
                names.append((schedule, partition_method, chunks))
    return names


def _baseline_label(schedule: str, partition_method: str, chunks: int) -> str:
    label = schedule if schedule != "interleaved-1f1b" or chunks == 2 else f"{schedule}(v={chunks})"
    return f"{label}/{partition_method}"


def baseline_candidates(profile: Profile, cluster: Cluster, config: Config, chunks_max: int) -> list[tuple[str, Candidate]]:
    """Every baseline that applies, built the way ``make_baseline`` builds it (same partition,
    placement and generated order) but left unsimulated: the search prices each one once."""
    out = []
    for schedule, partition_method, chunks in _baseline_names(chunks_max):
        spec = get_schedule(schedule)
        if config.microbatches < spec.min_microbatches(config.pp):
            continue  # the schedule does not apply here (too few microbatches)
        num_stages = spec.num_stages(config.pp, chunks)
        if num_stages > profile.num_layers:
            continue  # before generating an order: a chunk needs a layer
        order = tuple(tuple(ops) for ops in spec.generate(config.pp, config.microbatches, chunks))
        try:
            pairs = partition(profile, num_stages, partition_method, fused_backward=not splits_backward(order))
        except (InputError, ValueError):
            continue  # too few layers for the schedule's stages
        ranks = tuple(spec.placement(config.pp, num_stages))
        label = _baseline_label(schedule, partition_method, chunks)
        out.append((label, Candidate(config, bounds_of(pairs), ranks, None, order, label, label)))
    return out


def collect_baselines(profile: Profile, cluster: Cluster, configs: Sequence[Config], opts: TuneOptions,
                      search: Search) -> list[BaselineRow]:
    """Every baseline on every configuration, priced by ``search``; one row per
    schedule/partition, its best configuration, each followed by its ``+recompute`` row where
    it has one (the module's docstring)."""
    best: dict[str, BaselineRow] = {}
    order: list[str] = []

    def consider(label: str, config: Config, cand: Candidate) -> None:
        row = BaselineRow(label, config, search.offer(cand), cand)
        if label not in best:
            order.append(label)
            best[label] = row
        elif row.scored.score < best[label].scored.score:
            best[label] = row

    candidates = [(config, label, cand) for config in configs
                  for label, cand in baseline_candidates(profile, cluster, config, baseline_chunks(opts))]
    for config, label, cand in candidates:
        consider(label, config, cand)
    if opts.recompute:
        short = {label for label in order if not best[label].scored.fits}
        for config, label, cand in candidates:
            if label in short:
                consider(f"{label}+recompute", config, fewest_recomputed_layers(search, cand, f"{label}+recompute"))
    rows = []
    for label in order:
        if not label.endswith("+recompute"):
            rows += [best[name] for name in (label, f"{label}+recompute") if name in best]
    return rows


def fewest_recomputed_layers(search: Search, cand: Candidate, origin: str) -> Candidate:
    """``cand`` with every stage recomputing its first N layers (all of a shorter stage's), for
    the fewest N with which it fits memory; with all layers where none does. Fewer recomputed
    layers keep more activations, so whether a plan fits falls as N does: a bisection finds N."""
    longest = max(b - a for a, b in zip(cand.bounds, cand.bounds[1:]))

    def with_layers(n: int) -> Candidate:
        return with_recomputation(cand, dict.fromkeys(range(cand.num_stages), n),
                                  origin if n == longest else f"{origin} (first {n} layers per stage)")

    best = with_layers(longest)
    if not search.offer(best).fits:
        return best
    low, high = 0, longest  # fits with high layers, not known to with low
    while high - low > 1:
        middle = (low + high) // 2
        if search.offer(with_layers(middle)).fits:
            high = middle
        else:
            low = middle
    return with_layers(high)
