"""The basic moves of :mod:`octoplan.tuner.moves` as one neighbourhood: one boundary, stage,
placement, policy knob, recomputation or op-order edit at a time, the most promising first
(ranked together by the heat read off the timeline)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from octoplan.simulator import SimResult
from octoplan.tuner.moves import neighbours
from octoplan.tuner.neighbourhoods.base import Neighbourhood
from octoplan.tuner.space import Candidate

if TYPE_CHECKING:
    from octoplan.tuner.climb import Search

__all__ = ["BasicMoves"]


class BasicMoves(Neighbourhood):
    name = "basic moves"
    dimensions = ()  # each kind of basic move checks its own dimension

    def moves(self, search: Search, cand: Candidate, timeline: SimResult, deadline: float) -> Iterator[Candidate]:
        opts = search.opts
        costs = search.ev.costs(cand)
        # per stage, (F + I + W, F + I) ms of one microbatch, for the start-aware re-placement
        work = ([c.forward_ms + c.backward_input_ms + c.backward_weight_ms for c in costs],
                [c.forward_ms + c.backward_input_ms for c in costs])
        yield from neighbours(cand, timeline, dimensions=opts.dimensions, rng=search.rng,
                              allow_recompute=opts.recompute, max_stages_per_rank=max(1, opts.chunks_max), work=work)
