"""CP-SAT's partition + placement (:mod:`octoplan.tuner.cpsat`) as seeds, with policy knobs."""

from __future__ import annotations

from typing import Sequence

from octoplan.tuner.seeds.base import SeedContext, SeedFamily
from octoplan.tuner.space import Candidate, Config

__all__ = ["CpsatSeeds"]


class CpsatSeeds(SeedFamily):
    name = "CP-SAT"

    def applies(self, ctx: SeedContext) -> bool:
        # CP-SAT places stages freely: a fixed placement (--runs-on) keeps none of its layouts
        opts = ctx.opts
        return opts.runs_on == "any" and opts.use_cpsat and {"partition", "placement"} <= set(opts.dimensions)

    def seeds(self, ctx: SeedContext, config: Config, earlier: Sequence[Candidate]) -> list[Candidate]:
        from octoplan.tuner.cpsat import DETERMINISTIC_WALL_FACTOR, WALL_FACTOR, cpsat_seeds  # OR-Tools only when the tuner runs

        opts = ctx.opts
        # CP-SAT's limit is deterministic time (work), so the seeds do not depend on the clock
        found, stats = cpsat_seeds(ctx.evaluator, config, chunks_max=opts.chunks_max,
                                   time_limit_s=max(0.5, min(5.0, opts.time_limit_s / (12 * len(ctx.configs)))),
                                   seed=opts.seed, recompute=opts.recompute,
                                   wall_factor=WALL_FACTOR if opts.max_plans is None else DETERMINISTIC_WALL_FACTOR)
        ctx.stats.setdefault("cpsat", []).extend(stats)
        return found
