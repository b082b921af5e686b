"""Start-aware re-placement: the layouts seeded so far, their stages re-placed so the busiest
ranks hold early stages and late-starting ranks carry less (:mod:`octoplan.tuner.arrange`),
with policy knobs."""

from __future__ import annotations

from typing import Sequence

from octoplan.tuner.arrange import start_aware
from octoplan.tuner.seeds.base import SeedContext, SeedFamily, with_policies
from octoplan.tuner.space import Candidate, Config, Evaluator

__all__ = ["StartAwareSeeds", "start_aware_seeds"]


def start_aware_seeds(evaluator: Evaluator, seeds: Sequence[Candidate], config: Config,
                      chunks_max: int) -> list[Candidate]:
    """``seeds``' layouts (of ``config``) re-placed by :func:`octoplan.tuner.arrange.start_aware`,
    each new layout once, at three policy settings."""
    out: list[Candidate] = []
    done: set = set()
    for cand in seeds:
        layout = (cand.bounds, cand.ranks)
        if layout in done or cand.num_stages < 2:
            continue
        done.add(layout)
        costs = evaluator.costs(cand)
        work = [c.forward_ms + c.backward_input_ms + c.backward_weight_ms for c in costs]
        lead = [c.forward_ms + c.backward_input_ms for c in costs]
        per_rank = max(max(cand.ranks.count(r) for r in range(config.pp)), max(1, chunks_max))
        ranks = start_aware(cand.ranks, work, lead, num_ranks=config.pp, microbatches=config.microbatches,
                            max_per_rank=per_rank)
        if ranks == cand.ranks or (cand.bounds, ranks) in done:
            continue
        done.add((cand.bounds, ranks))
        out += with_policies(config, cand.bounds, ranks, f"start-aware placement of {cand.origin}")
    return out


class StartAwareSeeds(SeedFamily):
    name = "start-aware re-placement"

    def applies(self, ctx: SeedContext) -> bool:
        # it places stages freely: a fixed placement (--runs-on) keeps none of its layouts
        return ctx.opts.runs_on == "any" and "placement" in ctx.opts.dimensions

    def seeds(self, ctx: SeedContext, config: Config, earlier: Sequence[Candidate]) -> list[Candidate]:
        return start_aware_seeds(ctx.evaluator, earlier, config, ctx.opts.chunks_max)
