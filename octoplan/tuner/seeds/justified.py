"""New orders for the best seeds' layouts, made before the climbs: justified
(:mod:`octoplan.schedules.justify`), and rebuilt by the longest-tail-first list scheduler
(:mod:`octoplan.schedules.list_order`), justified. Justification often closes most of a list
scheduler's bubbles on uneven or irregular layouts; where the policy scheduler's knobs do not
fit a layout (stages that differ), a scheduler that follows the longest remaining chain can
start from a better order than justification reaches from the policy's. So the climbs should
start from these plans."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

from octoplan.tuner.climb import climbs_end_s
from octoplan.tuner.seeds.base import Ranked, SeedContext, SeedFamily
from octoplan.tuner.space import LONGEST_TAIL, Candidate

if TYPE_CHECKING:
    from octoplan.tuner.climb import Search

__all__ = ["JustifiedSeeds", "ListOrderedSeeds", "JUSTIFIED_SEEDS", "LIST_ORDERED_SEEDS"]

JUSTIFIED_SEEDS = 8  # the best seeds whose orders are justified before the climbs
LIST_ORDERED_SEEDS = 8  # the best seeds whose layouts are list-ordered before the climbs


class _BestLayoutsReordered(SeedFamily, ABC):
    """New orders of the best ``count`` layouts, one seed per layout. A count, not a share of
    the time, bounds the work, so which seeds are reordered does not depend on the machine's
    speed."""

    count: int = 0

    @abstractmethod
    def reorder(self, search: Search, cand: Candidate) -> Iterable[Candidate]:
        """The new orders of ``cand``'s layout."""

    def applies(self, ctx: SeedContext) -> bool:
        return "schedule" in ctx.opts.dimensions

    def from_ranked(self, ctx: SeedContext, ranked: Sequence[Ranked]) -> Iterator[tuple[int, Candidate]]:
        search = ctx.search
        layouts: set = set()
        for _, index, cand in ranked:
            if len(layouts) >= self.count or search.clock.out():
                return
            layout = (cand.config, cand.bounds, cand.ranks)
            if layout in layouts:
                continue
            layouts.add(layout)
            for moved in self.reorder(search, cand):
                yield index, moved


class JustifiedSeeds(_BestLayoutsReordered):
    """The justified orders of the best :data:`JUSTIFIED_SEEDS` layouts."""

    name = "justified orders"
    count = JUSTIFIED_SEEDS

    def reorder(self, search: Search, cand: Candidate) -> Iterable[Candidate]:
        # paced, as the climbs' justifications are: one of a large plan takes seconds
        # (llama3-70b-a100's, 16 ranks x 128 microbatches: 1.5 s), and one started just before
        # the limit overran it
        return search.justified_by(cand, climbs_end_s(search.opts.time_limit_s))


class ListOrderedSeeds(_BestLayoutsReordered):
    """The longest-tail-first orders of the best :data:`LIST_ORDERED_SEEDS` layouts, each with
    its justified orders."""

    name = "longest-tail-first orders"
    count = LIST_ORDERED_SEEDS

    def reorder(self, search: Search, cand: Candidate) -> Iterable[Candidate]:
        # within the climbs' time: the rest of the limit is the polish's and the final plan's
        return search.rebuilt_orders(cand, climbs_end_s(search.opts.time_limit_s), LONGEST_TAIL)
