"""Chain shifts: a layer passed along a run of stages, every boundary of the run moved by one.

A boundary shift moves one layer between two neighbouring stages. Where every rank between
the one that finishes last and a rank with room carries all it can, a shift only hands the
overload to the next rank, which then finishes last, and a climb stops there. Moving a run of
consecutive boundaries together passes the layer through instead: the stage at one end of the
run loses a layer, the stage at the other end gains one, and every stage between keeps its
layer count. On a model of repeating blocks each of those keeps its load too (a stage of a
mixer and an MoE becomes one of an MoE and a mixer), so only the two ends change.

Stage count and placement stay, so the candidate keeps its op order (each op simply covers
other layers), which is then justified around the new layout. Moves that shed a layer from the
back of a stage onto a later stage leave every rank's start alone; those that shed one from
the front onto an earlier stage start the stages of the run one layer later.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from octoplan.simulator import SimResult
from octoplan.tuner.moves import heat_of, with_layout
from octoplan.tuner.neighbourhoods.base import Neighbourhood
from octoplan.tuner.space import Candidate

if TYPE_CHECKING:
    from octoplan.tuner.climb import Search

__all__ = ["ChainShifts", "CHAIN_SHIFTS", "chain_shifts"]

CHAIN_SHIFTS = 8  # per step of the polish's climb, the chain shifts tried, each with its justifications


def chain_shifts(cand: Candidate, timeline: SimResult) -> list[tuple[tuple[int, ...], str]]:
    """Every chain shift that takes a layer off a stage of the rank that finishes last (the
    least idle after its last op; the lower rank among equals) and hands it to a stage on
    another rank, most promising first: the coolest receiving rank (least busy, as
    :func:`~octoplan.tuner.moves.heat_of` reads it), then the shorter run. Each as (new bounds,
    origin)."""
    bounds, ranks = cand.bounds, cand.ranks
    num_stages = len(ranks)
    last = min(range(timeline.num_ranks), key=lambda r: (timeline.idle_parts(r)[2], r))
    heat = heat_of(timeline)
    found: list[tuple[tuple[float, int], tuple[int, ...], str]] = []
    for s in (s for s in range(num_stages) if ranks[s] == last):
        if bounds[s + 1] - bounds[s] < 2:  # a stage keeps at least one layer
            continue
        # (every stage of the run keeps its layer count, so no stage can end up empty)
        # its first layer back to stage i - 1: boundaries i..s each one layer later
        for i in range(s, 0, -1):
            if ranks[i - 1] != last:
                moved = bounds[:i] + tuple(b + 1 for b in bounds[i:s + 1]) + bounds[s + 1:]
                found.append(((heat.heat(ranks[i - 1]), s - i), moved, f"chain: stage {s}'s first layer to stage {i - 1}"))
        # its last layer on to stage j: boundaries s+1..j each one layer earlier
        for j in range(s + 1, num_stages):
            if ranks[j] != last:
                moved = bounds[:s + 1] + tuple(b - 1 for b in bounds[s + 1:j + 1]) + bounds[j + 1:]
                found.append(((heat.heat(ranks[j]), j - s), moved, f"chain: stage {s}'s last layer to stage {j}"))
    found.sort(key=lambda item: item[0])  # stable: equals keep the order they were found in
    return [(moved, origin) for _, moved, origin in found]


class ChainShifts(Neighbourhood):
    """A layer passed along a run of stages off the rank that finishes last (the ``limit`` most
    promising chain shifts), the order kept and justified around the new layout; tried by the
    search's final polish, from the best plan."""

    name = "chain shifts"
    dimensions = ("schedule", "partition")
    # The polish's alone: on the best plan is where they pay (deepseek-v3, docs/BENCHMARKS.md
    # "Tuner suite"); at every climb's local optimum each would cost a simulation and two
    # justifications, time the climbs spend better elsewhere
    climbs = False
    polish = True

    def __init__(self, limit: int = CHAIN_SHIFTS):
        self.limit = limit

    def moves(self, search: Search, cand: Candidate, timeline: SimResult, deadline: float) -> Iterator[Candidate]:
        if cand.recompute:  # recomputing stages would need their layer counts carried too
            return
        for bounds, origin in chain_shifts(cand, timeline)[:self.limit]:
            moved = with_layout(cand, bounds, cand.ranks, origin)
            yield moved
            yield from search.justified_by(moved, deadline)
