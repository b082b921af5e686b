"""Policy-scheduled seeds: balanced partitions in loop and V placements, with the policy list
scheduler's knobs (:mod:`octoplan.schedules.policy`) at a few settings: backward fused or split
into I and W, warm-ups 1 or 2 times the pipeline's depth, with or without the warm-up gap."""

from __future__ import annotations

from typing import Sequence

from octoplan.partition import balanced_partition
from octoplan.profile import Profile
from octoplan.schedules import loop_placement, v_placement
from octoplan.tuner.seeds.base import SPLIT_SETTINGS, SeedContext, SeedFamily, with_policies
from octoplan.tuner.space import Candidate, Config, bounds_of

__all__ = ["PolicySeeds", "policy_seeds"]


def policy_seeds(profile: Profile, config: Config, chunks_max: int) -> list[Candidate]:
    """A balanced partition into 1..``chunks_max`` stages per rank, in a loop (and a V at 2 per
    rank), each with four settings of the policy knobs."""
    out: list[Candidate] = []
    pp = config.pp
    for per_rank in range(1, max(1, chunks_max) + 1):
        num_stages = per_rank * pp
        if num_stages > profile.num_layers:
            break
        bounds = bounds_of(balanced_partition(profile, num_stages))
        placements = [("loop", tuple(loop_placement(pp, num_stages)))]
        if per_rank == 2:
            placements.append(("V", tuple(v_placement(pp, num_stages))))
        for name, ranks in placements:
            out += with_policies(config, bounds, ranks, f"policy seed: balanced, {name} x{per_rank}",
                                 settings=((False, 1.0, False), *SPLIT_SETTINGS))
    return out


class PolicySeeds(SeedFamily):
    name = "policy seeds"

    def applies(self, ctx: SeedContext) -> bool:
        # a policy order is no Megatron order; without schedule and placement moves the
        # baselines cover these layouts, unless there are no baselines
        opts = ctx.opts
        return opts.runs_on != "megatron" and (
            "schedule" in opts.dimensions or "placement" in opts.dimensions or not opts.baselines)

    def seeds(self, ctx: SeedContext, config: Config, earlier: Sequence[Candidate]) -> list[Candidate]:
        return policy_seeds(ctx.profile, config, ctx.opts.chunks_max)
