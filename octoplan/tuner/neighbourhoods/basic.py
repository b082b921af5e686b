"""The basic moves of :mod:`octoplan.tuner.moves` as one neighbourhood: one boundary, stage,
placement, policy knob, recomputation or op-order edit at a time, the most promising first
(ranked together by the heat read off the timeline)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from octoplan.ops import Kind
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
        # per stage, its work and its lead (what its predecessor waits on) in ms of one
        # microbatch, as the simulator prices the ops its order holds: F + I + W and F + I where
        # the stage splits its backward, F + B and F + B where it runs one B
        fused = _fused_stages(cand)
        work = ([c.forward_ms + (c.b_ms if s in fused else c.backward_input_ms + c.backward_weight_ms)
                 for s, c in enumerate(costs)],
                [c.forward_ms + (c.b_ms if s in fused else c.backward_input_ms) for s, c in enumerate(costs)])
        yield from neighbours(cand, timeline, dimensions=opts.dimensions, rng=search.rng,
                              allow_recompute=opts.recompute, max_stages_per_rank=max(1, opts.chunks_max), work=work)


def _fused_stages(cand: Candidate) -> set[int]:
    """The stages whose backward is one B op: in a fixed order, those with a B; under the
    policy scheduler, those of the ranks that do not split."""
    if cand.fixed is not None:
        return {op.stage for ops in cand.fixed for op in ops if op.kind is Kind.B}
    assert cand.policies is not None
    return {s for s, rank in enumerate(cand.ranks) if not cand.policies[rank].split}
