"""The search's seed families: where the plans it ranks and climbs from come from.

The baselines come first (:mod:`octoplan.tuner.seeds.baselines`: they are also the rows the
result compares against). Then, for each configuration, every family in
:data:`SEED_FAMILIES` that applies adds its seeds (:meth:`SeedFamily.seeds`); the search
prices and ranks them all, and every family then adds seeds made from the best ranked ones
(:meth:`SeedFamily.from_ranked`: recomputing copies, justified orders), in the same order.
The order is fixed, so a run stays deterministic.

A new seed family is a new module here: a subclass of :class:`SeedFamily` with ``applies``
and ``seeds`` (or ``from_ranked``), added to :data:`SEED_FAMILIES` in the place its seeds
should rank among equals (``tune(..., seed_families=...)`` takes another list, for an experiment).
"""

from octoplan.tuner.seeds.base import Ranked, SeedContext, SeedFamily
from octoplan.tuner.seeds.cpsat import CpsatSeeds
from octoplan.tuner.seeds.fill_capped import FillCappedSeeds
from octoplan.tuner.seeds.justified import JUSTIFIED_SEEDS, LIST_ORDERED_SEEDS, JustifiedSeeds, ListOrderedSeeds
from octoplan.tuner.seeds.megatron import MegatronSeeds
from octoplan.tuner.seeds.policy import PolicySeeds
from octoplan.tuner.seeds.rank_balanced import RankBalancedSeeds
from octoplan.tuner.seeds.recompute import RECOMPUTE_SEEDS, RecomputingCopies
from octoplan.tuner.seeds.start_aware import StartAwareSeeds

__all__ = ["SeedFamily", "SeedContext", "Ranked", "SEED_FAMILIES", "MegatronSeeds", "PolicySeeds", "RankBalancedSeeds", "FillCappedSeeds", "CpsatSeeds",
           "StartAwareSeeds", "RecomputingCopies", "JustifiedSeeds", "JUSTIFIED_SEEDS", "ListOrderedSeeds",
           "LIST_ORDERED_SEEDS", "RECOMPUTE_SEEDS"]

SEED_FAMILIES: tuple[SeedFamily, ...] = (
    MegatronSeeds(),  # --runs-on megatron: Megatron-LM's own orders, partitions snapped to its layers
    PolicySeeds(),  # balanced partitions, loop and V placements, the policy scheduler's knobs
    RankBalancedSeeds(),  # loop and V cut for the busiest rank's least work
    FillCappedSeeds(),  # loop and V cut for the least fill cap (CP-SAT, in tunes long enough)
    CpsatSeeds(),  # CP-SAT's partition + placement
    StartAwareSeeds(),  # the seeds so far re-placed so late-starting ranks carry less
    RecomputingCopies(),  # from the ranked seeds: the best copied with every stage recomputing
    JustifiedSeeds(),  # from the ranked seeds: the best layouts' orders justified
    ListOrderedSeeds(),  # from the ranked seeds: the best layouts list-ordered, longest tail first
)
