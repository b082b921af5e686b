"""Justified orders of the best seeds (:mod:`octoplan.schedules.justify`). Justification often
closes most of a list scheduler's bubbles on uneven or irregular layouts, so the climbs should
start from the justified plans."""

from __future__ import annotations

from typing import Iterator, Sequence

from octoplan.tuner.seeds.base import Ranked, SeedContext, SeedFamily
from octoplan.tuner.space import Candidate

__all__ = ["JustifiedSeeds", "JUSTIFIED_SEEDS"]

JUSTIFIED_SEEDS = 8  # the best seeds whose orders are justified before the climbs


class JustifiedSeeds(SeedFamily):
    """The justified orders of the best :data:`JUSTIFIED_SEEDS` layouts. A count, not a share
    of the time, bounds the work, so which seeds are justified does not depend on the
    machine's speed."""

    name = "justified orders"

    def applies(self, ctx: SeedContext) -> bool:
        return "schedule" in ctx.opts.dimensions

    def from_ranked(self, ctx: SeedContext, ranked: Sequence[Ranked]) -> Iterator[tuple[int, Candidate]]:
        search = ctx.search
        layouts: set = set()
        for _, index, cand in ranked:
            if len(layouts) >= JUSTIFIED_SEEDS or search.clock.out():
                return
            layout = (cand.config, cand.bounds, cand.ranks)
            if layout in layouts:
                continue
            layouts.add(layout)
            for moved in search.justified(cand):
                yield index, moved
