"""Rank-balanced cuts: two stages per rank in a loop and in a V, the cut points chosen so the
busiest rank carries the least work (:mod:`octoplan.tuner.placed_cuts`, exact), with policy
knobs. The policy seeds balance the stages instead: with two stages per rank, the rank that
holds a heavy end stage (the head's) then carries a full-size stage besides."""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

from octoplan.costs import cheaper_backward, to_ticks
from octoplan.profile import Profile
from octoplan.schedules import loop_placement, v_placement
from octoplan.tuner.placed_cuts import loop_cuts, v_cuts
from octoplan.tuner.seeds.base import SeedContext, SeedFamily, with_policies
from octoplan.tuner.space import Candidate, Config

__all__ = ["RankBalancedSeeds", "rank_balanced_seeds"]


@lru_cache(maxsize=64)
def _cuts(work: tuple[int, ...], pp: int) -> tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]:
    """(shape, cut points, placement) of the loop and the V: a tune over a global batch asks for
    the same pp at several microbatch counts, and the cuts depend on the layers and pp alone."""
    return tuple((name, cut(work, pp).bounds, tuple(place(pp, 2 * pp)))
                 for name, cut, place in (("loop", loop_cuts, loop_placement), ("V", v_cuts, v_placement)))


def rank_balanced_seeds(profile: Profile, config: Config) -> list[Candidate]:
    """A loop and a V of 2 x pp stages cut for the busiest rank's least F + I + W (a layer's
    backward weighed as the cheaper of I + W and its fused B, as the simulator prices it), each
    at three policy settings; none with one rank or fewer layers than stages."""
    pp = config.pp
    if pp < 2 or profile.num_layers < 2 * pp:
        return []
    work = tuple(to_ticks(layer.forward_ms + sum(cheaper_backward(layer))) for layer in profile.layers)
    out: list[Candidate] = []
    for name, bounds, ranks in _cuts(work, pp):
        out += with_policies(config, bounds, ranks, f"rank-balanced {name} x2")
    return out


class RankBalancedSeeds(SeedFamily):
    name = "rank-balanced cuts"

    def applies(self, ctx: SeedContext) -> bool:
        # new cut points under policy orders: the partition must be tunable, and a policy order
        # is no Megatron order
        opts = ctx.opts
        return (opts.runs_on != "megatron" and "partition" in opts.dimensions
                and ("schedule" in opts.dimensions or "placement" in opts.dimensions) and opts.chunks_max >= 2)

    def seeds(self, ctx: SeedContext, config: Config, earlier: Sequence[Candidate]) -> list[Candidate]:
        return rank_balanced_seeds(ctx.profile, config)
