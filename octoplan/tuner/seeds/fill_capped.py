"""Fill-capped cuts: a V and a loop of two stages per rank, cut where CP-SAT puts the cut points
of the fill caps (:mod:`octoplan.tuner.fill_caps`), with policy knobs.

The rank-balanced cuts (:mod:`octoplan.tuner.seeds.rank_balanced`) give the busiest rank the
least work, but a rank also waits for the first microbatch to reach each of its stages, and
for microbatches to come at the rate of the slowest forward ahead of it. The fill model counts
both, and its cut points make layouts whose fill and drain cost less: on internvl2-8b a 60 s
tune with these seeds ends 2.8% faster (docs/BENCHMARKS.md, "Tuner suite").

CP-SAT gets ``FILL_SEED_TIME_S`` deterministic seconds per shape (each solve's wall time is in
the plan's tuner stats, under ``fill_capped``), so the family stays out of short tunes: it
solves only in tunes of ``FILL_SEED_MIN_LIMIT_S`` or more, where the solve should end before
``FILL_SEED_SHARE`` of the time limit is spent (at the pace of the solves so far; it is cut off
there too), and each (pp, microbatches) once. Under a plan budget (``--max-plans``) no wall
time cuts a solve off, so the tune stays deterministic.
"""

from __future__ import annotations

import time
from typing import Iterator, Sequence

from octoplan.tuner.climb import climbs_end_s
from octoplan.tuner.fill_caps import fill_cap, shape_ranks
from octoplan.tuner.seeds.base import Ranked, SeedContext, SeedFamily, with_policies
from octoplan.tuner.space import LONGEST_TAIL, Candidate, Config

__all__ = ["FILL_SEED_MIN_LIMIT_S", "FILL_SEED_SHAPES", "FILL_SEED_SHARE", "FILL_SEED_TIME_S", "FillCappedSeeds"]

FILL_SEED_SHAPES = (("zigzag", 2), ("loop", 2))  # a V and a loop of two stages per rank
FILL_SEED_TIME_S = 8.0  # CP-SAT's deterministic seconds per shape: 4 give no usable cut points on 16-48 stages
FILL_SEED_SHARE = 0.25  # solve only while less than this share of the time limit is spent
FILL_SEED_MIN_LIMIT_S = 30.0  # and only in tunes of at least this time limit
ORIGIN = "fill-capped"


def _expected_wall_s(solves: Sequence[dict]) -> float:
    """How long the next solve should take: as long as the longest so far (the same profile, so
    about the same model), or its deterministic seconds before the first. On the clock a solve
    runs only if it should end within the family's share of the limit: llama3-70b's two took
    10-13 s each on this project's 2-core machine, and the second, started just inside the
    share, took a sixth of a 60 s tune from the climbs."""
    return max((solve["wall_s"] for solve in solves), default=FILL_SEED_TIME_S)


class FillCappedSeeds(SeedFamily):
    name = "fill-capped cuts"

    def applies(self, ctx: SeedContext) -> bool:
        # new cut points and placements under policy orders, as the rank-balanced cuts
        opts = ctx.opts
        return (opts.runs_on == "any" and "partition" in opts.dimensions and "placement" in opts.dimensions
                and opts.chunks_max >= 2)

    def seeds(self, ctx: SeedContext, config: Config, earlier: Sequence[Candidate]) -> list[Candidate]:
        pp, m = config.pp, config.microbatches
        if pp < 2 or ctx.profile.num_layers < 2 * pp:
            return []
        # each solve is reported in the plan's tuner stats, and read back here: the two rank
        # orders of one pp (dp > 1) share their cut points
        solves = ctx.stats.setdefault("fill_capped", [])
        out: list[Candidate] = []
        for shape, k in FILL_SEED_SHAPES:
            label = "V" if (shape, k) == ("zigzag", 2) else f"{shape} x{k}"
            done = next((s for s in solves if (s["pp"], s["microbatches"], s["shape"]) == (pp, m, label)), None)
            if done is None:
                opts = ctx.opts
                left_s = FILL_SEED_SHARE * opts.time_limit_s - ctx.search.clock.elapsed()
                # under a plan budget the clock counts plans, which no solve adds: a solve needs
                # none of the share and no wall time cuts it off, so the tune stays deterministic;
                # on the clock it is cut off at the share's end (deepseek-v3's V takes 26 s)
                on_clock = not opts.max_plans
                if opts.time_limit_s < FILL_SEED_MIN_LIMIT_S or left_s <= (_expected_wall_s(solves) if on_clock else 0.0):
                    continue
                started = time.perf_counter()
                cap = fill_cap(ctx.profile, ctx.cluster, microbatches=m, ranks=shape_ranks(shape, pp, k),
                               time_limit_s=FILL_SEED_TIME_S, wall_limit_s=left_s if on_clock else None)
                done = {"pp": pp, "microbatches": m, "shape": label,
                        "bounds": list(cap.bounds) if cap else None, "fill_ms": round(cap.found_ms, 4) if cap else None,
                        "wall_s": round(time.perf_counter() - started, 3)}
                solves.append(done)
            if done["bounds"] is not None:
                out += with_policies(config, tuple(done["bounds"]), shape_ranks(shape, pp, k), f"{ORIGIN} {label}")
        return out

    def from_ranked(self, ctx: SeedContext, ranked: Sequence[Ranked]) -> Iterator[tuple[int, Candidate]]:
        """Each fill-capped layout's best order rebuilt longest tail first, justified, whether
        or not it is among the best layouts that :class:`~octoplan.tuner.seeds.justified.ListOrderedSeeds`
        rebuilds: a policy order seldom suits cut points chosen for the fill."""
        search, done = ctx.search, set()
        for _, index, cand in ranked:
            layout = (cand.config, cand.bounds, cand.ranks)
            if cand.origin.startswith(ORIGIN) and layout not in done and not search.clock.out():
                done.add(layout)
                for moved in search.rebuilt_orders(cand, climbs_end_s(search.opts.time_limit_s), LONGEST_TAIL):
                    yield index, moved
