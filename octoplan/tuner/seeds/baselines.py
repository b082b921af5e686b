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
from typing import TYPE_CHECKING, NamedTuple, Sequence

from octoplan.errors import InputError
from octoplan.ops import splits_backward
from octoplan.partition import partition
from octoplan.plan import Cluster
from octoplan.profile import Profile
from octoplan.schedules import SCHEDULES, get_schedule
from octoplan.tuner.frameworks import PARTIAL_FRAMEWORKS
from octoplan.tuner.moves import with_recomputation
from octoplan.tuner.space import Candidate, Config, Scored, bounds_of

if TYPE_CHECKING:
    from octoplan.tuner.climb import Search
    from octoplan.tuner.search import TuneOptions

__all__ = ["BaselineRow", "Baselines", "MAX_BASELINE_CHUNKS", "baseline_chunks", "baseline_candidates", "collect_baselines",
           "fewest_recomputed_layers"]

# The most interleaved-1F1B chunks among the baselines without --chunks-max. Megatron-LM's users
# tune theirs (--num-layers-per-virtual-pipeline-stage), and a count above 3 can be the fastest
# baseline (llama3-70b on 64 H100s: 11 chunks, 1974.0 ms, against 2102.8 for the best of 2 or
# 3): the tuned plan must not be slower than that.
MAX_BASELINE_CHUNKS = 32


# The order the baselines are priced in when the time limit may cut them short: the pipelines
# most run first, GPipe (all forwards, then all backwards: no one's choice at scale) last
PRICING_ORDER = ("1f1b", "interleaved-1f1b", "zb-h1", "zbv", "zb-h2", "dualpipev", "gpipe")


@dataclass(frozen=True)
class BaselineRow:
    """One baseline on the same GPUs: the best of its partitions and pp choices."""

    name: str  # schedule/partition, e.g. "1f1b/uniform"
    config: Config
    scored: Scored
    candidate: Candidate
    runs_on: tuple[str, ...] = ()  # the frameworks that run it as planned (frameworks.FRAMEWORKS)
    allowed: bool = True  # whether the tune's --runs-on lets it be the plan written


def baseline_chunks(opts: TuneOptions) -> int:
    """The most interleaved-1F1B chunks among the baselines."""
    return MAX_BASELINE_CHUNKS if opts.chunks_max is None else opts.chunks_max


def _baseline_names(chunks_max: int) -> list[tuple[str, str, int]]:
    """(schedule, partition, chunks) of every baseline of at most ``chunks_max`` stages per rank
    (a schedule's stages per rank are its stages at pp 1: ZB-V's two are out under 1)."""
    names = []
    for schedule in SCHEDULES:
        chunk_choices = range(2, max(2, chunks_max) + 1) if schedule == "interleaved-1f1b" else (2,)
        for chunks in chunk_choices:
            if get_schedule(schedule).num_stages(1, chunks) > chunks_max:
                continue
            for partition_method in ("uniform", "balanced"):
                names.append((schedule, partition_method, chunks))
    return names


def _baseline_label(schedule: str, partition_method: str, chunks: int) -> str:
    label = schedule if schedule != "interleaved-1f1b" or chunks == 2 else f"{schedule}(v={chunks})"
    return f"{label}/{partition_method}"


def _applies(profile: Profile, config: Config, schedule: str, chunks: int) -> bool:
    """Whether the schedule can run on ``config`` at all, known before its order is generated."""
    spec = get_schedule(schedule)
    # enough microbatches for the schedule, and a layer for every chunk
    return (config.microbatches >= spec.min_microbatches(config.pp)
            and spec.num_stages(config.pp, chunks) <= profile.num_layers)


def _baseline_candidate(profile: Profile, config: Config, schedule: str, partition_method: str,
                        chunks: int) -> Candidate | None:
    """One baseline, built the way ``make_baseline`` builds it (same partition, placement and
    generated order) but left unsimulated; None where it does not apply to ``config``."""
    if not _applies(profile, config, schedule, chunks):
        return None
    spec = get_schedule(schedule)
    num_stages = spec.num_stages(config.pp, chunks)
    order = tuple(tuple(ops) for ops in spec.generate(config.pp, config.microbatches, chunks))
    try:
        pairs = partition(profile, num_stages, partition_method, fused_backward=not splits_backward(order))
    except (InputError, ValueError):
        return None  # too few layers for the schedule's stages
    ranks = tuple(spec.placement(config.pp, num_stages))
    label = _baseline_label(schedule, partition_method, chunks)
    return Candidate(config, bounds_of(pairs), ranks, None, order, label, label)


def baseline_candidates(profile: Profile, cluster: Cluster, config: Config, chunks_max: int) -> list[tuple[str, Candidate]]:
    """Every baseline that applies to ``config``, unsimulated: the search prices each one once."""
    built = (_baseline_candidate(profile, config, *name) for name in _baseline_names(chunks_max))
    return [(cand.origin, cand) for cand in built if cand is not None]


class Baselines(NamedTuple):
    rows: list[BaselineRow]
    unpriced: int  # baselines (schedule/partition x configuration) left out when the time ran out
    # for each framework that runs only some plans (torchtitan, Megatron-LM), the fastest baseline
    # that fits and that it runs, over every label and configuration: a label's best row may be
    # one it does not run (pp-inner across nodes for torchtitan) while a slower one of it is
    by_framework: tuple[BaselineRow, ...] = ()


def collect_baselines(profile: Profile, cluster: Cluster, configs: Sequence[Config], opts: TuneOptions,
                      search: Search, *, until_s: float | None = None) -> Baselines:
    """Every baseline on every configuration, priced by ``search``; one row per
    schedule/partition, its best configuration, each followed by its ``+recompute`` row where
    it has one (the module's docstring).

    ``until_s``: none is built or priced once the search's clock passes it (pricing them all at
    thousands of microbatches takes longer than a short ``--time-limit``). They are taken in
    :data:`PRICING_ORDER`, each on every configuration: the schedules of two stages per rank at
    most, then interleaved 1F1B with 3, 4, ... chunks, then GPipe; the ``+recompute`` rows last.
    Under ``--max-plans`` the clock counts plans, so which are left out is deterministic."""
    best: dict[str, BaselineRow] = {}
    names = _baseline_names(baseline_chunks(opts))
    by_priority = sorted(names, key=lambda name: (name[0] == "gpipe", name[2], PRICING_ORDER.index(name[0])))
    unpriced = 0

    def out_of_time() -> bool:
        return until_s is not None and search.clock.elapsed() >= until_s

    fastest_on: dict[str, BaselineRow] = {}  # Baselines.by_framework

    def consider(label: str, config: Config, cand: Candidate) -> None:
        row = BaselineRow(label, config, search.offer(cand), cand)
        if label not in best or row.scored.score < best[label].scored.score:
            best[label] = row
        if row.scored.fits and any(framework not in fastest_on or row.scored.judged_ms < fastest_on[framework].scored.judged_ms
                                   for framework in PARTIAL_FRAMEWORKS):
            runs_on = search.frameworks.runs_on(cand)
            for framework in PARTIAL_FRAMEWORKS:
                held = fastest_on.get(framework)
                if framework in runs_on and (held is None or row.scored.judged_ms < held.scored.judged_ms):
                    fastest_on[framework] = row

    # an evaluator that priced plans before this search (tune_global_batch's pricing of every
    # size): the baselines it priced cost nothing, and are taken whatever the clock says
    reused = search.ev.evaluations > 0
    priced: list[tuple[Config, Candidate]] = []
    for name in by_priority:
        for config in configs:
            late = out_of_time()
            if late and not reused:
                unpriced += _applies(profile, config, name[0], name[2])
                continue
            cand = _baseline_candidate(profile, config, *name)
            if cand is not None and late and not search.ev.priced(cand):
                unpriced += 1
            elif cand is not None:
                consider(cand.origin, config, cand)
                priced.append((config, cand))
    if opts.recompute:
        short = {label for label, row in best.items() if not row.scored.fits}
        for config, cand in priced:
            if cand.origin in short:
                label = f"{cand.origin}+recompute"
                # a bisection the pricing before this search ran is priced throughout: free again
                if out_of_time() and not (reused and search.ev.priced(_recomputing(cand, label, _longest(cand)))):
                    unpriced += 1
                    continue
                consider(label, config, fewest_recomputed_layers(search, cand, label))
    rows = []
    for label in (_baseline_label(*name) for name in names):  # the table's order: SCHEDULES'
        rows += [best[key] for key in (label, f"{label}+recompute") if key in best]
    return Baselines(rows, unpriced, tuple(fastest_on[f] for f in PARTIAL_FRAMEWORKS if f in fastest_on))


def fewest_recomputed_layers(search: Search, cand: Candidate, origin: str) -> Candidate:
    """``cand`` with every stage recomputing its first N layers (all of a shorter stage's), for
    the fewest N with which it fits memory; with all layers where none does. Fewer recomputed
    layers keep more activations, so whether a plan fits falls as N does: a bisection finds N."""
    longest = _longest(cand)
    best = _recomputing(cand, origin, longest)
    if not search.offer(best).fits:
        return best
    low, high = 0, longest  # fits with high layers, not known to with low
    while high - low > 1:
        middle = (low + high) // 2
        if search.offer(_recomputing(cand, origin, middle)).fits:
            high = middle
        else:
            low = middle
    return _recomputing(cand, origin, high)


def _longest(cand: Candidate) -> int:
    """The most layers a stage of ``cand`` holds."""
    return max(b - a for a, b in zip(cand.bounds, cand.bounds[1:]))


def _recomputing(cand: Candidate, origin: str, n: int) -> Candidate:
    """``cand`` with every stage recomputing its first ``n`` layers (all, at its longest stage's count)."""
    return with_recomputation(cand, dict.fromkeys(range(cand.num_stages), n),
                              origin if n == _longest(cand) else f"{origin} (first {n} layers per stage)")
