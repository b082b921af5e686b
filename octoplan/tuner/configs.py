"""The whole configuration for a global batch: which microbatch size, pp x dp, rank order and
plan is fastest on N GPUs, and why the others lose.

A user fixes the GPUs and the global batch; everything else is the tuner's choice. The
microbatch size changes every layer's time and memory, so it is priced from a profile measured
at that size: :func:`tune_global_batch` takes one profile per size (of the same model), tunes
each with :func:`octoplan.tuner.search.tune` on an equal share of the budget (every pp dividing
the GPUs, both rank orders where they differ, recomputation where memory is short, the data-parallel all-reduce
overlapped with the last backwards as the simulator prices it), and keeps the fastest plan of
one global batch. Sizes whose best baseline is more than :data:`MAX_TUNER_GAIN` slower than
another size's are priced but not tuned. Every configuration the searches priced becomes a :class:`ConfigRow`, whose
time is split into the parts a configuration choice moves (:func:`time_parts`), so that the
table can say why the next-best configuration lost: memory, balance, bubbles, transfers or
the all-reduce.
"""

from __future__ import annotations

import math
import time
from fractions import Fraction
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from octoplan.errors import InputError
from octoplan.ops import Kind, Op
from octoplan.plan import Cluster
from octoplan.profile import Profile
from octoplan.tuner.search import (BASELINES_SHARE, NEAR_TIE, BaselineRow, ProgressFn, TuneOptions, TuneResult,
                                   check_options, compare_baselines, tune)
from octoplan.tuner.space import Candidate, Config, Evaluator, Scored

__all__ = ["ConfigRow", "BatchResult", "TIME_PARTS", "time_parts", "why_slower", "tune_global_batch", "check_same_model"]

# A microbatch size whose best baseline is this much slower than another size's is not tuned:
# the tuner has not beaten the best baseline by more than 1.146x on any workload of its suite
# (docs/BENCHMARKS.md, "Tuner suite"), so its time goes to the sizes that can still win.
MAX_TUNER_GAIN = 1.15

# the parts of a configuration's iteration time (:func:`time_parts`), in the table's order
TIME_PARTS = ("compute", "recompute", "bubbles", "transfers", "allreduce")
_PART_WORDS = {
    "compute": "balance: its busiest GPU computes {delta:.2f} ms more{per}",
    "recompute": "memory: it recomputes {delta:.2f} ms more{per} of forwards to fit",
    "bubbles": "bubbles: its busiest GPU idles {delta:.2f} ms more{per}",
    "transfers": "transfers: its busiest GPU waits {delta:.2f} ms more{per} on activations on the wire{where}",
    "allreduce": "all-reduce: {delta:.2f} ms more{per} of the gradient all-reduce is left after the last backward",
}


@dataclass(frozen=True)
class ConfigRow:
    """The best plan the search found for one configuration, and its time in parts."""

    microbatch_size: int
    candidate: Candidate
    scored: Scored
    parts: dict[str, float]  # TIME_PARTS -> ms, summing to the iteration time
    cross_node_waits: bool  # whether some of its transfer waits are on links between nodes

    @property
    def config(self) -> Config:
        return self.candidate.config

    def label(self) -> str:
        return f"mbs={self.microbatch_size} {self.config.label()}"


@dataclass(frozen=True)
class BatchResult:
    """The fastest plan of a global batch, its tuning, and every configuration priced."""

    result: TuneResult  # the winning microbatch size's tuning
    profile_path: Path | None
    microbatch_size: int
    configs: tuple[ConfigRow, ...]  # best first
    # every baseline row of every microbatch size, with that size
    baselines: tuple[tuple[int, BaselineRow], ...]
    # sizes priced by their baselines only, as too slow to win (MAX_TUNER_GAIN)
    untuned_sizes: tuple[int, ...] = ()
    # each tuned size's fastest fitting baseline that torchtitan / Megatron-LM runs, with that size
    by_framework: tuple[tuple[int, BaselineRow], ...] = ()


def time_parts(evaluator: Evaluator, cand: Candidate) -> tuple[dict[str, float], bool]:
    """``cand``'s iteration time in :data:`TIME_PARTS`, as seen from its busiest GPU: what it
    computes (less the forwards it runs again), those recomputed forwards, its waits on other
    GPUs' work (bubbles) and on the wire (transfers), and the all-reduce's tail after the last op
    of any GPU. And whether a wire wait was on a link between nodes."""
    timeline = evaluator.timeline(cand)
    busiest = timeline.busiest_rank
    again = sum(evaluator.recomputed_forward_ms(cand, span.op.stage) for span in timeline.spans(busiest)
                if span.op.kind in (Kind.I, Kind.B))
    last_op_end = max((span.end_ms for span in timeline.spans()), default=0.0)
    tail = max(0.0, timeline.iteration_ms - last_op_end)
    wire = 0.0
    cross = False
    cluster, parallel = evaluator.cluster, cand.config.parallel()
    ends: dict[tuple[int, Op], float] = {}  # the producers' ends, on the ranks the busiest waited for
    read: set[int] = set()
    for bubble in timeline.bubbles:
        if bubble.rank != busiest or bubble.reason not in ("transfer", "dependency") or bubble.from_rank is None:
            continue
        # a gap waits on another GPU's work until its producer ends and on the wire after: the
        # simulator names a gap by its larger part (the fill's first message, a long drain wait)
        if bubble.from_rank not in read:
            read.add(bubble.from_rank)
            ends.update(((bubble.from_rank, span.op), span.end_ms) for span in timeline.spans(bubble.from_rank))
        produced = ends.get((bubble.from_rank, bubble.waits_for), bubble.start_ms)
        on_wire = bubble.end_ms - min(bubble.end_ms, max(bubble.start_ms, produced))
        wire += on_wire
        if on_wire > 0 and _nodes_apart(cluster, parallel, busiest, bubble.from_rank):
            cross = True
    busy = timeline.busy_ms[busiest]
    parts = {
        "compute": busy - again,
        "recompute": again,
        "bubbles": max(0.0, timeline.iteration_ms - busy - wire - tail),
        "transfers": wire,
        "allreduce": tail,
    }
    return parts, cross


def _nodes_apart(cluster: Cluster, parallel, rank_a: int, rank_b: int) -> bool:
    """Whether pipeline ranks ``a`` and ``b`` of replica 0 sit on different nodes."""
    return cluster.node_of(parallel.global_rank(rank_a, 0)) != cluster.node_of(parallel.global_rank(rank_b, 0))


def per_microbatch(scored: Scored) -> str:
    """" per microbatch" where ``scored`` was judged per microbatch (configurations of different
    batches), else nothing: the words after a time the search compared."""
    return " per microbatch" if scored.samples > 1 else ""


def why_slower(row: ConfigRow, winner: ConfigRow) -> str:
    """One phrase: the part of ``row``'s time that grew most against the winner's."""
    if row is winner:
        return "fastest"
    if not row.scored.fits:
        return f"memory: needs {row.scored.peak_memory_bytes / 1e9:.1f} GB on its fullest GPU even recomputing"
    if row.scored.judged_ms < winner.scored.judged_ms:  # the winner won a near tie (tune's rule)
        return "a near tie: faster, in more stages, which the tie gives up where no per-op cost is priced"
    # rows that train different batches (tune --microbatches without --pp) compare per microbatch
    deltas = {part: row.parts[part] / row.scored.samples - winner.parts[part] / winner.scored.samples
              for part in TIME_PARTS}
    part = max(TIME_PARTS, key=lambda p: (deltas[p], -TIME_PARTS.index(p)))
    if deltas[part] <= 1e-9:
        return "ties the winner"
    where = " between nodes" if part == "transfers" and row.cross_node_waits else ""
    return _PART_WORDS[part].format(delta=deltas[part], where=where, per=per_microbatch(winner.scored))


def check_same_model(profiles: Sequence[tuple[Path | None, Profile]]) -> None:
    """Profiles given together must be one model at distinct microbatch sizes."""
    first_path, first = profiles[0]
    names = [layer.name for layer in first.layers]
    seen: dict[int, Path | None] = {}
    for path, profile in profiles:
        where = str(path) if path is not None else None
        if [layer.name for layer in profile.layers] != names:
            raise InputError(where, "layers", f"are not the layers of {first_path}",
                             "give profiles of one model, measured at different --microbatch-size")
        if profile.precision != first.precision:
            raise InputError(where, "precision", f"is {profile.precision}, {first_path}'s is {first.precision}",
                             "profile every microbatch size at the same --precision")
        # the same layer names over another config (a sequence length, a tp degree) or on another
        # GPU would compare batches of other sizes in tokens, or plan for the first one's memory
        if profile.model.config != first.model.config:
            key = next(k for k in sorted({*profile.model.config, *first.model.config}, key=str)
                       if profile.model.config.get(k) != first.model.config.get(k))
            raise InputError(where, f"model.config.{key}", f"is {profile.model.config.get(key)!r}, {first_path}'s is "
                             f"{first.model.config.get(key)!r}", "give profiles of one model config, measured at "
                             "different --microbatch-size")
        device, first_device = (profile.device or {}).get("name"), (first.device or {}).get("name")
        if device != first_device:
            raise InputError(where, "device.name", f"is {device!r}, {first_path}'s is {first_device!r}",
                             "give profiles measured on one kind of GPU")
        if profile.microbatch_size in seen:
            raise InputError(where, "microbatch_size", f"is {profile.microbatch_size}, as is {seen[profile.microbatch_size]}'s",
                             "give one profile per microbatch size")
        seen[profile.microbatch_size] = path


def _winning_size(tuned: list[tuple[Path | None, Profile, TuneResult]],
                  cluster: Cluster) -> tuple[Path | None, Profile, TuneResult]:
    """The microbatch size whose plan is written: the fastest, or, where no per-op cost is priced,
    the near tie of :func:`octoplan.tuner.search.tune` across the sizes: of the sizes' plans
    within ``NEAR_TIE`` of the fastest any size priced, the one of fewest stage passes per sample
    (its stages over its microbatch size, as the GPUs and the batch are the same)."""
    fastest = min(tuned, key=lambda item: (item[2].scored.score, item[1].microbatch_size))
    if cluster.op_overhead_us > 0:
        return fastest
    floor = min((result.fastest.judged_ms for _, _, result in tuned if result.fastest and result.fastest.fits),
                default=math.inf)
    near = [item for item in tuned if item[2].scored.fits and item[2].scored.judged_ms <= floor * (1 + NEAR_TIE)]
    return min(near, key=lambda item: (Fraction(item[2].candidate.num_stages, item[1].microbatch_size),
                                       item[2].scored.judged_ms, item[1].microbatch_size), default=fastest)


def tune_global_batch(profiles: Sequence[tuple[Path | None, Profile]], cluster: Cluster, opts: TuneOptions, *,
                      progress: ProgressFn | None = None) -> BatchResult:
    """Tune every microbatch size's profile for ``opts.global_batch`` samples on ``opts.gpus``
    GPUs, each on an equal share of the budget, and keep the fastest plan that fits. Sizes the
    global batch does not split into (for any dp) are skipped; ``InputError`` if none is left.
    With several sizes, each size's baselines are priced first, and a size more than
    :data:`MAX_TUNER_GAIN` behind the best one is left untuned: its rows are its baselines'."""
    check_options(opts)  # before the budget is shared out, so an error shows what was given
    check_same_model(profiles)
    if len(profiles) > 1 and opts.global_batch is None:
        raise InputError(None, "--global-batch", "is needed with several profiles: plans of different microbatch sizes "
                         "compare only on the same batch", "give the samples per iteration, e.g. --global-batch "
                         f"{2 * opts.gpus * max(profile.microbatch_size for _, profile in profiles)}")
    started = time.perf_counter()
    ordered = sorted(profiles, key=lambda item: item[1].microbatch_size)
    refusals: list[InputError] = []
    leads: list[tuple[Path | None, Profile, float]] = []  # each size's best fitting baseline (ms)
    priced: dict[int, list[BaselineRow]] = {}  # each size's baselines, for the sizes left untuned
    # each size's priced plans, kept for its tune: its baselines are not simulated twice
    evaluators: dict[int, Evaluator] = {}
    if len(ordered) > 1:
        for path, profile in ordered:
            evaluators[profile.microbatch_size] = Evaluator(profile, Cluster(**{**cluster.to_dict(), "gpus": opts.gpus}))
            try:
                # each size's share of the half of the limit its tune's baselines would have
                rows = compare_baselines(profile, cluster, opts, evaluator=evaluators[profile.microbatch_size],
                                         until_s=BASELINES_SHARE * opts.time_limit_s / len(ordered))
            except InputError as exc:
                refusals.append(exc)  # the batch does not split into this size's microbatches
                continue
            priced[profile.microbatch_size] = rows
            fitting = [row.scored.judged_ms for row in rows if row.scored.fits]
            leads.append((path, profile, min(fitting, default=math.inf)))
        fastest = min((ms for _, _, ms in leads), default=math.inf)
        # every size where nothing fits stays in (recomputing stages may fit), as do sizes close enough
        close = [not math.isfinite(fastest) or not math.isfinite(ms) or ms <= MAX_TUNER_GAIN * fastest
                 for _, _, ms in leads]
        ordered = [(path, profile) for (path, profile, _), keep in zip(leads, close) if keep]
        untuned = [(path, profile) for (path, profile, _), keep in zip(leads, close) if not keep]
    else:
        untuned = []
    # the pricing above comes out of the time limit, and every tune keeps at least a tenth of it;
    # under --max-plans a size's pricing counts among its tune's plans (its evaluator's), and the
    # wall clock must not enter: the same plan, and the same plan file, on any machine
    spent_s = 0.0 if opts.max_plans is not None else time.perf_counter() - started
    left_s = max(opts.time_limit_s / 10, opts.time_limit_s - spent_s)
    shares = max(1, len(ordered))
    share = replace(opts, time_limit_s=left_s / shares,
                    max_plans=None if opts.max_plans is None else max(1, opts.max_plans // shares))
    tuned: list[tuple[Path | None, Profile, TuneResult]] = []
    for path, profile in ordered:
        try:
            tuned.append((path, profile, tune(profile, cluster, share, profile_path=path, progress=progress,
                                              evaluator=evaluators.get(profile.microbatch_size))))
        except InputError as exc:
            if len(profiles) == 1:
                raise
            refusals.append(exc)  # nothing fits at this size
    if not tuned:
        raise refusals[0]
    rows: list[ConfigRow] = []
    for path, profile, result in tuned:
        evaluator = evaluators.get(profile.microbatch_size) or Evaluator(profile, result.plan.cluster)
        for cand, scored in result.configs:
            parts, cross = time_parts(evaluator, cand)
            rows.append(ConfigRow(profile.microbatch_size, cand, scored, parts, cross))
    for path, profile in untuned:  # their configurations as the baselines priced them
        evaluator = evaluators[profile.microbatch_size]
        best: dict[Config, BaselineRow] = {}
        for row in priced[profile.microbatch_size]:
            if row.config not in best or row.scored.score < best[row.config].scored.score:
                best[row.config] = row
        for row in best.values():
            parts, cross = time_parts(evaluator, row.candidate)
            rows.append(ConfigRow(profile.microbatch_size, row.candidate, row.scored, parts, cross))
    winner_path, winner_profile, winner = _winning_size(tuned, cluster)
    fastest = min(result.scored.score for _, _, result in tuned)
    if winner.scored.score > fastest and not winner.stats.get("near_tie"):  # the tie across sizes chose it
        tuner = {**winner.plan.extra.get("tuner", {}), "near_tie": True}
        winner = replace(winner, stats={**winner.stats, "near_tie": True},
                         plan=replace(winner.plan, extra={**winner.plan.extra, "tuner": tuner}))
    # the written plan's configuration first (the table's winner is the plan's), then by time
    won = (winner_profile.microbatch_size, winner.candidate.config)
    rows.sort(key=lambda row: ((row.microbatch_size, row.config) != won, row.scored.score, row.microbatch_size, row.config))
    baselines = tuple((profile.microbatch_size, row) for _, profile, result in tuned for row in result.baselines)
    baselines += tuple((profile.microbatch_size, row) for _, profile in untuned for row in priced[profile.microbatch_size])
    by_framework = tuple((profile.microbatch_size, row) for _, profile, result in tuned for row in result.by_framework)
    return BatchResult(winner, winner_path, winner_profile.microbatch_size, tuple(rows), baselines,
                       tuple(profile.microbatch_size for _, profile in untuned), by_framework)
