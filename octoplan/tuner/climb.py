"""The search's state and its one climb loop: first-improvement hill climbing over the
neighbourhoods of :mod:`octoplan.tuner.neighbourhoods`.

A :class:`Search` holds what every step of ``tune`` shares: the evaluator (the one judge of a
candidate), the best plan so far and the best of each configuration, the seeded
``random.Random`` that breaks ties, and the :class:`Clock`. :meth:`Search.climb` simulates the
current candidate, walks its neighbourhoods in their fixed order (each yields moved candidates
lazily, so a neighbourhood further down costs nothing until the ones before it are spent) and
takes the first move that is faster (or, while nothing fits, leaner); at a local optimum it
stops. The climb knows no kind of move: a new one is a new neighbourhood, not a branch here.

Restarts (:meth:`Search.restart`, :class:`Restarts`) climb again from the first seeds on layer
times shaken by :data:`RESTART_NOISE`, and :meth:`Search.polish` rebuilds the best plan's order
at the end.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from octoplan.simulator import DeadlockError
from octoplan.tuner.frameworks import Frameworks
from octoplan.tuner.space import (BOTTLENECK, JUSTIFY_S_PER_UNIT, ORDER_RULES, Candidate, Config, Evaluator, OrderRule,
                                  Scored, justification_size)

if TYPE_CHECKING:
    from octoplan.tuner.neighbourhoods import Neighbourhood
    from octoplan.tuner.search import TuneOptions

__all__ = ["Clock", "Search", "Restarts", "ProgressFn", "better_enough", "DEFAULT_CHUNKS", "RESTART_NOISE",
           "RESTART_PATIENCE"]

log = logging.getLogger("octoplan.tuner")

ProgressFn = Callable[[Scored, int, float], None]  # best so far, evaluations, elapsed seconds

# Without --chunks-max: the layouts the search builds hold at most DEFAULT_CHUNKS stages per
# rank (a search-space bound: each more allowed widens every climb's neighbourhood), while the
# baselines have interleaved 1F1B with every chunk count the layers allow, up to
# MAX_BASELINE_CHUNKS (:mod:`octoplan.tuner.seeds.baselines`).
DEFAULT_CHUNKS = 3
# restarts: climbs again from the first seeds on layer times scaled by 1 + RESTART_NOISE x
# N(0, 1) (Search.restart), until RESTART_PATIENCE rounds over those seeds in a row find nothing
RESTART_NOISE = 1e-3
RESTART_PATIENCE = 3


class Clock:
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


def climbs_end_s(limit_s: float) -> float:
    """When the climbs stop: the rest of the time limit is the polish's (until
    :func:`polish_end_s`) and the final plan's. A climb step that starts just before its
    deadline ends after it (a large plan's simulation takes half a second), and so may the
    polish's last move: each part leaves the next one a margin."""
    return limit_s - 1.5 * _margin_s(limit_s)


def polish_end_s(limit_s: float) -> float:
    """When the polish's climbs stop: the rest is the final plan's."""
    return limit_s - _margin_s(limit_s)


def _margin_s(limit_s: float) -> float:
    return min(2.0, 0.05 * limit_s)


def better_enough(new: tuple[int, float], old: tuple[int, float]) -> bool:
    """Whether score ``new`` beats ``old`` by more than a rounding error (the same times summed
    in another order): a relative 1e-9 of the iteration time."""
    if new[0] != old[0]:
        return new[0] < old[0]
    return new[1] < old[1] - 1e-9 * max(1.0, abs(old[1]))


class Search:
    """The state the steps of ``tune`` share, and the climb loop.

    ``neighbourhoods``: the moves a climb tries, in order (default
    :data:`octoplan.tuner.neighbourhoods.NEIGHBOURHOODS`); those whose dimensions the options
    do not tune are left out."""

    def __init__(self, evaluator: Evaluator, opts: TuneOptions, progress: ProgressFn | None, *,
                 clock: Clock | None = None, quiet: bool = False,
                 neighbourhoods: Sequence[Neighbourhood] | None = None, stage_cap: int | None = None):
        from octoplan.tuner import neighbourhoods as registry  # the neighbourhoods import this module

        self.ev = evaluator
        # ``stage_cap``, --chunks-max as given, binds every plan the search returns, seeds
        # included; not given, the search's own layouts hold at most opts.chunks_max stages per
        # rank (DEFAULT_CHUNKS; tune() has already capped it at the layers) while a baseline of
        # more may still win
        self.stage_cap = stage_cap
        self.opts = opts if opts.chunks_max is not None else replace(opts, chunks_max=DEFAULT_CHUNKS)
        self.progress = progress
        self.quiet = quiet  # a restart's climb on shaken times: its bests are not the search's (DEBUG log only)
        self.extra_plans = 0  # plans simulated by worker processes (:mod:`octoplan.tuner.pool`)
        self.restarts = 0
        self.restart_plans = 0  # plans the restarts simulated on shaken times
        self.shaken: Evaluator | None = None  # the evaluator of the restart climbing now
        self.clock = clock or Clock(opts.time_limit_s, max_plans=opts.max_plans, plans=self.plans_simulated)
        self.rng = random.Random(opts.seed)
        self.frameworks = Frameworks(evaluator.profile, letters=dict(opts.kind_letters), cluster=evaluator.cluster)
        self.best: Candidate | None = None
        self.best_scored: Scored | None = None
        self.accepted_moves: list[str] = []
        # the best allowed candidate of each configuration, on the true times: what the
        # configuration table (:mod:`octoplan.tuner.configs`) compares the winner against
        self.config_best: dict[Config, tuple[Candidate, Scored]] = {}
        self.neighbourhoods = tuple(registry.NEIGHBOURHOODS if neighbourhoods is None else neighbourhoods)
        tuned = set(self.opts.dimensions)
        usable = tuple(n for n in self.neighbourhoods if set(n.dimensions) <= tuned)
        self._active = tuple(n for n in usable if n.climbs)  # what every climb tries
        self._polishing = tuple(n for n in usable if n.polish)  # what the polish climbs over first
        # per rule of Evaluator.reordered: the candidates whose order it rebuilt already, and
        # the last rebuild's seconds per unit of the rule's size
        self._rebuilt: dict[OrderRule, set[Candidate]] = {rule: set() for rule in ORDER_RULES}
        self._rebuild_pace = {rule: rule.s_per_unit for rule in ORDER_RULES}
        # seconds per unit of justification_size of the last justified_by
        self._justify_pace = JUSTIFY_S_PER_UNIT

    def plans_simulated(self) -> int:
        return (self.ev.evaluations + self.extra_plans + self.restart_plans
                + (self.shaken.evaluations if self.shaken else 0))

    def allowed(self, cand: Candidate) -> bool:
        """Whether ``cand`` is a plan the search may return (``--runs-on``, ``--chunks-max``)."""
        if self.stage_cap is not None and max(Counter(cand.ranks).values()) > self.stage_cap:
            return False
        return self.frameworks.allows(cand, self.opts.runs_on)

    def offer(self, cand: Candidate) -> Scored:
        """``cand`` priced, and kept as the best (overall and of its configuration) if it is."""
        scored = self.ev.score(cand)
        # every candidate is priced (a baseline row is, whatever runs it), only allowed ones win
        allowed = self.allowed(cand)
        if not self.quiet and allowed:
            held = self.config_best.get(cand.config)
            if held is None or scored.score < held[1].score:
                self.config_best[cand.config] = (cand, scored)
        if (self.best_scored is None or scored.score < self.best_scored.score) and allowed:
            self.best, self.best_scored = cand, scored
            (log.debug if self.quiet else log.info)("best %.4f ms (fits=%s, bubble %.3f) from %s [%s]",
                                                    scored.iteration_ms, scored.fits, scored.bubble_ratio,
                                                    cand.origin, cand.config.label())
            if self.progress:
                self.progress(scored, self.clock.plans(), self.clock.elapsed())
        return scored

    def climb(self, start: Candidate, *, deadline: float, only: Sequence[Neighbourhood] | None = None) -> Candidate:
        """First-improvement hill climbing from ``start`` until no move helps or ``deadline``
        (seconds since the start of tuning) passes; ``only``: these neighbourhoods instead of
        every active one."""
        current = start
        current_score = self.offer(current).score
        active = self._active if only is None else tuple(only)
        while self.clock.elapsed() < deadline:
            step = self._first_better(current, current_score, deadline, active)
            if step is None:
                log.debug("climb %s: %.4f ms", "out of time" if self.clock.elapsed() >= deadline else "at a local optimum",
                          current_score[1])
                break
            current, current_score = step
            self.accepted_moves.append(current.origin)
        return current

    def _first_better(self, current: Candidate, current_score: tuple[int, float], deadline: float,
                      active: Sequence[Neighbourhood]) -> tuple[Candidate, tuple[int, float]] | None:
        """The first move of the ``active`` neighbourhoods, in their order, that beats
        ``current``; None at a local optimum or once ``deadline`` passes."""
        timeline = self.ev.timeline(current)
        # lazily: a neighbourhood is asked for its moves only once the ones before it are spent
        moves = itertools.chain.from_iterable(n.moves(self, current, timeline, deadline) for n in active)
        for moved in moves:
            if self.clock.elapsed() >= deadline:
                return None
            if not self.allowed(moved):  # --runs-on: a placement or order the framework cannot run
                continue
            try:
                scored = self.offer(moved)
            except (ValueError, DeadlockError) as exc:  # a move that breaks a rule or the order: skip it
                log.debug("move %s rejected: %s", moved.origin, exc)
                continue
            if scored.score < current_score and better_enough(scored.score, current_score):
                return moved, scored.score
        return None

    # Services the seed families and neighbourhoods share -------------------------------

    def justified(self, cand: Candidate) -> list[Candidate]:
        """``cand``'s order justified (:meth:`Evaluator.justified`); none where its dataflow has
        a cycle."""
        try:
            return self.ev.justified(cand)
        except (ValueError, DeadlockError) as exc:  # an order whose dataflow has a cycle
            log.debug("justifying %s failed: %s", cand.origin, exc)
            return []

    def justified_by(self, cand: Candidate, deadline: float) -> list[Candidate]:
        """:meth:`justified`, unless at the pace of the last such justification it would not
        end before ``deadline`` (under a plan budget it always runs): what the climbs' moves
        use, since one justification of a large plan takes seconds (a climb checks its
        deadline only between the candidates its moves yield)."""
        size = max(1.0, justification_size(cand))
        if not self.opts.max_plans and self.clock.elapsed() + self._justify_pace * size > deadline:
            return []
        started = time.perf_counter()
        found = self.justified(cand)
        self._justify_pace = (time.perf_counter() - started) / size
        return found

    def rebuilt_orders(self, cand: Candidate, deadline: float, rule: OrderRule = BOTTLENECK) -> Iterator[Candidate]:
        """``cand``'s order rebuilt by ``rule`` (:meth:`Evaluator.reordered`; once per candidate
        and rule), unless it would not end before ``deadline``. The pace of the rebuilds so far
        is the search's (a restart's climber shares it)."""
        done = self._rebuilt[rule]
        if cand in done:
            return
        # estimated at the last rebuild's pace (or a cautious default before the first)
        size = max(1, rule.size(cand))
        if not self.opts.max_plans and self.clock.elapsed() + self._rebuild_pace[rule] * size > deadline:
            return
        done.add(cand)
        started = time.perf_counter()
        try:
            found = self.ev.reordered(cand, rule)
        except (ValueError, DeadlockError) as exc:
            log.debug("reordering %s (%s) failed: %s", cand.origin, rule.name, exc)
            return
        self._rebuild_pace[rule] = (time.perf_counter() - started) / size
        yield from found

    # Restarts and the final polish --------------------------------------------------------

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
        climber = Search(self.shaken, replace(self.opts, seed=draw), None, clock=self.clock, quiet=True,
                         neighbourhoods=self.neighbourhoods)
        # the pace of the order rebuilds, shared, so the restart's do not overrun the deadline
        climber._rebuild_pace = self._rebuild_pace
        try:
            final = climber.climb(start, deadline=deadline)
        finally:
            self.restart_plans += self.shaken.evaluations
            self.shaken = None
        before = self.best_scored.score
        scored = self.offer(final)
        log.debug("restart %d from %s: %.4f ms on the true times", self.restarts, start.origin, scored.iteration_ms)
        # a win by a rounding error (the same times summed in another order) is no win: it
        # would keep the restarts from ever stopping
        if not better_enough(scored.score, before):
            return False
        self.accepted_moves.extend(climber.accepted_moves)
        self.climb(final, deadline=deadline)
        return True

    def polish(self) -> None:
        """The best plan's order rebuilt by the shifting-bottleneck procedure and by the
        longest-tail-first list scheduler, each if it should end by :func:`polish_end_s`; then a
        climb from the fastest over the neighbourhoods that polish (``Neighbourhood.polish``:
        the chain shifts, which no other climb tries); then, if all that found a faster plan,
        a climb over every neighbourhood. Both climbs stop at :func:`polish_end_s`. The climbs
        rebuild the orders of their local optima, but a climb cut short by its deadline has
        none."""
        if self.best is None:
            return
        before = self.best_scored.score
        best = self.best
        # by the polish's end, not the limit's: the final plan and its stats take the rest, and a
        # rebuild's pace, taken from smaller layouts, can be off by half (llama3-70b-a100's
        # longest-tail rebuild of 61,440 ops, estimated to end by the limit, ended 1.2 s after it)
        for rule in ORDER_RULES:
            for cand in self.rebuilt_orders(best, polish_end_s(self.opts.time_limit_s), rule):
                self.offer(cand)
        if self._polishing:
            self.climb(self.best, deadline=polish_end_s(self.opts.time_limit_s), only=self._polishing)
        if self.best_scored.score < before:
            self.climb(self.best, deadline=polish_end_s(self.opts.time_limit_s))


class Restarts:
    """Restarts (:meth:`Search.restart`) from the first seeds, one after another in turn, until
    :data:`RESTART_PATIENCE` rounds over them in a row find no better plan."""

    def __init__(self, search: Search, starts: Sequence[Candidate]):
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
