"""Compound moves: a layout change followed by a justification of the order around it. A
layout move alone is judged in an order tuned for the old layout (a boundary shift), or hands
the candidate to the policy scheduler and loses the tuned order (a new stage); either way it
scores worse than it could, and a climb stops short of it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from octoplan.simulator import SimResult
from octoplan.tuner.carry import Carrier, peel_moves
from octoplan.tuner.moves import shifts_off_hot_ranks
from octoplan.tuner.neighbourhoods.base import Neighbourhood
from octoplan.tuner.space import Candidate

if TYPE_CHECKING:
    from octoplan.tuner.climb import Search

__all__ = ["ShiftedAndJustified", "PeeledAndJustified", "COMPOUND_SHIFTS", "PEELS"]

COMPOUND_SHIFTS = 6  # at a climb's local optimum, the boundary shifts tried with a justification each
PEELS = 6  # then the layers peeled onto another rank, justified each


class ShiftedAndJustified(Neighbourhood):
    """A layer moved off a hot rank (the ``limit`` most promising boundary shifts), and the
    order justified around it."""

    name = "shifted and justified"
    dimensions = ("schedule", "partition")

    def __init__(self, limit: int = COMPOUND_SHIFTS):
        self.limit = limit

    def moves(self, search: Search, cand: Candidate, timeline: SimResult, deadline: float) -> Iterator[Candidate]:
        for shifted in shifts_off_hot_ranks(cand, timeline, limit=self.limit):
            yield from search.justified_by(shifted, deadline)


class PeeledAndJustified(Neighbourhood):
    """A layer peeled off a rank that finishes last into a new stage on one that finishes first
    (the ``limit`` most promising), the order carried over (:mod:`octoplan.tuner.carry`), then
    justified."""

    name = "peeled and justified"
    dimensions = ("schedule", "partition", "placement")

    def __init__(self, limit: int = PEELS):
        self.limit = limit

    def moves(self, search: Search, cand: Candidate, timeline: SimResult, deadline: float) -> Iterator[Candidate]:
        if cand.recompute:  # no order to carry (octoplan.tuner.carry.Carrier)
            return
        peels = peel_moves(cand, timeline, max_per_rank=max(1, search.opts.chunks_max))
        carry = Carrier(cand, timeline, search.ev)
        for _, bounds, ranks, origin in peels[:self.limit]:
            moved = carry(bounds, ranks, origin)
            if moved is not None:
                yield moved
                yield from search.justified_by(moved, deadline)
