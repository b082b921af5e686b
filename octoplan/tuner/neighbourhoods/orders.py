"""Moves that keep the layout and rebuild its whole op order. Tried only where the basic moves
are spent (at a local optimum): each fixes the order, so the policy knobs a policy-scheduled
candidate still has to tune no longer apply to what it yields."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from octoplan.simulator import SimResult
from octoplan.tuner.neighbourhoods.base import Neighbourhood
from octoplan.tuner.space import BOTTLENECK, LONGEST_TAIL, Candidate

if TYPE_CHECKING:
    from octoplan.tuner.climb import Search

__all__ = ["JustifiedOrder", "BottleneckOrder", "LongestTailOrder"]


class JustifiedOrder(Neighbourhood):
    """The whole order justified (:mod:`octoplan.schedules.justify`): one move that can close
    many bubbles at once."""

    name = "justified order"
    dimensions = ("schedule",)

    def moves(self, search: Search, cand: Candidate, timeline: SimResult, deadline: float) -> Iterator[Candidate]:
        # a generator: the pass over every op is paid only if the climb gets this far, and only
        # if it should end before the deadline
        yield from search.justified_by(cand, deadline)


class BottleneckOrder(Neighbourhood):
    """The order rebuilt by the shifting-bottleneck procedure
    (:mod:`octoplan.schedules.bottleneck`), once per candidate, where it should end before the
    deadline (:meth:`octoplan.tuner.climb.Search.rebuilt_orders`)."""

    name = BOTTLENECK.name
    dimensions = ("schedule",)

    def moves(self, search: Search, cand: Candidate, timeline: SimResult, deadline: float) -> Iterator[Candidate]:
        yield from search.rebuilt_orders(cand, deadline, BOTTLENECK)


class LongestTailOrder(Neighbourhood):
    """The order rebuilt by the longest-tail-first list scheduler
    (:mod:`octoplan.schedules.list_order`), once per candidate, where it should end before the
    deadline: every rank at once runs the arrived op on the longest remaining chain, which
    starts a pipeline's drain early where the policy knobs and the per-rank rebuild do not."""

    name = LONGEST_TAIL.name
    dimensions = ("schedule",)

    def moves(self, search: Search, cand: Candidate, timeline: SimResult, deadline: float) -> Iterator[Candidate]:
        yield from search.rebuilt_orders(cand, deadline, LONGEST_TAIL)
