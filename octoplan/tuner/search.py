"""The tuner: co-optimize partition, placement and schedule (``octoplan tune``).

Steps:
1. Enumerate the outer choices (:class:`Config`): every pp dividing the GPU count (``pp``
   pins it) with the microbatch count a global batch implies, and both global rank orders
   when dp > 1.
2. Seed with every baseline of FORMATS.md section 6 that applies (schedule x partition, interleaved
   1F1B with every chunk count the layers allow up to ``MAX_BASELINE_CHUNKS``, or up to
   ``chunks_max`` where it is given), so the answer is never worse than the best baseline that
   fits; add policy-scheduled seeds (balanced partitions in loop and V placements) and the
   CP-SAT partition + placement (:mod:`octoplan.tuner.cpsat`); and every seed layout re-placed
   so that late-starting ranks carry less (:mod:`octoplan.tuner.arrange`).
3. Justify the orders of the best seeds (:mod:`octoplan.schedules.justify`: every op pushed
   as late, then as early as its dataflow and its rank's gaps allow, which moves Ws into
   bubbles and forwards ahead of them); the justified plans join the seeds.
4. Hill-climb from the best seeds with bubble-aware moves (:mod:`octoplan.tuner.moves`):
   simulate, read who waits on whom, try the most promising moves first, keep the first one
   that is faster (or, while nothing fits, leaner); at a local optimum, justify its order,
   rebuild it by the shifting-bottleneck procedure (:mod:`octoplan.schedules.bottleneck`)
   where the time left allows, then try compound moves, each justified: a layer shifted off a
   hot rank, and a layer peeled off a rank that finishes last into a new stage on one that
   finishes first, the order carried over (:mod:`octoplan.tuner.carry`); go on from there if
   that is faster; until no move helps or
   time runs out. Time the climbs leave unused goes to climbs from the next-best seeds, each
   followed by a restart: a climb from the first seeds again, on layer times shaken by 0.1%,
   whose end is judged on the true times (a climb's path turns on near-ties, and one seed's
   local optima differ by percents); restarts stop after 3 rounds over those seeds find
   nothing. With ``workers`` > 1 the climbs run side by side in that many processes
   (:mod:`octoplan.tuner.pool`), and the restarts follow in this one.
5. Rebuild the best plan's order the same way, if that fits in the time left, and climb from
   it if it is faster (:meth:`_Search.polish`).

Deterministic for a given seed: moves are tried in a fixed order with ties broken by
``random.Random(seed)``; the clock only decides when to stop, and whether a rebuilt order
still fits before a deadline (with one worker; with several, which climb ends first also
depends on the machine). With ``max_plans`` the clock counts plans and every rebuild runs.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

from octoplan.errors import InputError
from octoplan.ops import Kind, splits_backward
from octoplan.partition import balanced_partition, partition
from octoplan.plan import MAX_MICROBATCHES, Cluster, Plan, check_structure
from octoplan.profile import Profile
from octoplan.schedules import SCHEDULES, get_schedule, loop_placement, v_placement
from octoplan.schedules.policy import default_policies
from octoplan.simulator import DeadlockError, SimResult
from octoplan.tuner.arrange import start_aware
from octoplan.tuner.carry import Carrier, peel_moves
from octoplan.tuner.frameworks import MEGATRON_ID, RUNS_ON, Frameworks
from octoplan.tuner.moves import DIMENSIONS, neighbours, shifts_off_hot_ranks, with_recomputation
from octoplan.tuner.space import Candidate, Config, Evaluator, Scored, bounds_of
from octoplan.yamlio import file_sha256

__all__ = ["TuneOptions", "BaselineRow", "TuneResult", "configs_for", "tune", "compare_baselines"]

log = logging.getLogger("octoplan.tuner")

DEFAULT_MICROBATCHES_PER_PP = 2  # without --global-batch or --microbatches: 2 per pipeline rank, as `baseline`
COMPOUND_SHIFTS = 6  # at a climb's local optimum, the boundary shifts tried with a justification each
# restarts: climbs again from the first seeds on layer times scaled by 1 + RESTART_NOISE x
# N(0, 1) (_Search.restart), until RESTART_PATIENCE rounds over those seeds in a row find nothing
RESTART_NOISE = 1e-3
RESTART_PATIENCE = 3
PEELS = 6  # then the layers peeled onto another rank (:mod:`octoplan.tuner.carry`), justified each
MAX_WORKERS = 1024  # --workers: far above any machine's cores, below where process counts overflow
MAX_SEED = 2**31 - 1  # --seed: CP-SAT's random_seed is a 32-bit signed int
# Without --chunks-max: the layouts the search builds hold at most DEFAULT_CHUNKS stages per
# rank (a search-space bound: each more allowed widens every climb's neighbourhood), while the
# baselines have interleaved 1F1B with every chunk count the layers allow, up to
# MAX_BASELINE_CHUNKS. Megatron-LM's users tune theirs (--num-layers-per-virtual-pipeline-stage),
# and a count above 3 can be the fastest baseline (llama3-70b on 64 H100s: 11 chunks, 1974.0 ms,
# against 2102.8 for the best of 2 or 3): the tuned plan must not be slower than that.
DEFAULT_CHUNKS = 3
MAX_BASELINE_CHUNKS = 32


@dataclass(frozen=True)
class TuneOptions:
    gpus: int
    pp: int | None = None
    microbatches: int | None = None
    global_batch: int | None = None
    time_limit_s: float = 60.0
    # A budget of simulated plans instead of seconds: the search then measures its progress in
    # plans, so the result no longer depends on the machine's speed or load.
    max_plans: int | None = None
    seed: int = 0
    # the most stages per rank, in the layouts the search builds and among the baselines; None:
    # DEFAULT_CHUNKS in the search's layouts, every count up to MAX_BASELINE_CHUNKS among the
    # baselines (so a tuned plan may hold more stages per rank when a baseline is its seed)
    chunks_max: int | None = None
    dimensions: tuple[str, ...] = DIMENSIONS
    use_cpsat: bool = True
    baselines: bool = True  # seed with (and report) FORMATS.md section 6's baselines
    max_configs: int = 3  # outer configurations the local search visits, best seeds first
    max_starts: int = 6  # hill climbs, from the best seed of each family
    # processes that climb at once (:mod:`octoplan.tuner.pool`); they are spawned, so a script
    # that calls tune() with workers > 1 needs the usual `if __name__ == "__main__":` guard
    workers: int = 1
    # may stages recompute their activations (octoplan.costs.StageCost)? The tuner then also
    # prices every baseline that does not fit memory with full recomputation, as its users would
    recompute: bool = True
    # the plans the search may return (:mod:`octoplan.tuner.frameworks`): any, or only those
    # Megatron-LM ("megatron") or torchtitan ("loop", "v": its two stage placements) can run
    runs_on: str = "any"


@dataclass(frozen=True)
class BaselineRow:
    """One baseline on the same GPUs: the best of its partitions and pp choices."""

    name: str  # schedule/partition, e.g. "1f1b/uniform"
    config: Config
    scored: Scored
    candidate: Candidate
    runs_on: tuple[str, ...] = ()  # the frameworks that run it as planned (frameworks.FRAMEWORKS)


@dataclass(frozen=True)
class TuneResult:
    plan: Plan
    scored: Scored
    candidate: Candidate
    baselines: tuple[BaselineRow, ...]
    stats: dict = field(default_factory=dict)
    runs_on: tuple[str, ...] = ()  # the frameworks that run the tuned plan as planned
    # every configuration's best candidate the search priced, best first (the winner's first)
    configs: tuple[tuple[Candidate, Scored], ...] = ()

    def best_baseline(self) -> BaselineRow | None:
        fitting = [row for row in self.baselines if row.scored.fits]
        return min(fitting, key=lambda row: row.scored.iteration_ms, default=None)


ProgressFn = Callable[[Scored, int, float], None]  # best so far, evaluations, elapsed seconds


def configs_for(profile: Profile, opts: TuneOptions) -> list[Config]:
    """Every (pp, dp, microbatches, rank order) the options allow."""
    gpus = opts.gpus
    if gpus < 1:
        raise InputError(None, "--gpus", f"is {gpus}", "use a positive number")
    if opts.pp is not None:
        if opts.pp < 1:
            raise InputError(None, "--pp", f"is {opts.pp}", "use a pipeline degree of 1 or more")
        if gpus % opts.pp:
            raise InputError(None, "--pp", f"{opts.pp} does not divide --gpus {gpus}", "pick a pp that divides the GPU count")
        if opts.pp > profile.num_layers:
            raise InputError(None, "--pp", f"{opts.pp} exceeds the profile's {profile.num_layers} layers",
                             "use a pp no larger than the layer count")
        pps = [opts.pp]
    else:
        pps = [p for p in range(1, gpus + 1) if gpus % p == 0 and p <= profile.num_layers]
    mbs = profile.microbatch_size
    if opts.global_batch is not None and opts.microbatches is not None:
        raise InputError(None, "--global-batch", "and --microbatches are both given", "give one of them")
    out = []
    too_many = 0  # the most microbatches per pipeline of a config left out for having too many
    for pp in pps:
        dp = gpus // pp
        if opts.microbatches is not None:
            if not 1 <= opts.microbatches <= MAX_MICROBATCHES:
                raise InputError(None, "--microbatches", f"is {opts.microbatches}", f"use 1 to {MAX_MICROBATCHES}")
            num_mb = opts.microbatches
        else:
            batch = opts.global_batch if opts.global_batch is not None else DEFAULT_MICROBATCHES_PER_PP * gpus * mbs
            if batch < 1:
                raise InputError(None, "--global-batch", f"is {batch}", "use a positive number of samples")
            if batch % (dp * mbs):
                continue
            num_mb = batch // (dp * mbs)
            if num_mb > MAX_MICROBATCHES:
                too_many = max(too_many, num_mb)
                continue
        for order in (("pp-inner", "dp-inner") if dp > 1 else ("pp-inner",)):
            out.append(Config(pp, dp, num_mb, order))
    if not out and too_many:
        raise InputError(None, "--global-batch", f"{opts.global_batch} samples make {too_many} microbatches per pipeline, "
                         f"more than {MAX_MICROBATCHES}", "profile a larger --microbatch-size or give a smaller --global-batch")
    if not out:
        raise InputError(
            None, "--global-batch",
            f"{opts.global_batch} samples do not split into whole microbatches of {mbs} for any dp dividing {gpus}",
            f"use a multiple of {mbs} x a dp that divides {gpus}, e.g. {mbs * gpus}",
        )
    return out


def _baseline_chunks(opts: TuneOptions) -> int:
    """The most interleaved-1F1B chunks among the baselines."""
    return MAX_BASELINE_CHUNKS if opts.chunks_max is None else opts.chunks_max


def _baseline_names(chunks_max: int) -> list[tuple[str, str, int]]:
    names = []
    for schedule in SCHEDULES:
        chunk_choices = range(2, max(2, chunks_max) + 1) if schedule == "interleaved-1f1b" else (2,)
        for chunks in chunk_choices:
            for partition in ("uniform", "balanced"):
                names.append((schedule, partition, chunks))
    return names


def _baseline_label(schedule: str, partition: str, chunks: int) -> str:
    label = schedule if schedule != "interleaved-1f1b" or chunks == 2 else f"{schedule}(v={chunks})"
    return f"{label}/{partition}"


def _baseline_candidates(profile: Profile, cluster: Cluster, config: Config, chunks_max: int) -> list[tuple[str, Candidate]]:
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


def _policy_seeds(profile: Profile, config: Config, chunks_max: int) -> list[Candidate]:
    out = []
    pp, num_mb = config.pp, config.microbatches
    for per_rank in range(1, max(1, chunks_max) + 1):
        num_stages = per_rank * pp
        if num_stages > profile.num_layers:
            break
        bounds = bounds_of(balanced_partition(profile, num_stages))
        placements = [("loop", tuple(loop_placement(pp, num_stages)))]
        if per_rank == 2:
            placements.append(("V", tuple(v_placement(pp, num_stages))))
        for name, ranks in placements:
            for split, depth, gap in ((False, 1.0, False), (True, 1.0, False), (True, 2.0, False), (True, 2.0, True)):
                policies = default_policies(ranks, pp, num_mb, split=split, depth=depth, warmup_gap=gap)
                origin = f"policy seed: balanced, {name} x{per_rank}, split={split}, depth={depth:g}, warm-up gap={gap}"
                out.append(Candidate(config, bounds, ranks, policies, None, origin))
    return out


def _start_aware_seeds(evaluator: Evaluator, seeds: Sequence[Candidate], config: Config,
                       chunks_max: int) -> list[Candidate]:
    """The seeds' layouts re-placed so the busiest ranks hold early stages and late-starting
    ranks carry less (:func:`octoplan.tuner.arrange.start_aware`), with policy knobs."""
    out: list[Candidate] = []
    done: set = set()
    for cand in seeds:
        layout = (cand.bounds, cand.ranks)
        if layout in done or cand.num_stages < 2:
            continue
        done.add(layout)
        costs = evaluator.costs(cand)
        work = [c.forward_ms + c.backward_input_ms + c.backward_weight_ms for c in costs]
        lead = [c.forward_ms + c.backward_input_ms for c in costs]
        per_rank = max(max(cand.ranks.count(r) for r in range(config.pp)), max(1, chunks_max))
        ranks = start_aware(cand.ranks, work, lead, num_ranks=config.pp, microbatches=config.microbatches,
                            max_per_rank=per_rank)
        if ranks == cand.ranks or (cand.bounds, ranks) in done:
            continue
        done.add((cand.bounds, ranks))
        for split, depth, gap in ((True, 1.0, False), (True, 2.0, False), (True, 2.0, True)):
            policies = default_policies(ranks, config.pp, config.microbatches, split=split, depth=depth, warmup_gap=gap)
            out.append(Candidate(config, cand.bounds, ranks, policies, None,
                                 f"start-aware placement of {cand.origin}, split={split}, depth={depth:g}, warm-up gap={gap}"))
    return out


class _Clock:
    """Progress of the search in seconds of its budget: wall seconds, or — with a plan budget —
    the share of plans simulated so far, scaled to the time limit (deterministic)."""

    def __init__(self, limit_s: float, *, max_plans: int | None = None, plans: Callable[[], int] = lambda: 0):
        self.start = time.perf_counter()
        self.limit_s = limit_s
        self.max_plans = max_plans
        self.plans = plans

    def elapsed(self) -> float:
        if self.max_plans:
            return self.plans() / self.max_plans * self.limit_s
        return time.perf_counter() - self.start

    def out(self) -> bool:
        return self.elapsed() >= self.limit_s


class _Search:
    def __init__(self, evaluator: Evaluator, opts: TuneOptions, progress: ProgressFn | None, *,
                 clock: _Clock | None = None, quiet: bool = False):
        self.ev = evaluator
        # the search's own bound on stages per rank (tune() has already capped it at the layers)
        self.opts = opts if opts.chunks_max is not None else replace(opts, chunks_max=DEFAULT_CHUNKS)
        self.progress = progress
        self.quiet = quiet  # a restart's climb on shaken times: its bests are not the search's (DEBUG log only)
        self.extra_plans = 0  # plans simulated by worker processes (:mod:`octoplan.tuner.pool`)
        self.restarts = 0
        self.restart_plans = 0  # plans the restarts simulated on shaken times
        self.shaken: Evaluator | None = None  # the evaluator of the restart climbing now
        self.clock = clock or _Clock(opts.time_limit_s, max_plans=opts.max_plans, plans=self.plans_simulated)
        self.rng = random.Random(opts.seed)
        self.frameworks = Frameworks(evaluator.profile)
        self.best: Candidate | None = None
        self.best_scored: Scored | None = None
        self.accepted_moves: list[str] = []
        # the best allowed candidate of each configuration, on the true times: what the
        # configuration table (:mod:`octoplan.tuner.configs`) compares the winner against
        self.config_best: dict[Config, tuple[Candidate, Scored]] = {}
        self._reordered: set[Candidate] = set()  # candidates whose order was rebuilt already
        self._reorder_s_per_unit = REORDER_S_PER_UNIT  # the last rebuild's seconds per op x rank^2

    def plans_simulated(self) -> int:
        return (self.ev.evaluations + self.extra_plans + self.restart_plans
                + (self.shaken.evaluations if self.shaken else 0))

    def restart(self, start: Candidate, *, deadline: float) -> bool:
        """One more climb from ``start``, on the layer times shaken anew by :data:`RESTART_NOISE`
        (the draw: the seed and the restart's number); its end is judged on the true times and,
        if it is the best plan so far, climbed from on them. Whether it found a better plan.

        A first-improvement climb's path turns on near-ties: which of two moves 0.01% apart
        comes out faster decides where it ends, and the local optima one seed leads to differ
        by percents (llama3-8b: 1497.0 against 1514.9 ms, from times shaken by 0.1%)."""
        self.restarts += 1
        draw = self.opts.seed * 1_000_003 + self.restarts
        self.shaken = Evaluator(self.ev.profile.shaken(RESTART_NOISE, draw), self.ev.cluster)
        climber = _Search(self.shaken, replace(self.opts, seed=draw), None, clock=self.clock, quiet=True)
        # the pace of the order rebuilds measured so far, so the restart's do not overrun the deadline
        climber._reorder_s_per_unit = self._reorder_s_per_unit
        try:
            final = climber.climb(start, deadline=deadline)
        finally:
            self.restart_plans += self.shaken.evaluations
            self.shaken = None
            self._reorder_s_per_unit = climber._reorder_s_per_unit
        before = self.best_scored.score
        scored = self.offer(final)
        log.debug("restart %d from %s: %.4f ms on the true times", self.restarts, start.origin, scored.iteration_ms)
        # a win by a rounding error (the same times summed in another order) is no win: it
        # would keep the restarts from ever stopping
        if not _better_enough(scored.score, before):
            return False
        self.accepted_moves.extend(climber.accepted_moves)
        self.climb(final, deadline=deadline)
        return True

    def allowed(self, cand: Candidate) -> bool:
        """Whether ``cand`` is a plan the search may return (``--runs-on``)."""
        return self.frameworks.allows(cand, self.opts.runs_on)

    def offer(self, cand: Candidate) -> Scored:
        scored = self.ev.score(cand)
        # every candidate is priced (a baseline row is, whatever runs it), only allowed ones win
        if not self.quiet and self.allowed(cand):
            held = self.config_best.get(cand.config)
            if held is None or scored.score < held[1].score:
                self.config_best[cand.config] = (cand, scored)
        if (self.best_scored is None or scored.score < self.best_scored.score) and self.allowed(cand):
            self.best, self.best_scored = cand, scored
            (log.debug if self.quiet else log.info)("best %.4f ms (fits=%s, bubble %.3f) from %s [%s]",
                                                    scored.iteration_ms, scored.fits, scored.bubble_ratio,
                                                    cand.origin, cand.config.label())
            if self.progress:
                self.progress(scored, self.clock.plans(), self.clock.elapsed())
        return scored

    def climb(self, start: Candidate, *, deadline: float) -> Candidate:
        """First-improvement hill climbing from ``start`` until no move helps or ``deadline``
        (seconds since the start of tuning) passes."""
        current = start
        current_score = self.offer(current).score
        while self.clock.elapsed() < deadline:
            result = self.ev.timeline(current)
            improved = False
            costs = self.ev.costs(current)
            work = ([c.forward_ms + c.backward_input_ms + c.backward_weight_ms for c in costs],
                    [c.forward_ms + c.backward_input_ms for c in costs])
            moves = neighbours(current, result, dimensions=self.opts.dimensions, rng=self.rng,
                               allow_recompute=self.opts.recompute,
                               max_stages_per_rank=max(1, self.opts.chunks_max), work=work)
            if "schedule" in self.opts.dimensions:
                # at a local optimum, the whole order justified: one move that can close many
                # bubbles at once. Only then: it fixes the order, and the policy knobs that a
                # policy-scheduled candidate still has to tune no longer apply to it.
                moves = itertools.chain(moves, self._justified_later(current), self._reordered_later(current, deadline))
                if "partition" in self.opts.dimensions:
                    # then a layer moved off a hot rank, and the order justified around it: a
                    # compound move that a shift alone, judged in its old order, misses
                    moves = itertools.chain(moves, self._shifted_and_justified_later(current, result))
                    if "placement" in self.opts.dimensions:
                        # and a layer peeled off a rank that finishes last into a new stage on
                        # one that finishes first, the order carried over and justified
                        moves = itertools.chain(moves, self._peeled_and_justified_later(current, result))
            for moved in moves:
                if self.clock.elapsed() >= deadline:
                    break
                if not self.allowed(moved):  # --runs-on: a placement or order the framework cannot run
                    continue
                try:
                    scored = self.offer(moved)
                except (ValueError, DeadlockError) as exc:  # a move that breaks a rule or the order: skip it
                    log.debug("move %s rejected: %s", moved.origin, exc)
                    continue
                if scored.score < current_score and _better_enough(scored.score, current_score):
                    current, current_score = moved, scored.score
                    self.accepted_moves.append(moved.origin)
                    improved = True
                    break
            if not improved:
                log.debug("climb %s: %.4f ms", "out of time" if self.clock.elapsed() >= deadline else "at a local optimum",
                          current_score[1])
                break
        return current

    def _justified_later(self, cand: Candidate) -> Iterator[Candidate]:
        # a generator: the pass over every op is paid only if the climb gets this far
        yield from self._justified(cand)

    def _reordered_later(self, cand: Candidate, deadline: float) -> Iterator[Candidate]:
        """At a local optimum, the order rebuilt by the shifting-bottleneck procedure (once
        per candidate), unless it would not end before ``deadline``."""
        if cand in self._reordered:
            return
        # its cost grows with the ops times the square of the ranks: estimated at the last
        # rebuild's pace (or a cautious default before the first)
        size = max(1, cand.num_ops * cand.config.pp ** 2)
        if not self.opts.max_plans and self.clock.elapsed() + self._reorder_s_per_unit * size > deadline:
            return
        self._reordered.add(cand)
        started = time.perf_counter()
        try:
            found = self.ev.reordered(cand)
        except (ValueError, DeadlockError) as exc:
            log.debug("reordering %s failed: %s", cand.origin, exc)
            return
        self._reorder_s_per_unit = (time.perf_counter() - started) / size
        yield from found

    def polish(self) -> None:
        """The best plan's order rebuilt by the shifting-bottleneck procedure, if that should
        end within the time limit, and a climb from it if that is faster. The climbs rebuild
        the orders of their local optima, but a climb cut short by its deadline has none."""
        if self.best is None:
            return
        before = self.best_scored.score
        for cand in self._reordered_later(self.best, self.opts.time_limit_s):
            self.offer(cand)
        if self.best_scored.score < before:
            self.climb(self.best, deadline=self.opts.time_limit_s - min(2.0, 0.05 * self.opts.time_limit_s))

    def _shifted_and_justified_later(self, cand: Candidate, result: SimResult) -> Iterator[Candidate]:
        for shifted in shifts_off_hot_ranks(cand, result, limit=COMPOUND_SHIFTS):
            yield from self._justified(shifted)

    def _peeled_and_justified_later(self, cand: Candidate, result: SimResult) -> Iterator[Candidate]:
        if cand.recompute:  # no order to carry (octoplan.tuner.carry.Carrier)
            return
        peels = peel_moves(cand, result, max_per_rank=max(1, self.opts.chunks_max))
        carry = Carrier(cand, result, self.ev)
        for _, bounds, ranks, origin in peels[:PEELS]:
            moved = carry(bounds, ranks, origin)
            if moved is not None:
                yield moved
                yield from self._justified(moved)

    def _justified(self, cand: Candidate) -> list[Candidate]:
        try:
            return self.ev.justified(cand)
        except (ValueError, DeadlockError) as exc:  # an order whose dataflow has a cycle
            log.debug("justifying %s failed: %s", cand.origin, exc)
            return []


class _Restarts:
    """Restarts (:meth:`_Search.restart`) from the first seeds, one after another in turn, until
    :data:`RESTART_PATIENCE` rounds over them in a row find no better plan."""

    def __init__(self, search: _Search, starts: Sequence[Candidate]):
        self.search = search
        self.starts = list(starts)
        self.fruitless = 0  # restarts in a row that found no better plan

    @property
    def done(self) -> bool:
        return not self.starts or self.fruitless >= RESTART_PATIENCE * len(self.starts)

    def next(self, end_s: float) -> None:
        if self.done or self.search.clock.elapsed() >= end_s:
            return
        start = self.starts[self.search.restarts % len(self.starts)]
        self.fruitless = 0 if self.search.restart(start, deadline=end_s) else self.fruitless + 1


# The shifting-bottleneck reordering's cost per op x rank^2 before one is measured, its two
# variants and their justifications together: 2-3.3e-6 s on this project's 2-core machine
# (5 s for gemma3-27b's 6,144 ops on 16 ranks, 27 s for deepseek-v3's 12,288 on 32)
REORDER_S_PER_UNIT = 2.5e-6


def _better_enough(new: tuple[int, float], old: tuple[int, float]) -> bool:
    if new[0] != old[0]:
        return new[0] < old[0]
    return new[1] < old[1] - 1e-9 * max(1.0, abs(old[1]))


def tune(
    profile: Profile,
    cluster: Cluster,
    opts: TuneOptions,
    *,
    profile_path: str | Path | None = None,
    progress: ProgressFn | None = None,
) -> TuneResult:
    """The fastest plan the search finds that fits memory; ``InputError`` if none fits."""
    if not 0 < opts.time_limit_s < math.inf:
        raise InputError(None, "--time-limit", f"is {opts.time_limit_s:g}",
                         "give the search a positive, finite number of seconds (--max-plans bounds it by work instead)")
    if opts.max_plans is not None and opts.max_plans < 1:
        raise InputError(None, "--max-plans", f"is {opts.max_plans}", "give a positive number of plans, or leave it out")
    if opts.chunks_max is not None and opts.chunks_max < 1:
        raise InputError(None, "--chunks-max", f"is {opts.chunks_max}", "allow at least 1 stage per rank")
    if opts.workers < 1:
        raise InputError(None, "--workers", f"is {opts.workers}", "use at least 1 process")
    if opts.workers > MAX_WORKERS:
        raise InputError(None, "--workers", f"is {opts.workers}", f"use at most {MAX_WORKERS} processes (one per core to spare)")
    if not 0 <= opts.seed <= MAX_SEED:
        raise InputError(None, "--seed", f"is {opts.seed}", f"use a seed from 0 to {MAX_SEED}")
    if opts.runs_on not in RUNS_ON:
        raise InputError(None, "--runs-on", f"is {opts.runs_on!r}", f"use one of {', '.join(RUNS_ON)}")
    if opts.runs_on == "megatron":
        reason = Frameworks(profile).megatron_reason
        if reason:
            raise InputError(str(profile_path) if profile_path else None, "--runs-on megatron", reason,
                             "Megatron-LM's pipeline layout cannot express this model; tune for octorun or torch")
        # Megatron runs its own order: only the partition is the search's (boundary shifts keep
        # the order; every other move would leave it)
        opts = replace(opts, dimensions=tuple(d for d in opts.dimensions if d == "partition"))
    configs = configs_for(profile, opts)
    if cluster.gpus != opts.gpus:
        cluster = Cluster(**{**cluster.to_dict(), "gpus": opts.gpus})
    evaluator = Evaluator(profile, cluster)
    # the search's own bound on stages per rank: no rank can hold more stages than there are
    # layers, so a larger --chunks-max changes nothing (the baselines read the bound as given)
    search = _Search(evaluator, replace(opts, chunks_max=min(opts.chunks_max or DEFAULT_CHUNKS, profile.num_layers)),
                     progress)
    baselines = _collect_baselines(profile, cluster, configs, opts, search) if opts.baselines else []
    megatron_chunks = _baseline_chunks(opts)  # Megatron's users choose their virtual stages as the baselines'
    opts = search.opts

    seeds: list[Candidate] = [row.candidate for row in baselines]
    cpsat_stats: list[dict] = []
    for config in configs:
        if search.clock.out():
            break
        if opts.runs_on == "megatron":
            seeds.extend(_megatron_seeds(search, profile, config, megatron_chunks))
            continue
        if "schedule" in opts.dimensions or "placement" in opts.dimensions or not opts.baselines:
            seeds.extend(_policy_seeds(profile, config, opts.chunks_max))
        # CP-SAT and the start-aware seeds place stages freely: a fixed placement keeps none of them
        if opts.runs_on != "any":
            continue
        if opts.use_cpsat and {"partition", "placement"} <= set(opts.dimensions):
            from octoplan.tuner.cpsat import cpsat_seeds  # OR-Tools only when the tuner runs

            # CP-SAT's limit is deterministic time (work), so the seeds do not depend on the clock
            found, stats = cpsat_seeds(evaluator, config, chunks_max=opts.chunks_max,
                                       time_limit_s=max(0.5, min(5.0, opts.time_limit_s / (12 * len(configs)))),
                                       seed=opts.seed, recompute=opts.recompute)
            seeds.extend(found)
            cpsat_stats.extend(stats)
        if "placement" in opts.dimensions:
            seeds.extend(_start_aware_seeds(evaluator, [c for c in seeds if c.config == config], config, opts.chunks_max))
    ranked = []
    for index, cand in enumerate(seeds):
        if search.clock.out() and search.best is not None:
            break
        ranked.append((search.offer(cand).score, index, cand))
    ranked.sort(key=lambda item: (item[0], item[1]))
    if opts.recompute and "schedule" in opts.dimensions:
        ranked = _with_recompute_seeds(search, ranked)
    if "schedule" in opts.dimensions:
        ranked = _with_justified_seeds(search, ranked)
    ranked = [item for item in ranked if search.allowed(item[2])]
    if not ranked and search.best is None:  # (a budget spent on the baselines leaves none to rank, yet a best)
        raise InputError(None, "--runs-on", f"{opts.runs_on}: no plan of that kind applies to these GPUs and "
                         "microbatches", _NO_SEED_FIX.get(opts.runs_on, "tune with --runs-on any"))
    seeded_s = search.clock.elapsed()

    # Climb from the best seed of each family (configuration x stage count x fixed or policy
    # schedule), best families first, in the most promising configurations; each climb gets
    # an equal share of the time left, and what a climb leaves unused passes on.
    starts: list[Candidate] = []
    families: set = set()
    configs_seen: list[Config] = []
    for _, _, cand in ranked:
        if cand.config not in configs_seen:
            configs_seen.append(cand.config)
        if configs_seen.index(cand.config) >= opts.max_configs:
            continue
        family = (cand.config, cand.num_stages, cand.fixed is None)
        if family not in families:
            families.add(family)
            starts.append(cand)
    starts = starts[:opts.max_starts]
    # Then, in the time the climbs leave unused (they stop at local optima): climbs from the
    # next-best seeds, any family, best first, so a converged search keeps looking elsewhere.
    first = set(starts)
    later = list(dict.fromkeys(cand for _, _, cand in ranked
                               if cand not in first and configs_seen.index(cand.config) < opts.max_configs))
    end_s = opts.time_limit_s - min(2.0, 0.05 * opts.time_limit_s)
    restarts = _Restarts(search, starts)
    if opts.workers > 1:
        from octoplan.tuner.pool import Climb, climb_in_parallel

        climbs = [Climb(cand, True) for cand in starts] + [Climb(cand, False) for cand in later]
        climbed = climb_in_parallel(search, evaluator.profile, cluster, opts, climbs, end_s=end_s)
    else:
        climbed = 0
        # each of the first climbs gets an equal share of the time left before end_s (the rest
        # is the polish's and the final plan's); what a climb leaves unused passes on
        for index, start in enumerate(starts):
            if search.clock.elapsed() >= end_s:
                break
            share = (end_s - search.clock.elapsed()) / (len(starts) - index)
            search.climb(start, deadline=search.clock.elapsed() + share)
            climbed += 1
        # then climbs from the next-best seeds, each followed by a restart (a climb from the
        # first seeds again, on shaken times) until the restarts stop paying
        for cand in later:
            if search.clock.elapsed() >= end_s:
                break
            search.climb(cand, deadline=end_s)
            climbed += 1
            restarts.next(end_s)
    # and in the time left, only restarts
    while not restarts.done and search.clock.elapsed() < end_s:
        restarts.next(end_s)
    if "schedule" in opts.dimensions:
        search.polish()

    best, best_scored = search.best, search.best_scored
    if best is None or best_scored is None or not best_scored.fits:
        least = evaluator.least_memory()
        needed = f"{least / 1e9:.3g} GB" if least is not None else "more memory"
        raise InputError(
            str(profile_path) if profile_path else None, "--memory-gb",
            f"no plan fits {cluster.memory_gb:g} GB per GPU; the leanest plan found needs {needed} per GPU",
            "use more GPUs, a larger --memory-gb, or a profile of a smaller --microbatch-size"
            + ("" if opts.recompute else "; or let stages recompute their activations (drop --no-recompute)"),
        )
    plan = _final_plan(evaluator, best, profile_path=profile_path)
    from octoplan.schedules.exact import relaxation_bound  # OR-Tools only when the tuner runs

    # what a better order of the same stages and placement could still save, at most
    order_bound = relaxation_bound(plan.schedule, best.ranks, evaluator.costs(best), cluster=evaluator.cluster,
                                   parallel=best.config.parallel())
    # where the rest of the iteration goes: efficiency = balance (how close the busiest rank's
    # work is to FORMATS.md section 7's lower bound) x schedule (how little that rank idles), and
    # when it idles: a warm-up says it needs less work, waits between ops a lighter neighbour
    timeline = evaluator.timeline(best)
    busiest = max(range(best.config.pp), key=lambda r: (timeline.busy_ms[r], -r))
    warm_up, between, drain = timeline.idle_parts(busiest)
    stats = {
        "seed": opts.seed,
        "time_limit_s": opts.time_limit_s,
        # real seconds, also under --max-plans (whose clock counts plans as seconds)
        "wall_s": round(time.perf_counter() - search.clock.start, 3),
        # with workers, a plan simulated in two processes (each has its own cache) counts twice
        "evaluations": search.plans_simulated(),
        "workers": opts.workers,
        "plans_in_workers": search.extra_plans,
        "climbs": climbed,
        "restarts": search.restarts,
        "plans_in_restarts": search.restart_plans,
        "configs": len(configs),
        "seeds": len(seeds),
        "seeding_s": round(seeded_s, 3),
        "origin": best.origin,
        "moves_accepted": len(search.accepted_moves),
        "order_bound_ms": round(order_bound, 4),
        "busiest_rank": busiest,
        "busiest_busy_ms": round(timeline.busy_ms[busiest], 4),
        # of which the forwards that recomputing stages run again in their I and B ops
        "busiest_recompute_ms": round(sum(_again_ms(evaluator, best, op.stage) for op in plan.schedule[busiest]
                                          if op.kind in (Kind.I, Kind.B)), 4),
        "lower_bound_ms": round(timeline.lower_bound_ms, 4),
        # a profile of layers that take no time makes every plan perfect: 1, not a division by 0
        "balance": round(timeline.lower_bound_ms / timeline.busy_ms[busiest], 4) if timeline.busy_ms[busiest] else 1.0,
        "schedule": round(timeline.busy_ms[busiest] / timeline.iteration_ms, 4) if timeline.iteration_ms else 1.0,
        "busiest_idle_ms": {"warm_up": round(warm_up, 4), "between": round(between, 4), "drain": round(drain, 4)},
        "dimensions": list(opts.dimensions),
        "cpsat": cpsat_stats,
    }
    if best.policies is not None:
        stats["policies"] = [p.to_dict() for p in best.policies]
    stats["runs_on"] = opts.runs_on
    plan = replace(plan, extra={"tuner": stats})
    log.info("tuned in %.1f s, %d evaluations: %.4f ms", stats["wall_s"], stats["evaluations"], best_scored.iteration_ms)
    frameworks = search.frameworks
    rows = tuple(replace(row, runs_on=frameworks.runs_on(row.candidate)) for row in baselines)
    configs_best = tuple(sorted(search.config_best.values(), key=lambda item: (item[1].score, item[0].config)))
    return TuneResult(plan, best_scored, best, rows, stats, frameworks.runs_on(best), configs_best)


_NO_SEED_FIX = {
    "megatron": "Megatron-LM needs a stage per rank at least, and for interleaved 1F1B microbatches that are a "
                "multiple of pp; give --pp and --microbatches that allow it",
    "loop": "a loop needs the same number of stages on every rank: give a --pp no larger than the layer count",
    "v": "a V needs two stages per rank: give a --pp of at most half the layer count",
}


def _snapped(bounds: tuple[int, ...], cuts: set[int]) -> tuple[int, ...] | None:
    """``bounds`` with every inner boundary moved to the nearest layer index in ``cuts`` (a
    split-blocks profile's block starts), kept strictly increasing; None where that fails."""
    allowed = sorted(cuts)
    out = [bounds[0]]
    for b in bounds[1:-1]:
        options = [c for c in allowed if out[-1] < c < bounds[-1]]
        if not options:
            return None
        out.append(min(options, key=lambda c: (abs(c - b), c)))
    out.append(bounds[-1])
    return tuple(out)


def _megatron_seeds(search: _Search, profile: Profile, config: Config, chunks_max: int) -> list[Candidate]:
    """Megatron-LM's plans on ``config``: 1F1B, and interleaved 1F1B with every chunk count up to
    ``chunks_max`` that Megatron runs, each with a uniform and a balanced partition snapped to
    Megatron's layer boundaries, in Megatron's order (:func:`octoplan.export_megatron.megatron_order`)
    and marked so (:data:`MEGATRON_ID`); where one does not fit memory, also with the fewest
    layers recomputed per stage that fit (Megatron's block method)."""
    frameworks = search.frameworks
    assert frameworks.letters is not None
    out: list[Candidate] = []
    for chunks in range(1, max(1, chunks_max) + 1):
        num_stages = chunks * config.pp
        if num_stages > profile.num_layers:
            break
        order = frameworks.order(config.pp, config.microbatches, chunks)
        if order is None:
            continue
        ranks = tuple(loop_placement(config.pp, num_stages))
        what = "1F1B" if chunks == 1 else f"interleaved 1F1B with {chunks} virtual stages"
        for method in ("uniform", "balanced"):
            try:
                pairs = partition(profile, num_stages, method, fused_backward=True)
            except (InputError, ValueError):
                continue
            bounds = _snapped(bounds_of(pairs), frameworks.letters.cuts)
            if bounds is None:
                continue
            label = f"{MEGATRON_ID}(v={chunks})/{method}"
            cand = Candidate(config, bounds, ranks, None, order, f"Megatron-LM {what}, {method} partition", label)
            if not frameworks.megatron_layout_ok(cand):
                continue
            out.append(cand)
            if search.opts.recompute and not search.offer(cand).fits:
                out.append(_fewest_recomputed_layers(search, cand, f"{cand.origin}, recomputing"))
    return out


def _again_ms(evaluator: Evaluator, cand: Candidate, stage: int) -> float:
    """The forward time ``stage``'s first backward op runs again: its recomputed layers' (0
    where the stage does not recompute)."""
    start = cand.bounds[stage]
    return evaluator.table.stage(start, start + cand.recomputed_layers(stage)).forward_ms


JUSTIFIED_SEEDS = 8  # the best seeds whose orders are justified before the climbs
RECOMPUTE_SEEDS = 8  # the fastest seeds that do not fit memory, copied with recomputation


def _with_recompute_seeds(search: _Search, ranked: list) -> list:
    """``ranked`` (score, index, candidate) with recomputing copies of the fastest seeds that
    do not fit memory, and of the fastest that do (those whose admissions memory throttles
    can run deeper with it), ranked again; every stage recomputes, and the climbs turn it off
    rank by rank and stage by stage where memory allows."""
    short = sorted((item for item in ranked if item[0][0] != 0 and not item[2].recompute),
                   key=lambda item: (search.ev.score(item[2]).iteration_ms, item[1]))
    fitting = [item for item in ranked if item[0][0] == 0 and not item[2].recompute]
    out = list(ranked)
    for _, index, cand in short[:RECOMPUTE_SEEDS] + fitting[:RECOMPUTE_SEEDS // 2]:
        if search.clock.out():
            break
        moved = replace(cand, recompute=cand.every_stage, origin=f"{cand.origin}, every rank recomputes")
        out.append((search.offer(moved).score, index, moved))
    out.sort(key=lambda item: (item[0], item[1]))
    return out


def _with_justified_seeds(search: _Search, ranked: list) -> list:
    """``ranked`` (score, index, candidate) with the justified orders of its best
    ``JUSTIFIED_SEEDS`` layouts added, ranked again. Justification often closes most of a
    list scheduler's bubbles on uneven or irregular layouts, so the climbs should start from
    the justified plans. A count, not a share of the time, bounds the work, so which seeds are
    justified does not depend on the machine's speed."""
    out = list(ranked)
    layouts: set = set()
    for _, index, cand in ranked:
        if len(layouts) >= JUSTIFIED_SEEDS or search.clock.out():
            break
        layout = (cand.config, cand.bounds, cand.ranks)
        if layout in layouts:
            continue
        layouts.add(layout)
        for moved in search._justified(cand):
            out.append((search.offer(moved).score, index, moved))
    out.sort(key=lambda item: (item[0], item[1]))
    return out


def _collect_baselines(profile: Profile, cluster: Cluster, configs: Sequence[Config], opts: TuneOptions,
                       search: _Search) -> list[BaselineRow]:
    """Every baseline on every configuration; one row per schedule/partition, its best config.
    A baseline that fits memory in no configuration gets a second row, ``LABEL+recompute``,
    with every stage recomputing its first N layers, the fewest N that fits (Megatron-LM's
    ``--recompute-method block --recompute-num-layers N``: what its users turn on when a
    schedule runs out of memory; all layers where nothing less fits), unless
    ``opts.recompute`` is off."""
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
                  for label, cand in _baseline_candidates(profile, cluster, config, _baseline_chunks(opts))]
    for config, label, cand in candidates:
        consider(label, config, cand)
    if opts.recompute:
        short = {label for label in order if not best[label].scored.fits}
        for config, label, cand in candidates:
            if label in short:
                consider(f"{label}+recompute", config, _fewest_recomputed_layers(search, cand, f"{label}+recompute"))
    rows = []
    for label in order:
        if not label.endswith("+recompute"):
            rows += [best[name] for name in (label, f"{label}+recompute") if name in best]
    return rows


def _fewest_recomputed_layers(search: _Search, cand: Candidate, origin: str) -> Candidate:
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


def compare_baselines(profile: Profile, cluster: Cluster, opts: TuneOptions) -> list[BaselineRow]:
    """The baselines alone (``octoplan compare`` adds the tuned plan to them)."""
    configs = configs_for(profile, opts)
    if cluster.gpus != opts.gpus:
        cluster = Cluster(**{**cluster.to_dict(), "gpus": opts.gpus})
    search = _Search(Evaluator(profile, cluster), opts, None)
    return _collect_baselines(profile, cluster, configs, opts, search)


def _final_plan(evaluator: Evaluator, cand: Candidate, *, profile_path: str | Path | None) -> Plan:
    plan = evaluator.plan(cand)
    check_structure(plan, num_layers=evaluator.num_layers)
    path = str(profile_path) if profile_path else None
    sha = file_sha256(profile_path) if profile_path and Path(profile_path).exists() else None
    return Plan(
        model=plan.model, cluster=plan.cluster, parallel=plan.parallel, stages=plan.stages, schedule=plan.schedule,
        profile=path, profile_sha256=sha,
        predicted=evaluator.simulate(cand).prediction(),  # the figures scored, and octorun's to set beside
    )

