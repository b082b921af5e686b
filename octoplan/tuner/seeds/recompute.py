"""Recomputing copies of the best seeds: every stage recomputes its activations, and the climbs
turn it off rank by rank and stage by stage where memory allows."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator, Sequence

from octoplan.tuner.climb import climbs_end_s
from octoplan.tuner.seeds.base import Ranked, SeedContext, SeedFamily
from octoplan.tuner.space import Candidate

__all__ = ["RecomputingCopies", "RECOMPUTE_SEEDS"]

RECOMPUTE_SEEDS = 8  # the fastest seeds that do not fit memory, copied with recomputation


class RecomputingCopies(SeedFamily):
    """Copies of the :data:`RECOMPUTE_SEEDS` fastest seeds that do not fit memory, and of half
    as many of the fastest that do (those whose admissions memory throttles can run deeper
    with it), every stage recomputing."""

    name = "recomputing copies"

    def applies(self, ctx: SeedContext) -> bool:
        return ctx.opts.recompute and "schedule" in ctx.opts.dimensions

    def from_ranked(self, ctx: SeedContext, ranked: Sequence[Ranked]) -> Iterator[tuple[int, Candidate]]:
        search = ctx.search
        short = sorted((item for item in ranked if item[0][0] != 0 and not item[2].recompute),
                       key=lambda item: (search.ev.score(item[2]).judged_ms, item[1]))
        fitting = [item for item in ranked if item[0][0] == 0 and not item[2].recompute]
        for _, index, cand in short[:RECOMPUTE_SEEDS] + fitting[:RECOMPUTE_SEEDS // 2]:
            if search.clock.elapsed() >= climbs_end_s(search.opts.time_limit_s):
                return
            yield index, replace(cand, recompute=cand.every_stage, origin=f"{cand.origin}, every rank recomputes")
